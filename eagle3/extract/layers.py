"""Which layers to store, in vLLM's convention.

Id k is the residual stream entering decoder layer k (= HF ``hidden_states[k]``; id 0 is the
embeddings). Aux ids must be < L; id L (the final pre-norm state, which the train stage turns into
target logits through the frozen final norm and lm_head) is always stored, separately, as
``last_hidden_state``. vLLM concatenates aux states in ascending id order, so ids are stored sorted.
"""
from __future__ import annotations

import logging

from ..errors import Eagle3Error

log = logging.getLogger("eagle3.extract")


class LayerIdError(Eagle3Error):
    pass


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default (2, L//2, L-3), or distinct ids spread over [1, L-1] where those collide."""
    L = num_layers
    ids = (2, L // 2, L - 3)
    if len(set(ids)) == 3 and all(0 <= i < L for i in ids):
        return tuple(sorted(ids))
    want = min(3, L)
    spread = sorted({round(1 + (L - 2) * t / 2) for t in (0, 1, 2)} & set(range(L))) if L > 1 else []
    chosen = list(spread)
    for i in range(L - 1, -1, -1):  # fill from the top: deeper layers carry more of the next token
        if len(chosen) >= want:
            break
        if i not in chosen:
            chosen.append(i)
    out = tuple(sorted(chosen[:want]))
    log.warning("extract: the default layer ids (2, L//2, L-3) = %s are not distinct/in range for a %d-layer target; "
                "using %s instead (set extract.layer_ids to choose)", ids, L, out)
    return out


def resolve_layer_ids(requested, num_layers: int) -> tuple[int, ...]:
    """Validated, sorted aux layer ids: the requested ones, or the default for ``num_layers``."""
    L = int(num_layers)
    if L < 1:
        raise LayerIdError(f"the target has {L} decoder layers; nothing to extract")
    if not requested:
        return default_layer_ids(L)
    ids = [int(i) for i in requested]
    bad = [i for i in ids if not 0 <= i < L]
    if bad:
        hint = (f" Id {L} (the final pre-norm state) is always stored as last_hidden_state; do not list it."
                if L in bad else "")
        raise LayerIdError(f"extract.layer_ids={ids}: {bad} out of range for a target with {L} decoder layers; "
                           f"aux ids must be in [0, {L - 1}] (vLLM's convention: id k = the stream entering "
                           f"layer k, 0 = embeddings).{hint}")
    if len(set(ids)) != len(ids):
        raise LayerIdError(f"extract.layer_ids={ids} has duplicates")
    if ids != sorted(ids):
        log.info("extract: layer ids %s stored in ascending order %s (the order vLLM concatenates them in)",
                 ids, sorted(ids))
    return tuple(sorted(ids))


FP8_MIN_HIDDEN = 2048
"""``auto`` stores fp8 for targets at least this wide (bench/results/fp8_store_h200_202611.md: drafts trained from fp8
and bf16 stores were served within 1% of each other on the embedded default and on
experiment=smollm2_large)."""


def resolve_store_dtype(store_dtype: str, target_dtype: str, hidden_size: int) -> str:
    """``auto``: float32 for float32 targets (tests, exactness), else fp8 for targets with hidden size
    >= FP8_MIN_HIDDEN (half the disk of bfloat16), else bfloat16."""
    if store_dtype != "auto":
        return store_dtype
    if target_dtype in ("float32", "torch.float32"):
        return "float32"
    return "fp8" if hidden_size >= FP8_MIN_HIDDEN else "bfloat16"
