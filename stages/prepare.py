"""Stage 1, prepare: conversations -> chat template -> token ids with an assistant-only loss mask,
optional regeneration by the target, token frequencies and the draft vocabulary mapping."""
from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections import Counter
from pathlib import Path

log = logging.getLogger("eagle3.prepare")


def _source_identity(path: str) -> str:
    from eagle3.hashing import hash_files, sha256_file

    if str(path).startswith("builtin:"):  # a prompt set generated in memory (data.path=builtin:large)
        from eagle3.data.sources import generated_identity

        return generated_identity(str(path))
    p = Path(path).expanduser()
    if p.is_dir():
        return hash_files([f for f in p.rglob("*") if f.is_file()], p)
    return sha256_file(p) if p.exists() else "missing"


def _conversation_key(messages: list[dict]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def load_conversations(cfg, report, drops: Counter) -> list[list[dict]]:
    """Read, normalize, de-duplicate and weight every source; deterministic for a given config."""
    from eagle3.data.chat_template import normalize_messages
    from eagle3.data.sources import DataError, apply_weight, read_source, source_list

    rng = random.Random(cfg.prepare.seed)
    seen: set[str] = set()
    out: list[list[dict]] = []
    for path, fmt, weight, split in source_list(cfg.data):
        convs = []
        for rec in read_source(path, fmt, split, cfg.data.on_bad_record, report):
            try:
                msgs = normalize_messages(rec.raw)
            except ValueError as e:
                if cfg.data.on_bad_record == "skip":
                    report.bad(rec.origin, str(e))
                    continue
                raise DataError(f"{rec.origin}: {e}. Fix the record, or pass data.on_bad_record=skip "
                                f"to count and skip bad records.") from None
            if cfg.data.system_prompt and not any(m["role"] == "system" for m in msgs):
                msgs = [{"role": "system", "content": cfg.data.system_prompt}] + msgs
            if cfg.prepare.dedup:
                key = _conversation_key(msgs)
                if key in seen:
                    drops["duplicate"] += 1
                    continue
                seen.add(key)
            convs.append(msgs)
        out.extend(apply_weight(convs, weight, rng))
    if cfg.data.max_samples and len(out) > cfg.data.max_samples:
        rng.shuffle(out)
        drops["over_max_samples"] += len(out) - cfg.data.max_samples
        out = out[: cfg.data.max_samples]
    return out


def split_of(messages: list[dict], seed: int, eval_fraction: float) -> tuple[str, float]:
    """A sample's split from a hash of its content: stable when other samples are added."""
    key = _conversation_key(messages)
    u = int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:12], 16) / 16**12
    return key[:16], u


def tokenize_all(conversations, tokenizer, cfg, drops: Counter, progress: bool, batch: int = 512):
    from tqdm.auto import tqdm

    from eagle3.data.chat_template import tokenize_conversations
    from eagle3.data.sources import DataError

    rows = []
    truncated = 0
    max_len = cfg.prepare.max_length
    with tqdm(total=len(conversations), desc="tokenize", disable=not progress, unit="conv") as bar:
        for start in range(0, len(conversations), batch):
            chunk = conversations[start:start + batch]
            errors: list = []
            encoded = tokenize_conversations(tokenizer, chunk, errors=errors)
            for k, e in errors:
                if cfg.data.on_bad_record != "skip":
                    raise DataError(f"conversation {start + k} (first message: "
                                    f"{chunk[k][0]['content'][:60]!r}) cannot be masked: {e}. Fix or drop it, "
                                    f"or pass data.on_bad_record=skip to count and skip such conversations.")
                drops["template_error"] += 1
            for msgs, enc in zip(chunk, encoded):
                if enc is None:
                    continue
                ids, mask = enc
                if len(ids) > max_len:
                    ids, mask = ids[:max_len], mask[:max_len]
                    truncated += 1
                if not any(mask):
                    drops["no_trainable_tokens"] += 1
                    continue
                sid, u = split_of(msgs, cfg.prepare.seed, cfg.prepare.eval_fraction)
                rows.append({"sample_id": sid, "u": u, "input_ids": ids, "loss_mask": mask})
            bar.update(len(chunk))
    return rows, truncated


def assign_splits(rows, eval_fraction: float, eval_min: int):
    rows.sort(key=lambda r: r["u"])
    n_eval = sum(r["u"] < eval_fraction for r in rows)
    if eval_fraction > 0 and n_eval < eval_min and len(rows) > eval_min:
        n_eval = eval_min
    return rows[n_eval:], rows[:n_eval]


def write_dataset(train_rows, eval_rows, out: Path) -> None:
    import datasets

    features = datasets.Features({"sample_id": datasets.Value("string"),
                                  "input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int8"))})

    def build(rows):
        rows = sorted(rows, key=lambda r: r["sample_id"])
        return datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in ("sample_id", "input_ids", "loss_mask")},
                                          features=features)

    datasets.DatasetDict({"train": build(train_rows), "eval": build(eval_rows)}).save_to_disk(str(out))


