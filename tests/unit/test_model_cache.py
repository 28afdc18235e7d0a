"""The model cache: builds once, detects corruption, survives concurrent builders."""
from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

from vllm_recap.models import cache

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RECAP_CACHE_DIR", str(tmp_path / "cache"))


def _writer(payload: bytes, calls: list):
    def build(out: Path) -> None:
        calls.append(out)
        (out / "weights.bin").write_bytes(payload)
        (out / "config.json").write_text("{}")

    return build


def test_second_call_does_not_build_again():
    calls: list = []
    first = cache.cached_build("m", "ab" * 32, _writer(b"x" * 1000, calls))
    second = cache.cached_build("m", "ab" * 32, _writer(b"x" * 1000, calls))
    assert first == second and len(calls) == 1
    assert (first / "weights.bin").read_bytes() == b"x" * 1000


def test_new_source_gives_new_entry():
    calls: list = []
    a = cache.cached_build("m", "ab" * 32, _writer(b"a", calls))
    b = cache.cached_build("m", "cd" * 32, _writer(b"b", calls))
    assert a != b and len(calls) == 2


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete_file", "delete_manifest"])
def test_corrupt_entry_is_rebuilt_not_loaded(damage):
    calls: list = []
    entry = cache.cached_build("m", "ab" * 32, _writer(b"y" * 4096, calls))
    weights = entry / "weights.bin"
    if damage == "flip_byte":
        data = bytearray(weights.read_bytes())
        data[100] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(b"y" * 10)
    elif damage == "delete_file":
        weights.unlink()
    else:
        (entry / cache.MANIFEST).unlink()
    assert not cache.entry_is_valid(entry, "ab" * 32)
    again = cache.cached_build("m", "ab" * 32, _writer(b"y" * 4096, calls))
    assert len(calls) == 2
    assert (again / "weights.bin").read_bytes() == b"y" * 4096


def test_failed_build_leaves_no_entry():
    def broken(out: Path) -> None:
        (out / "partial.bin").write_bytes(b"half")
        raise RuntimeError("conversion crashed")

    with pytest.raises(RuntimeError, match="conversion crashed"):
        cache.cached_build("m", "ab" * 32, broken)
    assert list(cache.cache_root().iterdir()) == []


def _slow_build(root: str, payload: bytes) -> str:
    import os

    os.environ["RECAP_CACHE_DIR"] = root

    def build(out: Path) -> None:
        (out / "weights.bin").write_bytes(payload[:10])
        time.sleep(0.5)  # both processes are inside build() at the same time
        (out / "weights.bin").write_bytes(payload)

    return str(cache.cached_build("m", "ef" * 32, build))


def test_concurrent_builders_do_not_corrupt(tmp_path):
    root = str(tmp_path / "shared")
    payload = bytes(range(256)) * 64
    with mp.get_context("spawn").Pool(2) as pool:
        paths = pool.starmap(_slow_build, [(root, payload), (root, payload)])
    assert paths[0] == paths[1]
    assert cache.entry_is_valid(Path(paths[0]), "ef" * 32)
    assert (Path(paths[0]) / "weights.bin").read_bytes() == payload
    leftovers = [p.name for p in Path(root).iterdir() if p.name.startswith(".")]
    assert leftovers == []
