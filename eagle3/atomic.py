"""Atomic file writes: a reader sees the old file or the new one, never a part of either.

Every small file eagle3 writes for another process to trust (the manifest, a store's index and
store.json, a shard's sidecar, the GGUF digest cache) goes through here: written to a temporary
name in the same directory, flushed and fsync'ed, renamed over the destination, and the directory
fsync'ed so that the rename itself survives a crash. Large shard files are written in place by the
store writer (``eagle3.extract.writer``) and renamed with :func:`fsync_dir` the same way.

Safetensors files (the exported draft, prepare's vocabulary, a converted GGUF target) go through
:func:`save_safetensors`: safetensors' ``save_file`` creates its file owner-only (0600) whatever the
umask, so a vLLM server running as another user could not read the draft. Every file written here
gets the mode ``open()`` would give it under the process's umask (:func:`umask_mode`), as every
other file does; :func:`apply_umask` does the same for files written by libraries (accelerate's
checkpoints).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable


def fsync_dir(path: str | Path) -> None:
    """Make a rename (or a new file) in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it, and put it back at once
    os.umask(mask)
    return mask


def umask_mode(executable: bool = False) -> int:
    """The mode a new file (or, ``executable``, a directory) gets from ``open()`` under the umask."""
    return (0o777 if executable else 0o666) & ~_umask()


def apply_umask(path: str | Path) -> None:
    """Give ``path`` (and, for a directory, everything under it) the modes the umask gives new files
    and directories: for what a library wrote owner-only."""
    path = Path(path)
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if p.is_symlink():
            continue
        os.chmod(p, umask_mode(executable=p.is_dir()))


def atomic_write_with(path: str | Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` writes the file at the temporary path ``tmp``; it then gets the umask's mode, is
    fsync'ed and renamed over ``path``. Nothing is left at ``tmp`` when ``write`` fails."""
    path = Path(path)
    # pid in the name: two processes writing the same file never share a temporary
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.chmod(tmp, umask_mode())
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write_with(path, lambda tmp: tmp.write_bytes(data))


def save_safetensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file``, written atomically and readable as the umask says."""
    from safetensors.torch import save_file

    atomic_write_with(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 1) -> None:
    """``obj`` as JSON with sorted keys and a trailing newline (stable bytes for the same object)."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")
