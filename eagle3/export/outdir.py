"""Where an export lands, and never over another model unless asked.

An export directory carries ``eagle3_export.json`` with a fingerprint (sha256 of config.json and
the weights) and the size and sha256 of every other file (``files``). Publishing into
``export.out_dir``:
- missing or empty directory: write;
- the same fingerprint, every file as the marker records it: already there, nothing to do;
- the same fingerprint, a file missing, truncated or changed: this export, damaged: written again;
- anything else (another model, another eagle3 export, or files eagle3 did not write): refuse
  with a clear error, unless ``export.overwrite=true``, which replaces only model files (configs,
  weights, tokenizer files, README, marker), and leaves other files alone.

Never, not even with ``export.overwrite=true``: a directory that is, contains or lies inside the
target or any input of the run (the experiment's artifacts and manifest, the data files, the
prompts file, an ``export.from`` draft): :func:`refuse_inputs`.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import shutil
from pathlib import Path
from typing import Optional

from ..hashing import sha256_file
from .errors import ExportError
from .importers import MARKER

log = logging.getLogger("eagle3.export")

MODEL_FILE_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "*.bin", "*.pt", "*.pth",
                       "*.index.json", "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt",
                       "chat_template.*", "README.md", MARKER)
# what publish keeps inside out_dir while it copies; never counted as the directory's content
STAGING = ".eagle3-partial-"


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


def file_digests(model_dir: Path) -> dict:
    """{name: {"size", "sha256"}} of every file of an export but its marker (the marker's ``files``)."""
    return {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(Path(model_dir).iterdir()) if p.is_file() and p.name != MARKER}


def read_marker(d: Path) -> Optional[dict]:
    p = Path(d) / MARKER
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        return None


def damaged_files(d: Path, marker: dict) -> list:
    """The files of the export in ``d`` that do not hold what its ``marker`` records (missing,
    another size or another sha256); empty when it is whole. A marker written before markers
    recorded their files: its fingerprint, computed again."""
    d = Path(d)
    files = marker.get("files")
    if not isinstance(files, dict):
        try:
            same = fingerprint(d) == marker.get("fingerprint")
        except Exception:  # a truncated or missing file: unreadable is damaged
            same = False
        return [] if same else ["config.json or the weights (their fingerprint differs from the marker's)"]
    return [name for name, want in sorted(files.items())
            if not isinstance(want, dict) or not (d / name).is_file() or (d / name).stat().st_size != want.get("size")
            or sha256_file(d / name) != want.get("sha256")]


def _describe(d: Path) -> str:
    marker = read_marker(d)
    names = sorted(p.name for p in d.iterdir() if not p.name.startswith(STAGING))
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
    """'write' | 'same' (already holds this export, whole) | 'repair' (holds this export, damaged) |
    'replace' (overwrite=true); raises otherwise."""
    d = Path(out_dir).expanduser()
    if not d.exists() or not [p for p in d.iterdir() if not p.name.startswith(STAGING)]:
        return "write"
    if not d.is_dir():
        raise ExportError(f"export.out_dir={str(d)!r} is a file, not a directory")
    marker = read_marker(d)
    if want_fingerprint and marker and marker.get("fingerprint") == want_fingerprint:
        damaged = damaged_files(d, marker)
        if not damaged:
            return "same"
        log.warning("export.out_dir=%r holds this export, but %s do(es) not hold what its %s records (truncated or "
                    "changed): publishing it again", str(d), ", ".join(damaged), MARKER)
        return "repair"
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
    """Copy an export from the experiment into ``out_dir``; returns what was done (check_destination)."""
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
    tmp = d / f"{STAGING}{marker.get('fingerprint', 'x')[:8]}"
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(model_dir, tmp)
    # The marker moves in last: a directory whose copy was interrupted has no (new) marker.
    names = sorted(p.name for p in tmp.iterdir())
    for name in [n for n in names if n != MARKER] + ([MARKER] if MARKER in names else []):
        (tmp / name).replace(d / name)
    tmp.rmdir()
    return action
