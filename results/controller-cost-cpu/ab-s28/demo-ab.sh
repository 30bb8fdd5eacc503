#!/usr/bin/env bash
# dgw demo A/B: A = out/base-head (HEAD, before the deferred fold), B = this tree; N interleaved pairs.
set -u
N=${1:-6}; DEST=$PWD/out/demo-ab2
for i in $(seq "${2:-1}" "$N"); do
  for side in $( ((i % 2)) && echo "old new" || echo "new old"); do
    root=$PWD; [ "$side" = old ] && root=$PWD/out/base-head
    (cd "$root" && PYTHONPATH=$root python -m dual_graph_worker.cli demo --out "$DEST/$side$i" >/dev/null 2>&1) || echo "fail $side $i"
  done
done
echo done
