"""Content hashes: configs, files and target identities. Artifact paths derive from these."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

_CHUNK = 8 << 20


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
