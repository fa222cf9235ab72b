"""``prepare.draft_vocab_size=auto``: the draft vocabulary size chosen from the token frequencies.

A larger draft vocabulary covers more of the trainable tokens (a draft token outside it is never
accepted) but makes every draft forward pass dearer: its lm_head costs ``H x V`` multiply-adds a
token, next to the decoder layer and ``fc`` that do not depend on ``V``. The choice maximises

    coverage(V) / (1 + k * (draft_fixed + H * V) / target_cost)

over ``V`` in multiples of :data:`MULTIPLE` (capped at the target's vocabulary): ``coverage(V)`` the
share of the training split's trainable (loss-masked) tokens the ``V`` most frequent ones cover,
``k`` = ``prepare.vocab_choice.draft_tokens`` draft passes per target step, ``draft_fixed`` the
draft's per-token weights besides its lm_head (one decoder layer and ``fc`` from 3H to H, the draft
eagle3 trains for this target with no ``train.model`` overrides: prepare's choice may not depend on
the train stage's settings) and ``target_cost`` the target's per-token weights (from its config).
Costs are recorded as FLOPs (2 per multiply-add); the factor cancels in the ratio. The objective is
a proxy (coverage bounds acceptance; the cost term is a roofline share of the draft in a step), so
the record keeps the runner-up and the default's score beside the choice.
"""
from __future__ import annotations

import numpy as np

MULTIPLE = 64
"""Candidate sizes are multiples of this (lm_head rows a GPU matmul tiles without a remainder)."""
DEFAULT_SIZE = 32000
"""``prepare.draft_vocab_size``'s default, scored beside the choice."""


def target_matmul_params(config: dict) -> int:
    """Weights a target multiplies per token, from its config.json: every decoder layer's attention
    and MLP (a mixture of experts: the routed experts a token uses and the shared ones) and the
    lm_head (embeddings are looked up, not multiplied)."""
    tc = config.get("text_config", config)
    H, L, V = int(tc["hidden_size"]), int(tc["num_hidden_layers"]), int(tc["vocab_size"])
    heads = int(tc["num_attention_heads"])
    kv = int(tc.get("num_key_value_heads") or heads)
    D = int(tc.get("head_dim") or H // heads)
    attn = 2 * H * heads * D + 2 * H * kv * D
    if tc.get("num_experts_per_tok") and tc.get("moe_intermediate_size"):
        experts = int(tc["num_experts_per_tok"]) + int(tc.get("n_shared_experts") or tc.get("num_shared_experts") or 0)
        mlp = 3 * H * int(tc["moe_intermediate_size"]) * experts
    else:
        mlp = 3 * H * int(tc["intermediate_size"])
    return L * (attn + mlp) + V * H


def draft_fixed_params(config: dict) -> int:
    """The default draft's per-token weights besides its lm_head: ``fc`` (3H -> H) and its decoder layer
    (eagle3.model.draft.count_matmul_params)."""
    from ..model.draft import Eagle3DraftConfig, count_matmul_params

    vocab = int(config.get("text_config", config)["vocab_size"])
    p = count_matmul_params(Eagle3DraftConfig.from_target(config, [0, 1, 2], min(MULTIPLE, vocab)))
    return int(p["fc"] + p["layer"])


def candidate_sizes(target_vocab: int) -> np.ndarray:
    """Multiples of MULTIPLE up to the target's vocabulary, and the vocabulary itself (the identity)."""
    sizes = np.arange(MULTIPLE, int(target_vocab) + 1, MULTIPLE, dtype=np.int64)
    return np.unique(np.append(sizes, int(target_vocab)))


def scores(freq, sizes, *, hidden: int, draft_fixed: int, target_cost: int, draft_tokens: int) -> tuple:
    """(coverage, objective) at each of ``sizes`` for the token frequencies ``freq``."""
    freq = np.asarray(freq, dtype=np.int64)
    total = int(freq.sum())
    cum = np.cumsum(np.sort(freq)[::-1])
    sizes = np.minimum(np.asarray(sizes, dtype=np.int64), len(freq))
    coverage = cum[sizes - 1] / total if total else np.zeros(len(sizes))
    cost = 1.0 + draft_tokens * (draft_fixed + hidden * sizes.astype(np.float64)) / target_cost
    return coverage, coverage / cost


def choose_draft_vocab_size(freq, *, hidden: int, draft_fixed: int, target_cost: int, draft_tokens: int) -> dict:
    """The record of the choice: ``chosen`` (the size), its ``coverage`` and ``score``, the
    ``runner_up`` and the ``default`` (DEFAULT_SIZE, capped) with theirs, the ``cost_model``'s inputs.
    Among equal scores the smallest size wins."""
    vocab = len(freq)
    sizes = candidate_sizes(vocab)
    kw = dict(hidden=hidden, draft_fixed=draft_fixed, target_cost=target_cost, draft_tokens=draft_tokens)
    cov, score = scores(freq, sizes, **kw)
    order = np.lexsort((sizes, -score))  # best score first, then the smaller size

    def entry(i) -> dict:
        return {"size": int(sizes[i]), "coverage": round(float(cov[i]), 6), "score": round(float(score[i]), 6)}

    default = min(DEFAULT_SIZE, vocab)
    dcov, dscore = scores(freq, [default], **kw)
    best = entry(order[0])
    return {"chosen": best["size"], "coverage": best["coverage"], "score": best["score"],
            "runner_up": entry(order[1]) if len(order) > 1 else None,
            "default": {"size": default, "coverage": round(float(dcov[0]), 6), "score": round(float(dscore[0]), 6)},
            "candidates": int(len(sizes)), "multiple": MULTIPLE,
            "cost_model": {"draft_tokens": int(draft_tokens), "hidden_size": int(hidden),
                           "draft_fixed_flops": 2 * int(draft_fixed), "lm_head_flops_per_row": 2 * int(hidden),
                           "target_flops": 2 * int(target_cost)}}


def choose_for_target(freq, target_config: dict, vocab_choice_cfg) -> dict:
    """:func:`choose_draft_vocab_size` with the cost model of this target (its config.json) and
    ``prepare.vocab_choice``."""
    tc = target_config.get("text_config", target_config)
    return choose_draft_vocab_size(freq, hidden=int(tc["hidden_size"]), draft_fixed=draft_fixed_params(target_config),
                                   target_cost=target_matmul_params(target_config),
                                   draft_tokens=vocab_choice_cfg.draft_tokens)

