"""Acceptance by prompt context length: the held-out prompts in buckets of their length in tokens.

Published EAGLE-3 drafts lose most of their acceptance on long contexts; the buckets show where a
draft stands. ``export.context_buckets`` holds the edges (tokens): edges [512, 2048, 8192] make the
buckets ``0-512``, ``512-2k``, ``2k-8k`` and ``8k+``, a prompt of ``n`` tokens in the bucket whose
lower edge is <= n < its upper edge. Only the buckets the target can hold are reported: a bucket whose
lower edge is at or past the target's ``max_position_embeddings`` is dropped (a prompt never lands
there); a kept bucket with no held-out prompt is reported with ``num_prompts`` 0 and no figures.

How each bucket is counted (``ExportFacts.context_counting``): vLLM >= 0.32 reports acceptance per
request (``RequestOutput.outputs[0].spec_decode_metrics``, ``per_request_spec_decode_metrics``), so a
bucket's figures add up its prompts' records; an older vLLM (GPU vLLM 0.25) only has engine-wide
counters, so the speculative engines run each bucket's prompts as a batch of their own and a bucket's
figures are the counters' difference around its batch (eagle3.export.vllm_eval.generate_counted's
groups). The offline evaluator (``stage=eval``) counts every prompt itself.

This module does not choose prompts: long ones come from the data (the prepare stage's eval split,
``export.prompts``) or from ``export.extra_prompts``.
"""
from __future__ import annotations

DEFAULT_EDGES = (512, 2048, 8192)


def _size(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def check_edges(edges) -> list[int]:
    """The edges as ints, refused unless positive and strictly increasing (``export.context_buckets``)."""
    out = [int(e) for e in edges]
    if not out or any(e <= 0 for e in out) or any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"export.context_buckets must be positive token counts in increasing order (the bucket "
                         f"edges, e.g. [512, 2048, 8192]), got {list(edges)}")
    return out


def buckets(edges, max_len: int | None = None) -> list[tuple[str, int, int | None]]:
    """(label, lower edge, upper edge or None) of each bucket the target's ``max_len`` allows."""
    edges = check_edges(edges)
    bounds = [0, *edges]
    out = []
    for i, lo in enumerate(bounds):
        hi = bounds[i + 1] if i + 1 < len(bounds) else None
        if max_len is not None and i > 0 and lo >= max_len:
            break
        label = f"{_size(lo)}-{_size(hi)}" if hi is not None else f"{_size(lo)}+"
        out.append((label, lo, hi))
    return out


def bucket_indices(lengths: list[int], edges, max_len: int | None = None) -> dict[str, list[int]]:
    """Bucket label -> indices of the prompts (by their lengths) in it, every allowed bucket, in order."""
    bs = buckets(edges, max_len)
    out: dict[str, list[int]] = {label: [] for label, _, _ in bs}
    for i, n in enumerate(lengths):
        for label, lo, hi in bs:
            if n >= lo and (hi is None or n < hi):
                out[label].append(i)
                break
    return out


def target_max_length(target_config: dict) -> int | None:
    """The target's longest context (``max_position_embeddings``, the text config's for a multimodal
    one); None when its config does not say."""
    for cfg in (target_config, target_config.get("text_config") or {}):
        n = cfg.get("max_position_embeddings")
        if n:
            return int(n)
    return None


def cells(categories: list | None, lengths: list[int], edges, max_len: int | None) -> list[list[int]]:
    """The finest partition of the prompts that keeps every category and every bucket a union of its
    parts (the batches an engine without per-request acceptance runs one after the other)."""
    by_bucket = bucket_indices(lengths, edges, max_len)
    where = {i: label for label, idx in by_bucket.items() for i in idx}
    groups: dict = {}
    for i in range(len(lengths)):
        cat = None if categories is None else categories[i]
        groups.setdefault((str(cat), where[i]), []).append(i)
    return [groups[key] for key in sorted(groups)]


def by_context_length(lengths: list[int], edges, max_len: int | None, by_k: dict, k: int, ngram=None) -> dict:
    """Per bucket: its edges, prompts, acceptance length, per-position acceptance and tokens per target
    step at k, acceptance length and tokens per step per k, and (``ngram``) prompt lookup's tokens per
    target step. ``by_k``: {k: AcceptanceStats} over all the prompts, with per-request records or
    whole-bucket groups (AcceptanceStats.subset)."""
    out = {}
    for (label, lo, hi), idx in zip(buckets(edges, max_len), bucket_indices(lengths, edges, max_len).values()):
        row = {"min_tokens": lo, "max_tokens": hi, "num_prompts": len(idx)}
        if idx:
            subs = {kk: s.subset(idx) for kk, s in by_k.items()}
            main = subs[k]
            row.update({"mean_prompt_tokens": round(sum(lengths[i] for i in idx) / len(idx), 1),
                        "acceptance_length": round(main.acceptance_length, 4),
                        "acceptance_per_position": [round(p, 4) for p in main.per_position],
                        "tokens_per_step": round(main.tokens_per_step, 4),
                        "acceptance_by_k": {str(kk): round(s.acceptance_length, 4) for kk, s in subs.items()},
                        "tokens_per_step_by_k": {str(kk): round(s.tokens_per_step, 4) for kk, s in subs.items()}})
            if ngram is not None:
                row["ngram_tokens_per_step"] = round(ngram.subset(idx).tokens_per_step, 4)
        out[label] = row
    return out


def ordered(by_context: dict | None) -> list[tuple[str, dict]]:
    """The buckets shortest first (the manifest stores them with sorted keys, "2k-8k" before "512-2k")."""
    return sorted((by_context or {}).items(), key=lambda kv: kv[1]["min_tokens"])


def summary_line(by_context: dict | None, k: int) -> str:
    """One line: each bucket's acceptance length at k and its number of prompts."""
    if not by_context:
        return ""
    parts = [f"{label} ({d['num_prompts']} prompts) {d['acceptance_length']:.3f}" if d.get("num_prompts") else
             f"{label} (no prompt)" for label, d in ordered(by_context)]
    return f"acceptance length by prompt context length (tokens) at k={k}: " + ", ".join(parts)


def context_semantics(export_cfg) -> dict:
    """The buckets in a stage's hashed config only when they are not the default (runs recorded before
    them keep their hash)."""
    edges = [int(e) for e in export_cfg.context_buckets]
    return {} if edges == list(DEFAULT_EDGES) else {"context_buckets": edges}


def eval_context_facts(export_cfg, target, prompts: list, results: dict, k: int) -> dict:
    """``stage=eval``'s by_context_length (from the offline evaluator's per-prompt counts) and edges."""
    edges = check_edges(export_cfg.context_buckets)
    return {"by_context_length": by_context_length([len(p) for p in prompts], edges,
                                                   target_max_length(target.config), results, k),
            "context_buckets": edges}
