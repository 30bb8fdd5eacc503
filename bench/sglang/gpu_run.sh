#!/usr/bin/env bash
# One SGLang suite call on the GPU machine, after stage.sh a / b (device-sglang-prep's header):
#   bash bench/sglang/gpu_run.sh NAME BUDGET_S SUITE_ARGS...
# Runs `python -m bench.sglang.run_sglang_suite --out /tmp/NAME --budget-s BUDGET_S SUITE_ARGS`
# and packs its report, JSON, plots, step logs and engine log tails into $OUT/NAME.tar.gz (one
# file: the device returns few files per call).
set -uo pipefail
name=$1; budget=$2; shift 2
source .devlibs/sglang-tools/env.sh || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}; mkdir -p "$OUT"
dir=/tmp/$name
python3 -m bench.sglang.run_sglang_suite --out "$dir" --budget-s "$budget" "$@" 2>&1 \
  | tee "$dir.log" | grep -E "^\[suite\]|PASS|FAIL|tok/s|startup|elapsed" | tail -60
rc=${PIPESTATUS[0]}
for f in "$dir"/engines/*.log; do tail -c 20000 "$f" > "$f.tail" 2>/dev/null; done
tar czf "$OUT/$name.tar.gz" -C /tmp "$name.log" \
  $(cd /tmp && ls -d "$name"/*.json "$name"/*.md "$name"/*.png "$name"/*.jsonl \
      "$name"/engines/*.json "$name"/engines/*.tail 2>/dev/null)
cat "$dir/report.md" 2>/dev/null | head -80
exit $rc
