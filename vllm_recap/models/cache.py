"""A content-addressed on-disk cache for converted model folders.

Entries live in ``<cache root>/<name>-<key>/`` where ``key`` is derived from the source file's
sha256, so a new source gives a new entry. Each entry carries ``recap_manifest.json`` with the
size and sha256 of every file it holds; an entry whose files do not match is treated as
corrupt and rebuilt, never loaded.

Concurrency: a builder writes into a private temporary folder next to the final one and
publishes it with one ``os.rename`` (atomic on one filesystem). When two processes convert at
once, the loser finds the winner's complete entry and discards its own copy.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

MANIFEST = "recap_manifest.json"


def cache_root() -> Path:
    """``$RECAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/vllm-recap``, else ``~/.cache/vllm-recap``."""
    if os.environ.get("RECAP_CACHE_DIR"):
        return Path(os.environ["RECAP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-recap"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(folder: Path, source_sha256: str) -> None:
    files = {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"source_sha256": source_sha256, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def entry_is_valid(folder: Path, source_sha256: str) -> bool:
    """True when ``folder`` holds a complete entry whose files all match its manifest."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("source_sha256") != source_sha256 or not manifest.get("files"):
        return False
    for rel, meta in manifest["files"].items():
        path = folder / rel
        try:
            if path.stat().st_size != meta["size"] or sha256_file(path) != meta["sha256"]:
                return False
        except OSError:
            return False
    return True


def cached_build(name: str, source_sha256: str, build: Callable[[Path], None]) -> Path:
    """Return the cache entry for (name, source); build it with ``build(tmp_folder)`` if needed.

    Args:
        name: human-readable entry name, e.g. ``"SmolLM2-135M-Instruct-bf16"``.
        source_sha256: sha256 of the source the entry is derived from (the cache key).
        build: writes the entry's files into the (empty, existing) folder it is given.
    """
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{name}-{source_sha256[:16]}"
    if entry_is_valid(final, source_sha256):
        return final
    if final.exists():
        logger.warning("Cache entry %s is incomplete or corrupt; rebuilding it.", final)
        # Move it aside first so a concurrent reader never sees a half-deleted folder.
        trash = root / f".trash-{uuid.uuid4().hex}"
        try:
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        except FileNotFoundError:
            pass  # another process already moved it
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build(tmp)
        _write_manifest(tmp, source_sha256)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process published first (rename onto a non-empty folder fails).
            if not entry_is_valid(final, source_sha256):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
