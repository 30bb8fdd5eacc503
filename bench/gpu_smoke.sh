#!/usr/bin/env bash
# First look on the GPU machine: versions, GPU tests, a short 8B-shaped sweep. Writes under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -c "import nvtx" 2>/dev/null && echo "nvtx: yes" || echo "nvtx: no"
timeout 200 python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout 300 python3 -m bench.reference.bench --concurrency ${CONC:-1,8,64,256} --output-len ${OLEN:-32} \
  --out "$OUT" 2>&1 | tee "$OUT/bench_smoke.log" | grep -v "^\s*$" | tail -45
