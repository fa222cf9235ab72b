"""Turning a collated batch into the TTT model's inputs (shared by the loop and bench/train.py)."""
from __future__ import annotations

import torch

from .target_head import TargetHead


def model_inputs(head: TargetHead, batch: dict, compute_dtype: torch.dtype) -> dict:
    """Frozen-target work, without gradients: token embeddings and the draft-vocab targets.

    Target probabilities are kept in the compute dtype (bf16 under mixed precision: half the
    memory of float32; the loss upcasts them)."""
    with torch.no_grad():
        embeds = head.embed(batch["input_ids"], compute_dtype)
        probs, in_vocab = head.targets(batch["last_hidden_state"], compute_dtype)
    return dict(aux=batch["aux_hidden_states"].to(compute_dtype), embeds=embeds, target_probs=probs,
                in_vocab=in_vocab, loss_mask=batch["loss_mask"], position_ids=batch["position_ids"],
                doc_ids=batch["doc_ids"])
