#!/usr/bin/env bash
# The kernel caches a fresh GPU machine fills at its first engine start: SGLang's torch.compile
# cache (piecewise CUDA graphs; it redirects Inductor's and Triton's caches into it so that it
# can be copied to another machine), Triton's, FlashInfer's JIT and the CUDA driver's PTX cache.
# The first start on a fresh machine takes 130-207 s, later ones 57-89 s.
#   bash bench/sglang/jit_cache.sh pack DIR      parts of at most 15 MiB (the device returns 8
#                                                files of 16 MiB at most), and each cache's size;
#                                                none past JIT_CACHE_MAX_MB (45) in all
#   bash bench/sglang/jit_cache.sh restore DIR   unpacks the parts carried in, before a start
set -euo pipefail
verb=${1:?pack or restore}; dir=${2:?a folder}
caches=(.cache/sglang .triton/cache .cache/flashinfer .nv/ComputeCache)
parts=jit-cache.tgz.part-; max_mb=${JIT_CACHE_MAX_MB:-45}
case $verb in
  pack)
    mkdir -p "$dir"
    present=()
    for c in "${caches[@]}"; do
      if [ -d "$HOME/$c" ]; then present+=("$c"); du -sh "$HOME/$c"; fi
    done
    [ ${#present[@]} -gt 0 ] || { echo "jit_cache.sh: no cache under $HOME"; exit 0; }
    tar -czf - -C "$HOME" "${present[@]}" | split -b 15m - "$dir/$parts"
    packed=$(du -cm "$dir/$parts"* | tail -1 | cut -f1)
    if [ "$packed" -gt "$max_mb" ]; then
      rm -f "$dir/$parts"*
      echo "jit_cache.sh: ${packed} MiB packed, over JIT_CACHE_MAX_MB=$max_mb: none kept"
    else
      echo "jit_cache.sh: ${packed} MiB packed"
    fi ;;
  restore)
    found=("$dir/$parts"*)
    [ -f "${found[0]}" ] || { echo "jit_cache.sh: no $parts* in $dir" >&2; exit 1; }
    cat "${found[@]}" | tar -xzf - -C "$HOME"
    echo "jit_cache.sh: restored ${#found[@]} part(s) into $HOME" ;;
  *) echo "jit_cache.sh: unknown verb '$verb': use pack DIR or restore DIR" >&2; exit 2 ;;
esac
