"""The two-cycle toy pair (acceptance set by where a prompt ends) and the accept-shift driver."""

import numpy as np
import torch

from bench.reference.accept_shift import ShiftingPrompts, follow_steps
from dual_graph_worker.engines.reference.build import EngineSpec, engine_from_checkpoints
from bench.reference.loadgen import Phase, run_phase
from dual_graph_worker.engines.reference.toy import (two_cycle_permutations,
                                                     write_two_cycle_checkpoints)
from bench.reference.variants import PoolSizes, build_variant


def _cycle_of(p: torch.Tensor, start: int) -> set[int]:
    seen, t = set(), start
    while t not in seen:
        seen.add(t)
        t = int(p[t])
    return seen


def test_the_target_chain_has_two_cycles_and_the_draft_agrees_on_one():
    perms, easy = two_cycle_permutations(64, seed=3)
    easy_set = set(torch.nonzero(easy).flatten().tolist())
    hard_set = set(range(64)) - easy_set
    assert len(easy_set) == 32
    assert _cycle_of(perms.p, min(easy_set)) == easy_set
    assert _cycle_of(perms.p, min(hard_set)) == hard_set
    assert bool((perms.s[easy] == perms.p[easy]).all())
    assert not bool((perms.s[~easy] == perms.p[~easy]).any())


def test_real_acceptance_follows_the_cycle_a_prompt_ends_in(tmp_path):
    ckpt, perms, easy = write_two_cycle_checkpoints(tmp_path, hidden=64)
    k = 3
    engine = engine_from_checkpoints(ckpt.target, ckpt.drafts["two-cycle"],
                                     EngineSpec(num_draft_tokens=k, max_requests=4,
                                                max_context=48))
    worker = build_variant("static-spec", engine, PoolSizes.up_to(4, 4), use_cuda_graphs=False,
                           calib_context=16, progress=False, log=lambda s: None).worker
    pools = {"easy": np.flatnonzero(easy.numpy()), "hard": np.flatnonzero(~easy.numpy())}
    source = ShiftingPrompts(("easy", "hard"), 4, pools, 64)
    lens: dict[bool, list[int]] = {True: [], False: []}

    def record(result):
        for i in range(len(result.rids)):
            toks = result.tokens_for(i)
            lens[bool(easy[toks[0]])].append(len(toks))

    r = run_phase(worker, Phase(4, 8, 8, 24), 64, collect_outputs=True, prompts=source,
                  on_step=record)
    assert all(list(o.output) == perms.continuation(o.prompt[-1], o.requested) for o in r.outputs)
    # Easy requests accept the whole chain (capped by tokens left), hard ones only the bonus.
    assert max(lens[True]) == k + 1 and np.mean(lens[True]) > k
    assert set(lens[False]) == {1}
    assert [bool(easy[o.prompt[-1]]) for o in r.outputs] == [True] * 4 + [False] * 4


def test_follow_steps_counts_from_the_mix_crossing_to_the_settled_mode():
    trace = []
    for step in range(40):
        share = 1.0 if step < 12 else 0.0 if step >= 16 else 0.5 - 0.1 * (step - 12)
        mode = "spec" if step < 19 else "decode"
        trace.append({"step": step, "phase": 0 if step < 10 else 1, "easy_share": share,
                      "mode": mode})
    first, second = follow_steps(trace)
    assert first["settled_mode"] == "spec" and first["steps_to_follow"] == 0
    assert second["settled_mode"] == "decode" and second["mix_crossed_at"] == 13
    assert second["steps_to_follow"] == 19 - 13


def test_steps_are_tagged_with_the_phase_of_the_latest_prompt_issued():
    """A step belongs to the phase the batch turns to: that of the latest prompt issued, not
    of the next one (which tagged every boundary one prompt early)."""
    pools = {"easy": np.arange(0, 32), "hard": np.arange(32, 64)}
    source = ShiftingPrompts(("easy", "hard"), 4, pools, 64)
    rng = np.random.default_rng(0)
    assert source.phase == 0
    prompts = source(rng, 4, 8)                      # phase 0's four
    assert source.phase == 0 and all(p[-1] < 32 for p in prompts)
    prompts = source(rng, 2, 8)                      # phase 1's first two
    assert source.phase == 1 and all(p[-1] >= 32 for p in prompts)


def test_a_phase_whose_prompts_all_joined_with_the_next_has_no_figures_not_a_crash(tmp_path):
    """Two prompts a phase at concurrency 4: the first admission issues phase 0 and phase 1
    together, so phase 0 runs no step of its own. The run still ends with its JSON: that
    phase's figures are None."""
    from bench.reference.accept_shift import ShiftConfig, run_shift

    cfg = ShiftConfig(("easy", "hard", "easy"), concurrency=4, requests_per_phase=2,
                      input_len=8, output_len=8, hidden=64)
    result = run_shift(cfg, log=lambda line: None)
    assert result["tokens_equal_known_chain"]
    rows = result["phases"]
    assert len(rows) == 3
    assert [row["dynamic"]["tok_s"] is not None for row in rows] == [False, True, True]
    assert [row["dynamic_over_best"] is not None for row in rows] == [False, True, True]
    assert sum(rows[0]["dynamic"]["modes"].values()) == 0
