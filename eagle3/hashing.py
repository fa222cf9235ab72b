"""Content hashes: configs, files and target identities. Artifact paths derive from these."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

_CHUNK = 8 << 20
TREE_CHUNK = 16 << 20
"""Leaf size of :func:`sha256_tree` (the store's shard digests)."""
SAMPLE_DIGEST = "xxh3_64"
"""The store's per-sample checksum (:func:`sample_digest`)."""


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def hash_obj(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def semantic_dict(section: Any) -> dict:
    """A config section as a plain dict without the fields its class marks NON_SEMANTIC, nor those
    in its HASH_OMIT_DEFAULTS that hold their default (fields added later: existing hashes stay)."""
    skip = set(getattr(type(section), "NON_SEMANTIC", ()))
    omit_default = set(getattr(type(section), "HASH_OMIT_DEFAULTS", ()))
    out = {}
    for f in dataclasses.fields(section):
        if f.name in skip:
            continue
        value = getattr(section, f.name)
        if f.name in omit_default and value == _default(f):
            continue
        out[f.name] = semantic_dict(value) if dataclasses.is_dataclass(value) else _plain(value)
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return semantic_dict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_files(paths: Iterable[Path], root: Path) -> str:
    """One digest over several files' relative names and contents."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.relative_to(root)).encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def sha256_tree_root(leaf_digests: Iterable[bytes]) -> str:
    """The root of a sha256 tree: sha256 over the concatenated 32-byte sha256 digests of the leaves."""
    return hashlib.sha256(b"".join(leaf_digests)).hexdigest()


def sha256_tree_file(path: str | Path, chunk: int = TREE_CHUNK) -> str:
    """A file's sha256 tree: its bytes cut into ``chunk``-byte leaves (the last one shorter), each
    hashed with sha256, and the root over those digests (:func:`sha256_tree_root`). The store's shard
    digest: as collision-resistant as the file's plain sha256, but its leaves can be hashed on
    several cores as they are written, in any order. ``python -m eagle3.hashing FILE...`` prints it.

    Equivalent shell: ``split -a 6 -d -b 16777216 shard leaf. && for f in leaf.*; do sha256sum $f; done |
    cut -c1-64 | xxd -r -p | sha256sum``."""
    digests = []
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digests.append(hashlib.sha256(block).digest())
    return sha256_tree_root(digests)


def sample_hasher():
    """A new hasher of the store's per-sample checksum (xxh3_64: ``update(buffer)``, ``hexdigest()``),
    which a reader verifies for every sample as it reads it (eagle3.store). Not a cryptographic
    digest (the shards' sha256 trees are): a checksum against bytes that changed by accident, fast
    enough for the data loader's path (~16 GiB/s on one core, the GIL released while it hashes;
    bench/results/sample_checksum_cpu_202612.md)."""
    import xxhash

    return xxhash.xxh3_64()


def sample_digest(parts: Iterable) -> str:
    """:func:`sample_hasher`'s hex digest of buffers (numpy arrays, memoryviews) hashed as one stream."""
    h = sample_hasher()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def hash_threads() -> int:
    """Threads for hashing leaves: every core, at most 16 (sha256 releases the GIL; past the disk's
    read bandwidth more threads only contend)."""
    return max(1, min(16, os.cpu_count() or 1))


def sha256_tree_files(paths: Iterable[str | Path], threads: Optional[int] = None,
                      progress: Optional[Callable[[int], None]] = None, chunk: int = TREE_CHUNK) -> dict:
    """{path: sha256 tree} of several files (:func:`sha256_tree_file`, the same digests), their leaves
    hashed on ``threads`` threads (default :func:`hash_threads`), one file after another so the reads
    stay close together. ``progress(nbytes)`` is called as leaves are done (from the hash threads)."""
    from concurrent.futures import ThreadPoolExecutor

    paths = [Path(p) for p in paths]
    local = threading.local()

    def leaf(fd: int, offset: int, size: int) -> bytes:
        buf = getattr(local, "buf", None)
        if buf is None or len(buf) < chunk:
            buf = local.buf = bytearray(chunk)
        view = memoryview(buf)[:size]
        got = 0
        while got < size:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise OSError(f"short read at offset {offset + got} while hashing a file (it shrank?)")
            got += n
        digest = hashlib.sha256(view).digest()
        if progress is not None:
            progress(size)
        return digest

    out = {}
    fds = []
    try:
        with ThreadPoolExecutor(max_workers=threads or hash_threads(), thread_name_prefix="eagle3-hash") as pool:
            jobs = []
            for p in paths:
                fd = os.open(p, os.O_RDONLY)
                fds.append(fd)
                size = os.fstat(fd).st_size
                jobs.append((p, [pool.submit(leaf, fd, a, min(chunk, size - a)) for a in range(0, size, chunk)]))
            for p, leaves in jobs:
                out[p] = sha256_tree_root(f.result() for f in leaves)
    finally:
        for fd in fds:
            os.close(fd)
    return out


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:]:
        print(f"{sha256_tree_file(name)}  {name}")
