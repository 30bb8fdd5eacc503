#!/usr/bin/env bash
# The reference engine's full GPU run: capture measurements, an nsys profile
# with its check, and the concurrency sweeps at two forced accept lengths. Everything lands in
# $OUT/results.tar.gz (+ the log). Start it as: source .devlibs/nsys/env.sh && bash bench/gpu_full.sh
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-out}; R=$OUT/r; mkdir -p "$R"/{capture,profile,bench}
log() { echo "=== $(date +%T) $*"; }
log capture measurements
timeout 150 python3 -m capture.measure --out "$R/capture/measurements_h200_llama3-8b.json" 2>&1 | tail -62
log nsys profile
timeout 150 nsys profile --trace=cuda,nvtx --cuda-graph-trace=graph --force-overwrite=true \
  -o "$R/profile/reference" python3 -m profiling.workload --model llama3-8b --bs 8 2>&1 | tail -4
timeout 90 python3 -m profiling.check "$R/profile/reference.nsys-rep" --out "$R/profile" --expect-sm SM90 2>&1 | tail -14
rm -f "$R"/profile/*.sqlite
log bench accept 3
timeout 330 python3 -m bench.reference.bench --accept-len 3 --repeats ${REPEATS:-2} --out "$R/bench" 2>&1 \
  | grep -v "^  rep" | tail -30
log bench accept 2
timeout 150 python3 -m bench.reference.bench --accept-len 2 --variants plain,static-spec,dynamic \
  --skip-memory --skip-switch --out "$R/bench" 2>&1 | grep -v "^  rep" | tail -16
log done
tar -czf "$OUT/results.tar.gz" -C "$R" .
