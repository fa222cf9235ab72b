"""Held-out prompts for acceptance measurements: the prepare stage's eval split, prompt part only.

A sample's prompt is every token before its first trainable (loss_mask == 1) token: the system
and user turns plus the assistant header, exactly what a served request would send. Samples are
taken in the split's stored order (sorted by sample id), so the same prepare run always yields
the same prompts.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import ExportError


def prompt_of(input_ids, loss_mask) -> list:
    for i, m in enumerate(loss_mask):
        if m:
            return [int(t) for t in input_ids[:i]]
    return []


def eval_prompts(dataset_dir, n: int, split: str = "eval", categories: list | None = None) -> list:
    """Up to ``n`` prompts of the split, in stored order. ``categories``: a list to receive each
    prompt's category (the dataset's ``category`` column; None where absent)."""
    import datasets

    ds = datasets.load_from_disk(str(dataset_dir))
    if split not in ds or len(ds[split]) == 0:
        raise ExportError(f"the prepared dataset {dataset_dir} has no {split!r} samples to evaluate on; re-run "
                          f"prepare with prepare.eval_fraction > 0 (or prepare.eval_min >= 1)")
    rows = ds[split]
    cats = rows["category"] if "category" in rows.column_names else [None] * len(rows)
    out = []
    for ids, mask, cat in zip(rows["input_ids"], rows["loss_mask"], cats):
        p = prompt_of(ids, mask)
        if p:
            out.append(p)
            if categories is not None:
                categories.append(cat)
        if len(out) >= n:
            break
    if not out:
        raise ExportError(f"none of the {len(rows)} {split} samples has a prompt before its first trainable token")
    return out


def held_out_prompts(export_cfg, prep, target_path, categories: list | None = None,
                     trust_remote_code: bool = False) -> list:
    """The prompts verification and stage=eval run: ``export.prompts`` if set, else the prepare
    stage's eval split; then every prompt of ``export.extra_prompts``. ``categories``: a list to
    receive each prompt's category (None without one): the dataset's ``category`` column (from the
    source records' ``category``/``domain`` field), or the prompts file's field."""
    if export_cfg.prompts:
        out = file_prompts(export_cfg.prompts, export_cfg.eval_prompts, target_path, categories=categories,
                           trust_remote_code=trust_remote_code)
    else:
        from ..artifacts import DATASET_DIR

        out = eval_prompts(prep.path(DATASET_DIR), export_cfg.eval_prompts, categories=categories)
    if export_cfg.extra_prompts:
        out += file_prompts(extra_prompts_path(export_cfg.extra_prompts), None, target_path, categories=categories,
                            trust_remote_code=trust_remote_code, key="export.extra_prompts")
    return out


BUILTIN_EXTRA = {"builtin:long_context": Path(__file__).resolve().parent.parent / "data" / "builtin" / "long_context.jsonl"}


def extra_prompts_path(value: str) -> Path:
    """``export.extra_prompts``: a built-in set's file (``builtin:long_context``) or the path given."""
    if value.startswith("builtin:"):
        if value not in BUILTIN_EXTRA:
            raise ExportError(f"export.extra_prompts={value!r} names no built-in prompt set; built-in: "
                              f"{', '.join(sorted(BUILTIN_EXTRA))} (or give a JSONL file)")
        return BUILTIN_EXTRA[value]
    return Path(value).expanduser()


def prompts_identity(export_cfg):
    """Content hash of ``export.prompts`` (and of ``export.extra_prompts`` when set) for a stage's
    config hash (None without either)."""
    from ..hashing import sha256_file

    main = None
    if export_cfg.prompts:
        if not Path(export_cfg.prompts).expanduser().is_file():
            raise ExportError(f"export.prompts={export_cfg.prompts!r} does not exist")
        main = sha256_file(Path(export_cfg.prompts).expanduser())
    if not export_cfg.extra_prompts:
        return main
    extra = extra_prompts_path(export_cfg.extra_prompts)
    if not extra.is_file():
        raise ExportError(f"export.extra_prompts={export_cfg.extra_prompts!r} does not exist (a JSONL file of "
                          f"{{'messages': [...]}} or {{'prompt_token_ids': [...]}} lines, or builtin:long_context)")
    return {"prompts": main, "extra_prompts": sha256_file(extra)}


def file_prompts(path, n: int | None, target_path, categories: list | None = None, trust_remote_code: bool = False,
                 key: str = "export.prompts") -> list:
    """Up to ``n`` prompts (token ids; None: all) from ``export.prompts`` (``key``): JSONL lines of {"messages": [...]}
    (rendered with the target's chat template and its assistant header) or {"prompt_token_ids": [...]},
    optionally with a ``category`` (or ``domain``) field, appended to ``categories`` when given."""
    from ..data.chat_template import generation_prompt_ids

    path = Path(path).expanduser()
    if not path.is_file():
        raise ExportError(f"{key}={str(path)!r} does not exist (a JSONL file of {{'messages': [...]}} or "
                          f"{{'prompt_token_ids': [...]}} lines)")
    tok = None
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ExportError(f"{path}:{lineno}: not JSON ({e})") from None
            if isinstance(rec, dict) and isinstance(rec.get("prompt_token_ids"), list) and rec["prompt_token_ids"]:
                ids = [int(t) for t in rec["prompt_token_ids"]]
            elif isinstance(rec, dict) and isinstance(rec.get("messages"), list) and rec["messages"]:
                msgs = list(rec["messages"])
                if msgs[-1].get("role") == "assistant":
                    msgs = msgs[:-1]
                if not msgs:
                    raise ExportError(f"{path}:{lineno}: no turn before the assistant's")
                if tok is None:
                    from transformers import AutoTokenizer

                    tok = AutoTokenizer.from_pretrained(str(target_path), trust_remote_code=trust_remote_code)
                ids = generation_prompt_ids(tok, msgs)
            else:
                raise ExportError(f"{path}:{lineno}: expected {{'messages': [...]}} or {{'prompt_token_ids': [...]}}, "
                                  f"got {line.strip()[:80]!r}")
            out.append(ids)
            if categories is not None:
                from ..data.dataset import record_category
                from ..data.sources import DataError, Record

                try:
                    categories.append(record_category(Record(rec, f"{path}:{lineno}")))
                except DataError as e:
                    raise ExportError(str(e)) from None
            if n is not None and len(out) >= n:
                break
    if not out:
        raise ExportError(f"{key}={str(path)!r} holds no prompts")
    return out


def stop_token_ids(target_path, trust_remote_code: bool = False) -> set:
    """The ids a served request stops at: the tokenizer's eos and generation_config.json's eos ids."""
    from transformers import AutoTokenizer

    path = Path(target_path)
    ids = set()
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids.update(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ids
