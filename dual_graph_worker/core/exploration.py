"""The re-measurement budget, in steps of the current mode: every step earns a share of one,
every re-measurement is charged its price; and a running re-measurement of speculation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class Probe:
    """A running re-measurement of speculation: its price per step, the steps priced and run,
    its steps' batch-mean acceptance (count, sum, sum of squares), and, where what it has seen
    at a round's end leaves the answer open (speculation wins at the top of its error, not at
    the bottom), the price a step it would run on at (`open_price`; None: not open)."""

    step_price: float
    priced: int
    drift: float = 1.0       # the share of its step time estimate it is judged at
    ran: int = 0
    seen: int = 0
    total: float = 0.0
    squares: float = 0.0
    open_price: Optional[float] = None

    def add(self, mean: float) -> None:
        self.seen += 1
        self.total += mean
        self.squares += mean * mean


class ExploreBudget:
    """At most one full-price re-measurement banked (`bank` steps): spent in a burst, more would
    cost more than the budget's share of a short workload. The first one is paid for. One
    costing more than the bank is paid from a second account, in debt, repaid by what the full
    bank cannot hold: it never starves the cheap ones, and the next costly one waits until the
    debt is paid. `cap`: DGW_EXPLORE_CAP, the dearest one allowed in banks (0: no cap)."""

    def __init__(self, bank: float, cap: float) -> None:
        self.bank = bank
        self.cap = cap
        self.allowance = bank
        self.debt = 0.0

    def earn(self, income: float) -> None:
        """The bank fills first; what it cannot hold repays the debt."""
        room = self.bank - self.allowance
        if income <= room:
            self.allowance += income
        else:
            self.allowance = self.bank
            self.debt = max(self.debt - (income - room), 0.0)

    def charge(self, price: float) -> None:
        if price > self.bank:
            self.debt += price
        else:
            self.allowance -= price

    def affordable(self, price: float) -> bool:
        """One costing more than the bank waits for a full bank and no debt, then goes into
        debt: rare, never ruled out (else acceptance rising where speculation looked hopeless
        goes unseen for good) unless the cap caps its price (each costs 2-5% of a short
        workload; docs/design.md weighs the two)."""
        if price > self.bank:
            cap = self.cap
            return (not cap or price <= cap * self.bank) and self.allowance >= self.bank \
                and self.debt < 1e-9
        return self.allowance >= price
