"""ResultClock: a batch's cost from its launch and its result's processing, with an injected
clock, in the synchronous order and in SGLang's overlap order."""

from dual_graph_worker.core.timing import ResultClock


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_synchronous_batches_cost_their_turn_and_idle_gaps_do_not_count():
    now = Clock()
    rc = ResultClock(clock=now)
    rc.launched("a")
    now.t = 0.005
    assert rc.processed() == ("a", 0.005) and rc.peek() is None
    now.t = 10.0                       # idle
    rc.launched("b")
    now.t = 10.004
    tag, cost = rc.processed()
    assert tag == "b" and abs(cost - 0.004) < 1e-9


def test_under_overlap_a_cost_runs_to_the_processing_after_the_next_launch():
    """The scheduler launches batch n+1, then processes batch n: n's cost is the time between
    the two processings, so it holds n+1's host launch; `peek` says what that was."""
    now = Clock()
    rc = ResultClock(clock=now)
    rc.launched("a")
    now.t = 0.001
    rc.launched("b")
    now.t = 0.006
    tag, cost = rc.processed()
    assert tag == "a" and abs(cost - 0.006) < 1e-12 and rc.peek() == "b"
    now.t = 0.007
    rc.launched("c")                   # its launch took the host until 0.020
    now.t = 0.020
    tag, cost = rc.processed()
    assert tag == "b" and abs(cost - 0.014) < 1e-12 and rc.peek() == "c"
    assert rc.in_flight == 1


def test_a_result_that_never_came_back_falls_off_the_front():
    now = Clock()
    rc = ResultClock(clock=now, max_in_flight=2)
    for tag in "abc":
        rc.launched(tag)
    assert rc.in_flight == 2 and rc.peek() == "b"
    assert rc.processed()[0] == "b"


def test_a_launch_older_than_a_result_can_find_is_dropped():
    """Under overlap a result finds its own launch and the next pending: an older one lost its
    result, and pairing past it would give every later batch the one before it's cost."""
    now = Clock()
    rc = ResultClock(clock=now, depth=2)
    for tag in "abc":                  # a's result never comes
        rc.launched(tag)
    assert rc.processed()[0] == "b" and rc.peek() == "c"
    assert rc.processed()[0] == "c" and rc.in_flight == 0
