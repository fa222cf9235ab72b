"""Where an export lands, and never over another model unless asked.

An export directory carries ``eagle3_export.json`` with a fingerprint (sha256 of config.json and
the weights). Publishing into ``export.out_dir``:
- missing or empty directory: write;
- the same fingerprint: already there, nothing to do;
- anything else (another model, another eagle3 export, or files eagle3 did not write): refuse
  with a clear error, unless ``export.overwrite=true``, which removes only model files (configs,
  weights, tokenizer files, README, marker) before copying, and leaves other files alone.

Never, not even with ``export.overwrite=true``: a directory that is, contains or lies inside the
target or any input of the run (the experiment's artifacts and manifest, the data files, the
prompts file, an ``export.from`` draft): :func:`refuse_inputs`.
"""
from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path
from typing import Optional

from ..hashing import sha256_file
from .errors import ExportError
from .importers import MARKER

MODEL_FILE_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "*.bin", "*.pt", "*.pth",
                       "*.index.json", "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt",
                       "chat_template.*", "README.md", MARKER)


def fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and the tensors' names, dtypes, shapes and bytes (not the safetensors
    header, whose metadata order is not stable across processes)."""
    import hashlib

    import torch
    from safetensors import safe_open

    model_dir = Path(model_dir)
    h = hashlib.sha256()
    h.update(sha256_file(model_dir / "config.json").encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sorted(sf.keys()):
                t = sf.get_tensor(name).contiguous()
                h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def read_marker(d: Path) -> Optional[dict]:
    p = Path(d) / MARKER
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        return None


def _describe(d: Path) -> str:
    marker = read_marker(d)
    names = sorted(p.name for p in d.iterdir())
    shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    if marker:
        return (f"an eagle3 export ({marker.get('format')} format, target {str(marker.get('target', {}).get('path'))!r}, "
                f"fingerprint {str(marker.get('fingerprint'))[:12]}): {shown}")
    if (d / "config.json").is_file():
        try:
            arch = json.loads((d / "config.json").read_text()).get("architectures")
        except json.JSONDecodeError:
            arch = None
        return f"a model ({arch}): {shown}"
    return f"files eagle3 did not write: {shown}"


def check_destination(out_dir, want_fingerprint: Optional[str], overwrite: bool) -> str:
    """'write' | 'same' (already holds this export) | 'replace' (overwrite=true); raises otherwise."""
    d = Path(out_dir).expanduser()
    if not d.exists() or not [p for p in d.iterdir() if not p.name.startswith(".eagle3-partial-")]:
        return "write"
    if not d.is_dir():
        raise ExportError(f"export.out_dir={str(d)!r} is a file, not a directory")
    marker = read_marker(d)
    if want_fingerprint and marker and marker.get("fingerprint") == want_fingerprint:
        return "same"
    if overwrite:
        return "replace"
    raise ExportError(f"export.out_dir={str(d)!r} already holds {_describe(d)}. Nothing was written. Choose "
                      f"another export.out_dir, or pass export.overwrite=true to replace its model files.")


def refuse_inputs(out_dir, inputs: dict) -> None:
    """Raise when ``out_dir`` is, contains or is inside one of ``inputs`` ({what: path}): publishing
    there would replace or delete what this run (or the next) reads."""
    d = Path(out_dir).expanduser().resolve()
    for what, path in inputs.items():
        p = Path(path).expanduser().resolve()
        relation = "is" if d == p else "contains" if p.is_relative_to(d) else "is inside" if d.is_relative_to(p) else None
        if relation:
            raise ExportError(f"export.out_dir={str(d)!r} {relation} {what} {str(p)!r}: the export would replace "
                              f"or delete files this run reads (export.overwrite does not allow it). Nothing was "
                              f"written. Choose an export.out_dir outside it.")


def precheck_destination(out_dir, overwrite: bool) -> None:
    """Fail early (before verification) on a destination that holds anything but an eagle3 export;
    whether an eagle3 export there is this very model is decided by its fingerprint at publish time."""
    d = Path(out_dir).expanduser()
    if d.is_dir() and read_marker(d) is not None:
        return
    check_destination(d, None, overwrite)


def publish(model_dir: Path, out_dir, overwrite: bool) -> str:
    """Copy an export from the experiment into ``out_dir``; returns what was done."""
    d = Path(out_dir).expanduser().resolve()
    marker = read_marker(model_dir) or {}
    action = check_destination(d, marker.get("fingerprint"), overwrite)
    if action == "same":
        return action
    d.mkdir(parents=True, exist_ok=True)
    if action == "replace":
        for p in d.iterdir():
            if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in MODEL_FILE_PATTERNS):
                p.unlink()
    tmp = d / f".eagle3-partial-{marker.get('fingerprint', 'x')[:8]}"
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(model_dir, tmp)
    # The marker moves in last: a directory whose copy was interrupted has no (new) marker.
    names = sorted(p.name for p in tmp.iterdir())
    for name in [n for n in names if n != MARKER] + ([MARKER] if MARKER in names else []):
        (tmp / name).replace(d / name)
    tmp.rmdir()
    return action
