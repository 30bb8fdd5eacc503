"""Profiling for the dual-graph worker.

- `dual_graph_worker.core.nvtx`: the NVTX ranges and marks the worker emits (domain "dgw"); free
  when no profiler listens. Keep this import light: it is on the worker's hot path.
- `profiling.check`: reads an nsys report (or a torch.profiler trace) and checks the steady
  state; `python -m profiling.check REPORT --out DIR`, or `check_report(...)` from code.
  `profiling.engines` says what a step of each engine (reference, sglang) should launch.
- `profiling.workload` / `bench.sglang.profile_workload`: the scripted workloads `make nsys-profile`
  runs (reference engine; `ENGINE=sglang`: the SGLang worker in a real SGLang engine).
- `profiling.profile_and_check`: `dgw profile`, the reference workload under nsys (or
  torch.profiler), then the check.
"""
