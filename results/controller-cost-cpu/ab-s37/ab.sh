#!/usr/bin/env bash
# Controller-cost A/B: A = BASE (a worktree of 583ae52: loops over a batch's rows in Python and
# numpy), B = this tree (the same loops in C, row_state.c). N alternated runs per accept length,
# A first in odd runs. Writes DEST/{old,new}-ACC-N.json.   bash ab.sh BASE DEST [N]
set -u
BASE=$(realpath "${1:?base}"); DEST=$(realpath -m "${2:?dest}"); N=${3:-6}; mkdir -p "$DEST"
for acc in 1.5 3; do
  for i in $(seq 1 "$N"); do
    for side in $( ((i % 2)) && echo "old new" || echo "new old"); do
      root=$PWD; [ "$side" = old ] && root=$BASE
      (cd "$root" && PYTHONPATH=$root python3 -m bench.controller_cost --both --steps 4000 --rounds 1 --split \
        --accept "$acc" --out "$DEST/$side-$acc-$i.json" >/dev/null 2>&1) || echo "fail $side $acc $i"
    done
  done
done
