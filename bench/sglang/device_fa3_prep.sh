#!/usr/bin/env bash
# SGLang's default attention backend on Hopper (fa3) needs sgl_kernel's FA3 library, which
# ../shared/tools/device-sglang-prep leaves out (1.1 GB). This stages it for the GPU machine:
# zstd-compressed (141 MB) in five pieces that even out five runs, each with the SGLang wheels
# beside it; it stops if a run would carry more than CARRY_MB (default 54: the 64 MiB a run may
# carry less the repo's ~12 MB).
#
# Here, from the project root, after device-sglang-prep:
#     bash bench/sglang/device_fa3_prep.sh
# It moves the sglang wheel into .devlibs/sglang-b and flashinfer, xgrammar and transformers into
# .devlibs/sglang-c, and writes .devlibs/fa3-1..5 and fa3-tools/.
# On the GPU machine, five runs back to back (an idle machine is given back after 30 s):
#   1 carry sglang-a, sglang-tools, fa3-1, fa3-tools:
#         bash .devlibs/sglang-tools/stage.sh a && bash .devlibs/fa3-tools/stage-fa3.sh piece 1
#   2 carry sglang-c, sglang-tools, fa3-2, fa3-tools:
#         bash .devlibs/sglang-tools/stage.sh c && bash .devlibs/fa3-tools/stage-fa3.sh piece 2
#   3 carry fa3-3, fa3-tools:            bash .devlibs/fa3-tools/stage-fa3.sh piece 3
#   4 carry fa3-4, fa3-tools:            bash .devlibs/fa3-tools/stage-fa3.sh piece 4
#   5 carry sglang-b, sglang-tools, fa3-5, fa3-tools:
#       bash .devlibs/sglang-tools/stage.sh b && bash .devlibs/fa3-tools/stage-fa3.sh piece 5 \
#         && bash .devlibs/fa3-tools/stage-fa3.sh install && YOUR COMMAND
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -d .devlibs/sglang-b ] || { echo "device_fa3_prep: run ../shared/tools/device-sglang-prep first" >&2; exit 1; }
carry=$(( ${CARRY_MB:-54} * 1000000 ))
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp" sglang-kernel==0.4.5 zstandard==0.25.0
unzip -q -o "$tmp"/sglang_kernel-*.whl sgl_kernel/flash_ops.abi3.so -d "$tmp"
mkdir -p .devlibs/sglang-c .devlibs/fa3-tools; rm -rf .devlibs/fa3-[1-9]; mkdir .devlibs/fa3-{1,2,3,4,5}
mv .devlibs/sglang-a/sglang-0.5.17-*.whl .devlibs/sglang-b/ 2>/dev/null || true
for w in flashinfer_python xgrammar transformers; do
  mv .devlibs/sglang-b/$w-*.whl .devlibs/sglang-c/ 2>/dev/null || true
done
cp "$tmp"/zstandard-*.whl .devlibs/fa3-5/
sha256sum "$tmp/sgl_kernel/flash_ops.abi3.so" | cut -d' ' -f1 > .devlibs/fa3-tools/flash_ops.sha256
zstd -q -19 --long=27 -T0 "$tmp/sgl_kernel/flash_ops.abi3.so" -o "$tmp/flash_ops.zst"
# Every run carries the same share of the wheels and the library; piece i fills what run i's wheels
# leave of that share.
python3 - "$tmp/flash_ops.zst" "$carry" <<'PY'
import os, sys
def size(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
zst, carry = sys.argv[1], int(sys.argv[2])
beside = [".devlibs/sglang-a", ".devlibs/sglang-c", None, None, ".devlibs/sglang-b"]
wheels = [size(d) if d else 0 for d in beside]
wheels[4] += size(".devlibs/fa3-5")                     # the zstandard wheel rides in run 5
share = -(-(sum(wheels) + os.path.getsize(zst)) // len(beside))
if share > carry or max(wheels) > share:
    sys.exit(f"device_fa3_prep: a run would carry {max(share, max(wheels)) / 1e6:.1f} MB, over "
             f"CARRY_MB={carry // 1000000}; raise CARRY_MB if the repo is small enough")
with open(zst, "rb") as f:
    for i, w in enumerate(wheels, 1):
        open(f".devlibs/fa3-{i}/flash_ops.zst.part{i}", "wb").write(
            f.read(share - w) if i < len(wheels) else f.read())
PY
cat > .devlibs/fa3-tools/stage-fa3.sh <<'STAGE'
#!/usr/bin/env bash
# On the GPU machine: stage-fa3.sh piece N | install (after stage.sh b); see bench/sglang/device_fa3_prep.sh
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p /tmp/fa3-stage
case "${1:-}" in
  piece) cp "$here/fa3-$2"/* /tmp/fa3-stage/ ;;
  install)
    dst=/tmp/sglang-site/sgl_kernel/flash_ops.abi3.so
    [ -d /tmp/sglang-site/sgl_kernel ] || { echo "stage-fa3.sh: stage.sh b first" >&2; exit 1; }
    n=$( (compgen -G '/tmp/fa3-stage/flash_ops.zst.part*' || true) | wc -l)
    [ "$n" -eq 5 ] || { echo "stage-fa3.sh: $n of 5 pieces staged" >&2; exit 1; }
    parts=(/tmp/fa3-stage/flash_ops.zst.part{1,2,3,4,5})
    if command -v zstd >/dev/null; then
      cat "${parts[@]}" | zstd -d -q --long=27 -o "$dst"
    else   # the GPU machine has no zstd binary
      python3 -m pip install -q --no-index --no-deps --target /tmp/zstd-site /tmp/fa3-stage/zstandard-*.whl
      cat "${parts[@]}" | PYTHONPATH=/tmp/zstd-site python3 -c "
import sys, zstandard
zstandard.ZstdDecompressor(max_window_size=1 << 27).copy_stream(sys.stdin.buffer, open('$dst', 'wb'))"
    fi
    echo "$(cat "$here/fa3-tools/flash_ops.sha256")  $dst" | sha256sum -c - ;;
  *) echo "usage: stage-fa3.sh piece N | install" >&2; exit 2 ;;
esac
STAGE
chmod +x .devlibs/fa3-tools/stage-fa3.sh
for run in "sglang-a fa3-1" "sglang-c fa3-2" "fa3-3" "fa3-4" "sglang-b fa3-5"; do
  echo "run carry (MB): $(( $(cd .devlibs && du -cb $run | tail -1 | cut -f1) / 1000000 ))  [$run]"
done
