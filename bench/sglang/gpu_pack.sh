#!/usr/bin/env bash
# On the GPU machine, after stage.sh a / c / b (device-sglang-prep's header): one bench module
# into /tmp/NAME, then what it wrote (JSON, reports, plots, step logs, log tails) packed into
# $OUT/NAME.tar.gz: the device returns only a few files a call. /tmp/NAME stays while the
# machine is warm, so a later call can add engines to the same matrix and pack again.
#   bash bench/sglang/gpu_pack.sh NAME MODULE ARGS...
#   e.g. bash bench/sglang/gpu_pack.sh m6 policy_matrix --radix-cache --engines dual --step-log
# An nsys SQLite export under /tmp/NAME/check/ also comes back gzipped where it fits.
# GPU_PACK_S=N interrupts the module after N seconds (SIGINT: its servers are stopped on the way
# out) and still packs what it wrote: set it below the device's per-call limit, since a run
# killed at that limit packs nothing and leaves its servers (their own sessions) running.
set -uo pipefail
name=$1; module=$2; shift 2
source .devlibs/sglang-tools/env.sh || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout -s INT -k 90 "${GPU_PACK_S:-0}" python3 -m "bench.sglang.$module" --out "/tmp/$name" "$@" 2>&1 | tail -40
rc=${PIPESTATUS[0]}
pkill -KILL -f -- "-m sglang[.]launch_server" || true      # none, unless the module was killed
bash "$(dirname "$0")/pack_dir.sh" "/tmp/$name" "$OUT/$name.tar.gz"
# An nsys export, gzipped, where it fits the device's 16 MiB a file: the checker can then be run
# again here (`gunzip` it, then `python -m profiling.check FILE.sqlite --out DIR`) after it changes.
for db in /tmp/"$name"/check/*.sqlite; do
  [ -f "$db" ] || continue
  gzip -c "$db" > "$OUT/$name.$(basename "$db").gz"
  [ "$(stat -c %s "$OUT/$name.$(basename "$db").gz")" -le 16000000 ] || rm -f "$OUT/$name.$(basename "$db").gz"
done
exit $rc
