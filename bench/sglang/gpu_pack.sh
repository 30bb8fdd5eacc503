#!/usr/bin/env bash
# On the GPU machine, after stage.sh a / c / b (device-sglang-prep's header): one bench module
# into /tmp/NAME, then what it wrote (JSON, reports, plots, step logs, log tails) packed into
# $OUT/NAME.tar.gz: the device returns only a few files a call. /tmp/NAME stays while the
# machine is warm, so a later call can add engines to the same matrix and pack again.
#   bash bench/sglang/gpu_pack.sh NAME MODULE ARGS...
#   e.g. bash bench/sglang/gpu_pack.sh m6 policy_matrix --radix-cache --engines dual --step-log
set -uo pipefail
name=$1; module=$2; shift 2
source .devlibs/sglang-tools/env.sh || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m "bench.sglang.$module" --out "/tmp/$name" "$@" 2>&1 | tail -40
rc=${PIPESTATUS[0]}
bash "$(dirname "$0")/pack_dir.sh" "/tmp/$name" "$OUT/$name.tar.gz"
exit $rc
