"""Atomic file writes: a reader sees the old file or the new one, never a part of either.

Every small file eagle3 writes for another process to trust (the manifest, a store's index and
store.json, a shard's sidecar, the GGUF digest cache) goes through here: written to a temporary
name in the same directory, flushed and fsync'ed, renamed over the destination, and the directory
fsync'ed so that the rename itself survives a crash. Large shard files are written in place by the
store writer (``eagle3.extract.writer``) and renamed with :func:`fsync_dir` the same way.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: str | Path) -> None:
    """Make a rename (or a new file) in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    # pid in the name: two processes writing the same file never share a temporary
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 1) -> None:
    """``obj`` as JSON with sorted keys and a trailing newline (stable bytes for the same object)."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")
