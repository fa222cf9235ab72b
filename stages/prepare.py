"""Stage 1, prepare: conversations -> chat template -> token ids with an assistant-only loss mask,
optional regeneration by the target, token frequencies and the draft vocabulary mapping.

Library: ``eagle3.data`` (sources, chat template, regeneration, dataset, vocab). Outputs: the
dataset, ``vocab.safetensors``, ``token_freq.safetensors``, ``stats.json`` (``eagle3.artifacts``)
and :class:`eagle3.contracts.PrepareFacts`.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter

log = logging.getLogger("eagle3.prepare")


def run(cfg, manifest):
    from eagle3.artifacts import DATASET_DIR, REGENERATED_FILE, STATS_FILE, TOKEN_FREQ_FILE, VOCAB_FILE
    from eagle3.contracts import PrepareFacts
    from eagle3.data.dataset import (
        assign_splits,
        category_counts,
        conversation_key,
        load_conversations,
        nothing_to_train_message,
        prepare_config,
        token_frequencies,
        tokenize_all,
        write_dataset,
    )
    from eagle3.data.sources import DataError, ReadReport
    from eagle3.data.vocab import build_vocab_mapping, coverage_curve, save_vocab
    from eagle3.hashing import semantic_dict
    from eagle3.target import load_tokenizer, resolve

    target = resolve(cfg.target, cfg.workspace)
    if cfg.prepare.regenerate:  # an engine known to compute this target wrong would write the answers
        from eagle3.extract.checks import refuse_known_bad

        refuse_known_bad(target.config, cfg.prepare.regen.backend, setting="prepare.regen.backend")
    config = prepare_config(cfg)
    job = manifest.start("prepare", config=config, target=target.identity(),
                         inputs=manifest.consume_upstream("prepare", target.identity()))
    if (done := job.claim()) is not None:
        print(f"prepare: already complete ({job.config_hash[:12]}), nothing to do")
        return done
    tokenizer = load_tokenizer(target, cfg.target.chat_template)
    if not tokenizer.chat_template:
        from eagle3.data.chat_template import ChatTemplateError

        raise ChatTemplateError(f"the tokenizer of {target.path} has no chat template; supply one with "
                                f"target.chat_template=FILE (a Jinja template) or target.chat_template='<template text>'")
    with job:
        t0 = time.perf_counter()
        out = job.out_dir
        report, drops = ReadReport(), Counter()
        categories: list = []  # parallel to conversations: each one's category (or None)
        conversations = load_conversations(cfg, report, drops, categories=categories)
        if report.bad_records:
            log.warning("skipped %d bad records, e.g. %s", report.bad_records, "; ".join(report.bad_examples))
        if not conversations:  # (before regeneration would start an engine for nothing)
            raise DataError(nothing_to_train_message(cfg, report, drops))
        regen_stats = {}
        keys = [conversation_key(m) for m in conversations]  # ids and splits: the source conversations'
        if cfg.prepare.regenerate:
            kept: list = []
            conversations, regen_stats = _regenerate(cfg, target, tokenizer, conversations, drops, kept)
            categories = [categories[i] for i in kept]
            keys = [keys[i] for i in kept]
            with open(out / REGENERATED_FILE, "w") as f:
                for msgs in conversations:
                    f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
            job.add_output(out / REGENERATED_FILE)
        t_tok = time.perf_counter()
        rows, truncated = tokenize_all(conversations, tokenizer, cfg, drops, cfg.progress, categories=categories,
                                        keys=keys)
        tok_seconds = time.perf_counter() - t_tok
        if not rows:
            raise DataError(nothing_to_train_message(cfg, report, drops))
        train_rows, eval_rows = assign_splits(rows, cfg.prepare.eval_fraction, cfg.prepare.eval_min)
        if not train_rows or not eval_rows:  # a dataset later stages cannot read is never recorded complete
            raise DataError(f"{len(rows)} sample{'s' if len(rows) != 1 else ''} after preparation: too few for both "
                            f"splits ({len(train_rows)} train, {len(eval_rows)} held out; prepare.eval_min="
                            f"{cfg.prepare.eval_min} are held out when more samples than that exist). Add "
                            f"conversations (drops: {dict(drops)}).")
        freq = token_frequencies(train_rows, target.vocab_size, target.path)
        mapping = build_vocab_mapping(freq, cfg.prepare.draft_vocab_size)
        curve = coverage_curve(freq, chosen=mapping.draft_vocab_size)
        by_category = {split: category_counts(r) for split, r in (("train", train_rows), ("eval", eval_rows))}
        by_category = by_category if any(by_category.values()) else None
        if mapping.num_seen < min(cfg.prepare.draft_vocab_size, target.vocab_size):
            log.warning("only %d distinct tokens were seen in training targets; the draft vocabulary (%d) is "
                        "padded with unseen ids", mapping.num_seen, mapping.draft_vocab_size)

        import torch

        from eagle3.atomic import save_safetensors

        write_dataset(train_rows, eval_rows, out / DATASET_DIR)
        save_vocab(mapping, out / VOCAB_FILE)
        save_safetensors({"freq": torch.from_numpy(freq)}, out / TOKEN_FREQ_FILE)
        n_tokens = sum(len(r["input_ids"]) for r in rows)
        n_trainable = sum(sum(r["loss_mask"]) for r in rows)
        stats = {"records_read": report.records,
                 "conversations_read": len(conversations) + drops["no_trainable_tokens"],
                 "samples": len(rows), "train": len(train_rows), "eval": len(eval_rows),
                 "tokens": n_tokens, "trainable_tokens": n_trainable, "truncated": truncated,
                 "dropped": dict(drops), "bad_records": report.bad_records,
                 "bad_record_examples": report.bad_examples, "regeneration": regen_stats,
                 "draft_vocab_size": mapping.draft_vocab_size, "distinct_trainable_tokens": mapping.num_seen,
                 "coverage": mapping.coverage, "coverage_curve": curve, "categories": by_category,
                 "tokenize_seconds": round(tok_seconds, 3),
                 "tokens_per_second": round(n_tokens / tok_seconds) if tok_seconds > 0 else None,
                 "seconds": round(time.perf_counter() - t0, 3)}
        (out / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
        for name in (DATASET_DIR, VOCAB_FILE, TOKEN_FREQ_FILE, STATS_FILE):
            job.add_output(out / name)
        job.log({f"prepare/{k}": v for k, v in stats.items() if isinstance(v, (int, float))})
        job.facts = PrepareFacts(
            tokenizer_hash=target.tokenizer_hash, max_length=cfg.prepare.max_length,
            draft_vocab_size=mapping.draft_vocab_size, vocab_size=target.vocab_size,
            coverage=round(mapping.coverage, 6), num_train=len(train_rows), num_eval=len(eval_rows),
            tokens=n_tokens, trainable_tokens=n_trainable, dropped=dict(drops), bad_records=report.bad_records,
            regenerated=bool(cfg.prepare.regenerate),
            regen=semantic_dict(cfg.prepare.regen) if cfg.prepare.regenerate else None,
            coverage_curve=curve, categories=by_category)
        log.info("prepare: %d train / %d eval samples, %d tokens (%d trainable), coverage %.4f, drops %s",
                 len(train_rows), len(eval_rows), n_tokens, n_trainable, mapping.coverage, dict(drops))
        print(f"prepare: draft vocabulary coverage of trainable tokens: {job.facts.coverage_line()}")
    return job.record


def _regenerate(cfg, target, tokenizer, conversations, drops, kept=None):
    """Every assistant turn rewritten by the target (vLLM or transformers, ``prepare.regen``)."""
    from eagle3.data.regenerate import regenerate

    dtype = cfg.prepare.regen.dtype
    if dtype == "auto":
        dtype = target.run_dtype(cfg.target.dtype)
    key, gb = "prepare.regen.kv_cache_gb", cfg.prepare.regen.kv_cache_gb
    if cfg.prepare.regen.backend == "vllm":  # named by its eagle3 key, before the engine starts
        from eagle3.kv_cache import check_fits, weights_bytes

        check_fits(key, gb, weights_bytes(target.path))
    try:
        conversations, stats = regenerate(conversations, tokenizer, str(target.path), cfg.prepare.regen,
                                          progress=cfg.progress, dtype=dtype, kept=kept)
    except Exception as e:  # vLLM's own "KV cache does not fit" names its flags: name ours
        from eagle3.kv_cache import translate

        if (named := translate(e, key, gb)) is not None:
            raise named from e
        raise
    stats["dtype"] = dtype
    drops["regeneration_too_long"] += stats.get("dropped_too_long", 0)
    drops["empty_regeneration"] += stats.get("empty_response", 0)
    return conversations, stats
