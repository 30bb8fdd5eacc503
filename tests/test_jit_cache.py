"""bench/sglang/jit_cache.sh: what one machine's kernel caches hold comes back whole on another."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "sglang" / "jit_cache.sh"


def _run(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, "HOME": str(home), **env})


def test_pack_then_restore_on_a_fresh_home(tmp_path):
    old, new, carried = tmp_path / "old", tmp_path / "new", tmp_path / "carried"
    kernel = old / ".cache/sglang/torch_compile_cache/abc/inductor_cache/k.py"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(os.urandom(40_000))
    (old / ".triton/cache").mkdir(parents=True)
    (old / ".triton/cache/t.cubin").write_text("cubin")
    assert _run(old, "pack", str(carried)).returncode == 0
    assert list(carried.glob("jit-cache.tgz.part-*"))
    new.mkdir()
    assert _run(new, "restore", str(carried)).returncode == 0
    assert (new / ".cache/sglang/torch_compile_cache/abc/inductor_cache/k.py").read_bytes() \
        == kernel.read_bytes()
    assert (new / ".triton/cache/t.cubin").read_text() == "cubin"


def test_restore_without_parts_and_an_unknown_verb_say_so_in_one_line(tmp_path):
    missing = _run(tmp_path, "restore", str(tmp_path / "none"))
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    assert "jit-cache.tgz.part-" in missing.stderr
    unknown = _run(tmp_path, "unpack", str(tmp_path))
    assert unknown.returncode == 2 and "use pack DIR or restore DIR" in unknown.stderr


def test_pack_with_no_cache_writes_nothing(tmp_path):
    result = _run(tmp_path, "pack", str(tmp_path / "out"))
    assert result.returncode == 0 and "no cache" in result.stdout
    assert not list((tmp_path / "out").glob("*"))


def test_pack_over_the_cap_keeps_nothing(tmp_path):
    home, carried = tmp_path / "home", tmp_path / "carried"
    (home / ".cache/sglang").mkdir(parents=True)
    (home / ".cache/sglang/big.bin").write_bytes(os.urandom(3 * 2**20))
    result = _run(home, "pack", str(carried), JIT_CACHE_MAX_MB="1")
    assert result.returncode == 0 and "none kept" in result.stdout
    assert not list(carried.glob("jit-cache.tgz.part-*"))
