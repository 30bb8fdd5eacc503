"""SGLang 0.5.17 integration: the dual-graph EAGLE-3 worker as an SGLang plugin.

A user selects it with a server flag (the plugin is found through the entry-point group
``sglang.srt.plugins``, declared in pyproject.toml)::

    python -m sglang.launch_server --model-path TARGET \\
        --speculative-algorithm DUAL_GRAPH_EAGLE3 --speculative-draft-model-path EAGLE3_DRAFT \\
        --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4

Worker settings that SGLang's own arguments cannot carry come from ``DGW_*`` environment
variables or a JSON file named by ``DGW_CONFIG`` (see ``config.py``).

Modules, one job each:
- ``version``       : the supported SGLang release and the check with its fix-naming error;
- ``config``        : ``WorkerConfig`` from env / JSON, and the policy it builds;
- ``capture_config``: DGW_CAPTURE_CONFIG, a tuned capture config: stale-config refusal,
                      decode pool and threshold, the spec-pool flags (``dgw capture-flags``);
- ``decision``      : engine-agnostic step planning (PolicyInputs from a batch size, mode choice,
                      the ledger that turns launched steps + accept counts into StepRecords);
- ``layout``        : engine-agnostic tensors of a decode-mode step in the speculative layout;
- ``calibration``   : timing replays into a CalibrationTable (engine-agnostic, timer injected);
- ``step_log``      : JSONL step log for the load-ramp plot;
- ``cycle_policy``  : DGW_POLICY=cycle, a fixed spec/decode schedule (a profiling aid);
- ``nvtx_spans``    : NVTX step/stage ranges, switch marks and the profiling window (routes
                      EAGLE-3's own stage hooks only while a profiler listens);
- ``server_args_hook``: the server-argument adjustments (decode pool sizes, spec pool cap);
- ``spec_algo``     : the CustomSpecAlgo subclass that mirrors EAGLE3's predicates (imports SGLang);
- ``decode_pool``   : the width-1 target DECODE graph runner and its slot swap (imports SGLang);
- ``backlog``       : lazy catch-up's host bookkeeping per request-pool row (engine-agnostic);
- ``catch_up``      : lazy catch-up's stash arena and catch-up batch indices (plain torch);
- ``draft_sync``    : the one-token draft extend that keeps the draft current (imports SGLang);
- ``lazy_sync``     : DGW_CONTINUITY=lazy-catch-up, opt-in and not yet run on a GPU: stash in
                      decode mode, one draft extend per backlog before speculating (imports SGLang);
- ``worker``        : ``DualGraphEagleWorker``, the EAGLEWorkerV2 subclass (imports SGLang);
- ``plugin``        : ``register()``, the entry point.

Only ``spec_algo``, ``decode_pool``, ``draft_sync``, ``lazy_sync``, ``worker`` and
``plugin.register`` import SGLang; everything else is importable (and unit-tested) without it.
"""
