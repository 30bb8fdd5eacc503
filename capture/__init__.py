"""Capture tuning: which batch sizes each graph pool captures, under memory and start-up budgets.

- `measurements`: the recorded GPU measurements (`dgw-capture-measurements/1`), written by
  `capture.measure` on the GPU, read by everything else;
- `measure`: the GPU run on the reference engine that records them (`python -m capture.measure`);
- `sglang_probe`: an SGLang server's capture probe (DGW_CAPTURE_PROBE) as measurements;
- `distribution`: the expected batch-size distribution and its presets;
- `padding`: padding waste and the optimisers (1-D partition DP, budgeted exact search);
- `memory_model`: an engine's graph-pool layout and the pool memory of a set of graphs;
- `tuner`: crossover, pool tops, the budgeted choice;
- `result`: what the tuner returns (`TuningResult`) and the table it prints;
- `config`: the capture config (`dgw-capture-config/1`) the worker and the SGLang plugin read;
- `report`, `cli`: tables, plots, `python -m capture.cli tune|report`;
- `sglang_flags`: `dgw capture-flags`, the SGLang launch line that runs a capture config;
- `units`: sizes and durations as people write them ('4GiB', '30s'), and back;
- `synthetic`: SYNTHETIC measurements for tests and demos only.
"""
