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


def eval_prompts(dataset_dir, n: int, split: str = "eval") -> list:
    import datasets

    ds = datasets.load_from_disk(str(dataset_dir))
    if split not in ds or len(ds[split]) == 0:
        raise ExportError(f"the prepared dataset {dataset_dir} has no {split!r} samples to evaluate on; re-run "
                          f"prepare with prepare.eval_fraction > 0 (or prepare.eval_min >= 1)")
    rows = ds[split]
    out = []
    for ids, mask in zip(rows["input_ids"], rows["loss_mask"]):
        p = prompt_of(ids, mask)
        if p:
            out.append(p)
        if len(out) >= n:
            break
    if not out:
        raise ExportError(f"none of the {len(rows)} {split} samples has a prompt before its first trainable token")
    return out


def stop_token_ids(target_path) -> set:
    """The ids a served request stops at: the tokenizer's eos and generation_config.json's eos ids."""
    from transformers import AutoTokenizer

    path = Path(target_path)
    ids = set()
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids.update(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return ids
