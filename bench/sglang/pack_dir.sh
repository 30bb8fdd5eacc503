#!/usr/bin/env bash
# pack_dir.sh DIR TARBALL: a bench output folder's results, without its checkpoints and shims;
# logs as their last 20 kB.
set -uo pipefail
dir=$(cd "$1" && pwd); tarball=$2
tmp=$(mktemp -d); mkdir -p "$tmp/$(basename "$dir")"
(cd "$dir" && find . -path ./models -prune -o -path ./checkpoints -prune -o -path ./shim -prune \
   -o -type f \( -name '*.json' -o -name '*.md' -o -name '*.txt' -o -name '*.png' -o -name '*.jsonl' \) -print) |
while read -r f; do mkdir -p "$tmp/$(basename "$dir")/$(dirname "$f")"; cp "$dir/$f" "$tmp/$(basename "$dir")/$f"; done
for f in "$dir"/*.log; do [ -f "$f" ] && tail -c 20000 "$f" > "$tmp/$(basename "$dir")/$(basename "$f").tail"; done
tar czf "$tarball" -C "$tmp" "$(basename "$dir")" && rm -rf "$tmp"
