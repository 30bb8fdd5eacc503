"""What each continuity strategy asks of the server at launch, checked in the main process
before any worker exists. Kept apart from the strategies (continuity.py, lazy_sync.py) so the
launch path never imports their GPU stack."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Optional, Protocol

from dual_graph_worker.core.continuity import Continuity
from dual_graph_worker.core.errors import ConfigError
from dual_graph_worker.engines.sglang.radix import BACKEND as RADIX_BACKEND
from dual_graph_worker.engines.sglang.server_args_hook import (CATCH_UP_BACKENDS,
                                                              catch_up_backend_refusal)

# The server arguments that choose an attention backend the catch-up's draft extend may run on.
_BACKEND_ARGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                 "speculative_draft_attention_backend")


class ContinuityLaunch(Protocol):
    radix_backend: ClassVar[Optional[str]]     # the radix cache it needs; None: SGLang's own

    @staticmethod
    def check_server_args(server_args: Any) -> None:
        """ConfigError naming the fix where the strategy cannot run with these arguments."""


class KeepCurrentLaunch:
    radix_backend: Optional[str] = None     # SGLang's own: the draft's KV is always current

    @staticmethod
    def check_server_args(server_args: Any) -> None:
        """Runs with whatever SGLang's EAGLE3 runs with."""


class LazyCatchUpLaunch:
    radix_backend: Optional[str] = RADIX_BACKEND    # keeps the radix cache draft-valid (radix.py)

    @staticmethod
    def check_server_args(server_args: Any) -> None:
        """What DGW_CONTINUITY=lazy-catch-up cannot run with (lazy_sync.py says why), on the
        backends SGLang resolved (its defaults are declared, not yet written to the fields,
        when the validator runs)."""
        from sglang.srt.arg_groups.overrides import resolved_view

        resolved = resolved_view(server_args)
        other = {name: getattr(resolved, name, None) for name in _BACKEND_ARGS
                 if getattr(resolved, name, None) not in (None, *CATCH_UP_BACKENDS)}
        if other:
            name, value = next(iter(other.items()))
            chosen = ("SGLang's default for this GPU" if getattr(server_args, name, None) is None
                      else "set by the launch command")
            raise ConfigError(catch_up_backend_refusal(f"this server's {name}",
                                                       f"{value!r} ({chosen})"))
        if str(getattr(server_args, "disaggregation_mode", "null") or "null") != "null":
            raise ConfigError("DGW_CONTINUITY=lazy-catch-up does not support PD disaggregation "
                              "(prebuilt decode batches bypass the worker, so a reused request "
                              "row would keep a stale backlog); use DGW_CONTINUITY=keep-current")
        if getattr(server_args, "enable_unified_memory", False):
            raise ConfigError("DGW_CONTINUITY=lazy-catch-up does not support "
                              "--enable-unified-memory (the stash is indexed by KV slot id); "
                              "use DGW_CONTINUITY=keep-current")


LAUNCH: Mapping[Continuity, type[ContinuityLaunch]] = MappingProxyType({
    Continuity.KEEP_CURRENT: KeepCurrentLaunch,
    Continuity.LAZY_CATCH_UP: LazyCatchUpLaunch,
})
