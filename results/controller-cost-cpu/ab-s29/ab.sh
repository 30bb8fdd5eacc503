#!/usr/bin/env bash
# Controller-cost A/B: A = out/base-head (4e4a766: the bench sums the accept lengths inside the timed step), B = this tree (the sum passed in, as the worker's ledger does).
# N alternated runs per accept length, A first in odd runs. Writes DEST/{old,new}-ACC-N.json.
set -u
DEST=$(realpath -m "${1:?dest}"); N=${2:-6}; mkdir -p "$DEST"
for acc in 1.5 3; do
  for i in $(seq 1 "$N"); do
    for side in $( ((i % 2)) && echo "old new" || echo "new old"); do
      root=$PWD; [ "$side" = old ] && root=$PWD/out/base-head
      (cd "$root" && PYTHONPATH=$root python3 -m bench.controller_cost --both --steps 4000 --rounds 1 --split \
        --accept "$acc" --out "$DEST/$side-$acc-$i.json" >/dev/null 2>&1) || echo "fail $side $acc $i"
    done
  done
done
