"""Content hashes: configs, files and target identities. Artifact paths derive from these."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

_CHUNK = 8 << 20
TREE_CHUNK = 16 << 20
"""Leaf size of :func:`sha256_tree` (the store's shard digests)."""


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


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:]:
        print(f"{sha256_tree_file(name)}  {name}")