def run(cfg, manifest):
    import numpy as np

    from eagle3.data.sources import DataError, ReadReport, source_list
    from eagle3.data.vocab import build_vocab_mapping, save_vocab
    from eagle3.hashing import semantic_dict
    from eagle3.target import load_tokenizer, resolve

    target = resolve(cfg.target, cfg.workspace)
    config = {"data": semantic_dict(cfg.data), "prepare": semantic_dict(cfg.prepare),
              "chat_template": cfg.target.chat_template,
              "sources": [_source_identity(p) for p, *_ in source_list(cfg.data)]}
    if not cfg.prepare.regenerate:
        config["prepare"].pop("regen")
    job = manifest.start("prepare", config=config, target=target.identity())
    if job.done:
        log.info("prepare: already complete for this config (%s); nothing to do", job.config_hash[:12])
        print(f"prepare: already complete ({job.config_hash[:12]}), nothing to do")
        return job.record
    tokenizer = load_tokenizer(target, cfg.target.chat_template)
    if not tokenizer.chat_template:
        from eagle3.data.chat_template import ChatTemplateError

        raise ChatTemplateError(f"the tokenizer of {target.path} has no chat template; supply one with "
                                f"target.chat_template=FILE (a Jinja template) or target.chat_template='<template text>'")
    with job:
        t0 = time.perf_counter()
        report, drops = ReadReport(), Counter()
        conversations = load_conversations(cfg, report, drops)
        if report.bad_records:
            log.warning("skipped %d bad records, e.g. %s", report.bad_records, "; ".join(report.bad_examples))
        regen_stats = {}
        out = job.out_dir
        if cfg.prepare.regenerate:
            from eagle3.data.regenerate import regenerate

            rdtype = cfg.prepare.regen.dtype
            if rdtype == "auto":
                rdtype = target.run_dtype(cfg.target.dtype)
            conversations, regen_stats = regenerate(conversations, tokenizer, str(target.path), cfg.prepare.regen,
                                                    progress=cfg.progress, dtype=rdtype)
            regen_stats["dtype"] = rdtype
            drops["regeneration_too_long"] += regen_stats.get("dropped_too_long", 0)
            drops["empty_regeneration"] += regen_stats.get("empty_response", 0)
            with open(out / "regenerated.jsonl", "w") as f:
                for msgs in conversations:
                    f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
            job.add_output(out / "regenerated.jsonl")
        t_tok = time.perf_counter()
        rows, truncated = tokenize_all(conversations, tokenizer, cfg, drops, cfg.progress)
        tok_seconds = time.perf_counter() - t_tok
        if not rows:
            raise DataError(f"no sample has trainable (assistant) tokens after preparation (drops: {dict(drops)}). "
                            f"Conversations need assistant turns, or set prepare.regenerate=true.")
        train_rows, eval_rows = assign_splits(rows, cfg.prepare.eval_fraction, cfg.prepare.eval_min)

        vocab = target.vocab_size
        freq = np.zeros(vocab, dtype=np.int64)
        for r in train_rows:
            ids = np.asarray(r["input_ids"], dtype=np.int64)
            m = np.asarray(r["loss_mask"], dtype=bool)
            if ids.size and ids.max() >= vocab:
                raise DataError(f"token id {int(ids.max())} is outside the target vocabulary ({vocab}): the "
                                f"tokenizer does not belong to {target.path}")
            freq += np.bincount(ids[m], minlength=vocab)
        mapping = build_vocab_mapping(freq, cfg.prepare.draft_vocab_size)
        if mapping.num_seen < min(cfg.prepare.draft_vocab_size, vocab):
            log.warning("only %d distinct tokens were seen in training targets; the draft vocabulary (%d) is "
                        "padded with unseen ids", mapping.num_seen, mapping.draft_vocab_size)

        write_dataset(train_rows, eval_rows, out / "dataset")
        save_vocab(mapping, out / "vocab.safetensors")
        import torch
        from safetensors.torch import save_file

        save_file({"freq": torch.from_numpy(freq)}, str(out / "token_freq.safetensors"))
        n_tokens = sum(len(r["input_ids"]) for r in rows)
        n_trainable = sum(sum(r["loss_mask"]) for r in rows)
        stats = {"conversations_read": len(conversations) + drops["no_trainable_tokens"],
                 "samples": len(rows), "train": len(train_rows), "eval": len(eval_rows),
                 "tokens": n_tokens, "trainable_tokens": n_trainable, "truncated": truncated,
                 "dropped": dict(drops), "bad_records": report.bad_records,
                 "bad_record_examples": report.bad_examples, "regeneration": regen_stats,
                 "draft_vocab_size": mapping.draft_vocab_size, "distinct_trainable_tokens": mapping.num_seen,
                 "coverage": mapping.coverage, "tokenize_seconds": round(tok_seconds, 3),
                 "tokens_per_second": round(n_tokens / tok_seconds) if tok_seconds > 0 else None,
                 "seconds": round(time.perf_counter() - t0, 3)}
        (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        for name in ("dataset", "vocab.safetensors", "token_freq.safetensors", "stats.json"):
            job.add_output(out / name)
        job.facts.update(tokenizer_hash=target.tokenizer_hash, max_length=cfg.prepare.max_length,
                         draft_vocab_size=mapping.draft_vocab_size, vocab_size=vocab,
                         coverage=round(mapping.coverage, 6), num_train=len(train_rows), num_eval=len(eval_rows),
                         tokens=n_tokens, trainable_tokens=n_trainable, dropped=dict(drops),
                         bad_records=report.bad_records, regenerated=bool(cfg.prepare.regenerate),
                         regen=semantic_dict(cfg.prepare.regen) if cfg.prepare.regenerate else None)
        from eagle3.tracking import stage_run

        with stage_run(cfg, "prepare", job) as wb:
            wb.log({f"prepare/{k}": v for k, v in stats.items() if isinstance(v, (int, float))})
        log.info("prepare: %d train / %d eval samples, %d tokens (%d trainable), coverage %.4f, drops %s",
                 len(train_rows), len(eval_rows), n_tokens, n_trainable, mapping.coverage, dict(drops))
    return job.record
