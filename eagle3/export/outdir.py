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

The new draft is copied whole beside the old one first (:func:`publish`): a failed copy (a full
disk) changes nothing in ``out_dir``.

Never, not even with ``export.overwrite=true``: a directory that is, contains or lies inside the
target or any input of the run (the experiment's artifacts and manifest, the data files, the
prompts file, an ``export.from`` draft): :func:`refuse_inputs`.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

from ..atomic import atomic_write_with, fsync_dir
from ..errors import disk_full
from ..hashing import sha256_file
from .errors import ExportError
from .importers import MARKER

log = logging.getLogger("eagle3.export")

MODEL_FILE_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "*.bin", "*.pt", "*.pth",
                       "*.index.json", "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt",
                       "chat_template.*", "README.md", MARKER)
# what publish keeps inside out_dir while it works (the new draft's copy, the old draft's files
# until the new one is in place); never counted as the directory's content
STAGING, BACKUP = ".eagle3-partial-", ".eagle3-old-"


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
    names = sorted(p.name for p in d.iterdir() if not p.name.startswith((STAGING, BACKUP)))
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
    if not d.exists() or not [p for p in d.iterdir() if not p.name.startswith((STAGING, BACKUP))]:
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


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem of ``path``, or of its nearest existing parent."""
    path = Path(path)
    while not path.exists() and path.parent != path:
        path = path.parent
    return shutil.disk_usage(path).free


def no_space_message(writing: Path, needed: int, where: Path) -> str:
    """'writing X: it needs N bytes, M are free there' (for an error about a full disk)."""
    from ..units import fmt_size

    free = free_bytes(where)
    return (f"no space left writing {writing}: it needs about {needed} bytes ({fmt_size(needed)}) there, "
            f"{free} bytes ({fmt_size(free)}) are free")


def publish(model_dir: Path, out_dir, overwrite: bool) -> str:
    """Copy an export from the experiment into ``out_dir``; returns what was done (check_destination).

    ``out_dir`` is the user's directory: it may hold their other files (which even
    ``export.overwrite=true`` leaves alone), be a mount point or be bind-mounted into a vLLM
    container, and its parent may not be ours to write. So publish swaps the model files inside it,
    never the directory itself: the new draft is copied whole into a hidden directory in
    ``out_dir`` (the same filesystem, so the swap is renames only: no data written, nothing for a
    full disk to cut short), fsync'ed, and checked against the marker's digests; only then does
    :func:`_swap` rename each file over the old one (every file is at each instant the whole old or
    the whole new one, never missing or partial), the marker last. Any failure before or during the
    swap leaves (or puts back) the old draft as it was and removes the copy."""
    model_dir = Path(model_dir)
    d = Path(out_dir).expanduser().resolve()
    marker = read_marker(model_dir) or {}
    action = check_destination(d, marker.get("fingerprint"), overwrite)
    if action == "same":
        return action
    names = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    needed = sum((model_dir / n).stat().st_size for n in names)
    created = not d.exists()
    tmp = d / f"{STAGING}{os.getpid()}"
    writing = d
    try:
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob(f"{STAGING}*"):  # copies left by a publish that was killed
            shutil.rmtree(old, ignore_errors=True)
        tmp.mkdir()
        for name in names:
            writing = tmp / name
            atomic_write_with(writing, lambda t, src=model_dir / name: shutil.copyfile(src, t))
            want = (marker.get("files") or {}).get(name)
            if want and sha256_file(writing) != want.get("sha256"):
                raise ExportError(f"the export in {model_dir} is damaged: {name} does not hold what its {MARKER} "
                                  f"records. Nothing in export.out_dir={str(d)!r} was changed. Remove "
                                  f"{model_dir.parent} and run the same command again to export it anew.")
        fsync_dir(tmp)
        on_disk = {p.name for p in d.iterdir() if p.is_file()}
        # the old draft's files: those the new one replaces, and with overwrite every model file there
        model_files = {n for n in on_disk if any(fnmatch.fnmatch(n, pat) for pat in MODEL_FILE_PATTERNS)}
        retire = sorted(on_disk & (set(names) | (model_files if action == "replace" else set())))
        writing = d
        _swap(tmp, d, names, retire)
    except OSError as e:
        kept = ("Nothing in it was replaced: the draft it held is whole." if action in ("replace", "repair")
                else "Nothing was left there.")
        advice = ("Free space there (the draft already there stays until the new one is complete, so its space "
                  "does not count), or set export.out_dir to a directory on another disk, then run the same "
                  "command again." if disk_full(e) else "Fix that (or choose another export.out_dir), then run the "
                  "same command again.")
        what = no_space_message(writing, needed, d) if disk_full(e) else f"writing {writing} failed: {e}"
        raise ExportError(f"publishing the draft into export.out_dir={str(d)!r}: {what}. {kept} {advice}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if created and d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    for old in d.glob(f"{BACKUP}*"):  # the old draft of a publish that was killed mid-swap: superseded now
        shutil.rmtree(old, ignore_errors=True)
    return action


def _swap(tmp: Path, d: Path, names: list, retire: list) -> None:
    """Move the files ``names`` from ``tmp`` into ``d`` over the old draft's files ``retire`` (those it
    replaces and those it removes), the marker last. The old files are kept under a hard link in a
    hidden backup directory first (renamed there where the filesystem has no hard links), so a failed
    rename puts every old file back; the backup is removed once the marker is in place."""
    order = [n for n in names if n != MARKER] + [n for n in names if n == MARKER]
    backup = d / f"{BACKUP}{os.getpid()}"
    shutil.rmtree(backup, ignore_errors=True)
    backup.mkdir()
    placed = []
    try:
        for name in retire:
            try:
                os.link(d / name, backup / name)
            except OSError:
                os.replace(d / name, backup / name)
        for name in order[:-1]:
            os.replace(tmp / name, d / name)
            placed.append(name)
        for name in set(retire) - set(names):
            (d / name).unlink(missing_ok=True)
        if order:
            os.replace(tmp / order[-1], d / order[-1])
            placed.append(order[-1])
        fsync_dir(d)
    except BaseException as e:
        try:
            for name in placed:
                if not (backup / name).exists():  # a file the old draft did not have
                    (d / name).unlink(missing_ok=True)
            for p in backup.iterdir():
                os.replace(p, d / p.name)  # a link to the file still there: nothing to do, p stays
            fsync_dir(d)
        except OSError as again:
            raise ExportError(f"publishing the draft into export.out_dir={str(d)!r} failed ({e}), and putting the "
                              f"old draft back failed too ({again}): its files are in {backup}; move them back into "
                              f"{d}.") from e
        shutil.rmtree(backup, ignore_errors=True)
        raise
    shutil.rmtree(backup, ignore_errors=True)
