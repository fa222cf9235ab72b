"""Conversation sources: JSONL (OpenAI `messages` or ShareGPT `conversations`), HF datasets saved
to disk, parquet; several sources mixed with sampling weights."""
from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..errors import Eagle3Error

log = logging.getLogger("eagle3.data")
BUILTIN_PROMPTS = Path(__file__).resolve().parent / "builtin" / "prompts.jsonl"
# data.path values that name a prompt set generated in memory by eagle3/data/builtin/make_prompts.py
BUILTIN_GENERATED = {"builtin:large": "build_large"}


class DataError(Eagle3Error):
    """A data source is missing or holds a record eagle3 cannot read."""


@dataclass
class Record:
    raw: dict
    origin: str  # "file:line" or "dataset[index]", for error messages


@dataclass
class ReadReport:
    records: int = 0  # records read that are conversations (counted by eagle3.data.dataset.load_conversations)
    bad_records: int = 0
    bad_examples: list = field(default_factory=list)

    def bad(self, origin: str, why: str) -> None:
        self.bad_records += 1
        if len(self.bad_examples) < 5:
            self.bad_examples.append(f"{origin}: {why}")


def detect_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "hf_disk"
    if path.suffix == ".parquet":
        return "parquet"
    return "jsonl"


def read_jsonl(path: Path, on_bad: str, report: ReadReport) -> Iterator[Record]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            origin = f"{path}:{lineno}"
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
                if not isinstance(obj, dict):
                    raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            except (UnicodeDecodeError, ValueError) as e:
                why = "bytes that are not UTF-8" if isinstance(e, UnicodeDecodeError) else f"malformed JSON ({e})"
                if on_bad == "skip":
                    report.bad(origin, why)
                    continue
                raise DataError(f"{origin}: {why}. Fix the line, or pass data.on_bad_record=skip to "
                                f"count and skip bad records.") from None
            yield Record(obj, origin)


def read_json_array(path: Path, on_bad: str, report: ReadReport) -> list[Record] | None:
    """The records of a file that is one JSON array of objects (``json.dump(records, f)``), or None
    when the file is not one. Read rather than refused: it holds the same records as JSONL, and
    JSONL is read whole as well (``read_source`` returns a list), so only the error messages differ
    (``file[index]`` instead of ``file:line``)."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        return None
    try:
        items = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None  # not one array: read as JSONL, which names the first bad line
    if not isinstance(items, list):
        return None
    log.info("%s is one JSON array, not JSONL (one object per line): read as its %d records", path, len(items))
    out = []
    for i, obj in enumerate(items):
        origin = f"{path}[{i}]"
        if isinstance(obj, dict):
            out.append(Record(obj, origin))
            continue
        why = f"expected a JSON object, got {type(obj).__name__}"
        if on_bad != "skip":
            raise DataError(f"{origin}: {why}. Fix the record, or pass data.on_bad_record=skip to count and "
                            f"skip bad records.")
        report.bad(origin, why)
    return out


def _not_a_dataset(path: Path) -> str | None:
    """Why directory ``path`` is not a dataset saved by ``datasets``' save_to_disk, or None."""
    if any((path / name).is_file() for name in ("dataset_dict.json", "state.json")):
        return None
    files = sorted(p.name for p in path.iterdir() if p.suffix in (".jsonl", ".json", ".parquet"))
    hint = (f"; it holds {', '.join(files[:3])}{' and more' if len(files) > 3 else ''}: set data.path={path / files[0]}"
            f"{', or data.sources=[{path: FILE}, ...] for several' if len(files) > 1 else ''}") if files else \
        "; set data.path to a conversations file (JSONL, parquet) or to a directory save_to_disk wrote"
    return (f"data source {path} is a directory but not a dataset saved with datasets' save_to_disk (it has no "
            f"dataset_dict.json or state.json){hint}")


def read_hf(path: Path, fmt: str, split: str) -> Iterator[Record]:
    import datasets

    if fmt == "hf_disk" and path.is_dir() and (why := _not_a_dataset(path)):
        raise DataError(why)
    if fmt == "parquet":
        ds = datasets.Dataset.from_parquet(str(path))
    else:
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{path} is a DatasetDict without split {split!r} (has {list(ds)}); "
                                f"set data.sources[].split")
            ds = ds[split]
    for i, row in enumerate(ds):
        yield Record(row, f"{path}[{i}]")


def generated_records(name: str) -> list[dict]:
    """The records of a generated built-in set (``data.path=builtin:large``), deterministic."""
    if name not in BUILTIN_GENERATED:
        raise DataError(f"unknown built-in prompt set {name!r}; known: {sorted(BUILTIN_GENERATED)}")
    from .builtin import make_prompts

    return getattr(make_prompts, BUILTIN_GENERATED[name])()


def generated_identity(name: str) -> str:
    """Content hash of a generated set (for the prepare stage's config hash)."""
    import hashlib

    return hashlib.sha256(json.dumps(generated_records(name), sort_keys=True).encode()).hexdigest()


def read_source(path: str | Path, fmt: str, split: str, on_bad: str, report: ReadReport) -> list[Record]:
    if str(path).startswith("builtin:"):
        return [Record(r, f"{path}[{i}]") for i, r in enumerate(generated_records(str(path)))]
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"data source {str(path)!r} does not exist (set data.path=FILE or data.sources)")
    fmt = detect_format(path, fmt)
    if fmt in ("jsonl", "messages", "sharegpt"):
        if path.is_dir():
            raise DataError(f"data source {path} is a directory, not a JSONL file (data.format={fmt}); set "
                            f"data.path to the file, or data.format=auto for a dataset saved with save_to_disk")
        array = read_json_array(path, on_bad, report)
        return array if array is not None else list(read_jsonl(path, on_bad, report))
    return list(read_hf(path, fmt, split))


def source_list(data_cfg) -> list[tuple[str, str, float, str]]:
    """(path, format, weight, split) for every configured source; the built-in set by default."""
    if data_cfg.sources:
        return [(s.path, s.format, s.weight, s.split) for s in data_cfg.sources]
    if data_cfg.path:
        return [(data_cfg.path, data_cfg.format, 1.0, "train")]
    if not BUILTIN_PROMPTS.exists():
        raise DataError(f"the built-in prompt set {BUILTIN_PROMPTS} is missing from this install")
    return [(str(BUILTIN_PROMPTS), "messages", 1.0, "train")]


def apply_weight(items: list, weight: float, rng: random.Random) -> list:
    """A weight scales a source's share: 2.0 takes each record twice, 0.5 a random half."""
    whole, frac = int(math.floor(weight)), weight - math.floor(weight)
    out = items * whole
    if frac > 0:
        out += rng.sample(items, int(round(frac * len(items))))
    return out
