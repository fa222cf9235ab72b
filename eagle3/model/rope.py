"""Rotary position embeddings as the target (and vLLM's draft) compute them.

Plain RoPE is computed here; scaled variants (llama3, linear, yarn, ...) take their inverse
frequencies from transformers' own table so the draft rotates exactly as the served model does.
"""
from __future__ import annotations

from typing import Optional

import torch


def rope_parameters(text_config: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, scaling dict with 'rope_type' or None) from an HF config, old or new style."""
    params = dict(text_config.get("rope_parameters") or {})
    scaling = dict(text_config.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.pop("rope_theta", text_config.get("rope_theta", 10000.0)))
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **merged}


def inv_freq_and_scale(head_dim: int, theta: float, scaling: Optional[dict], hidden_size: int,
                       num_heads: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32) and the cos/sin scale factor."""
    if not scaling:
        exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta ** exps), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = scaling["rope_type"]
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} of the target is not known to transformers "
                         f"({sorted(ROPE_INIT_FUNCTIONS)}); upgrade transformers or override the draft's rope.")
    cfg = LlamaConfig(hidden_size=hidden_size, num_attention_heads=num_heads, head_dim=head_dim,
                      max_position_embeddings=max_position_embeddings,
                      rope_parameters={"rope_theta": theta, **scaling})
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, scale: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, head_dim] for integer positions [B, T] (HF's half-split layout)."""
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype)[:, None], (emb.sin() * scale).to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin
