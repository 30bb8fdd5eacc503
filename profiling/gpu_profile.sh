#!/usr/bin/env bash
# The SGLang worker under nsys on the GPU machine, after SGLang and nsys are staged (the device
# README; SGLang: device-sglang-prep's two halves, nsys: device-nsys-prep):
#   source .devlibs/nsys/env.sh && bash profiling/gpu_profile.sh NAME [WORKLOAD_ARGS...]
# Runs `python -m bench.sglang.profile_workload --nsys --out /tmp/NAME --expect-sm SM90 ARGS` and
# packs the verdict (check/), the workload summary and step log, and the gzipped SQLite export
# into $OUT/NAME.tar.gz (one file: the device returns few files per call).
set -uo pipefail
name=$1; shift
source .devlibs/sglang-tools/env.sh || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}; mkdir -p "$OUT"
dir=/tmp/$name
python3 -m bench.sglang.profile_workload --nsys --out "$dir" --expect-sm SM90 "$@" 2>&1 \
  | tee "$dir.log" | tail -40
rc=${PIPESTATUS[0]}
sqlite=$(ls "$dir"/check/*.sqlite 2>/dev/null | head -1)
[ -n "$sqlite" ] && gzip -kf "$sqlite"
tar czf "$OUT/$name.tar.gz" -C /tmp "$name.log" \
  $(cd /tmp && ls -d "$name"/check/*.md "$name"/check/*.json "$name"/check/*.png \
      "$name"/check/*.sqlite.gz "$name"/*.json "$name"/*.jsonl 2>/dev/null)
exit $rc
