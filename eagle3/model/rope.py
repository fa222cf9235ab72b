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


# --- MLA (DeepSeek-V2/V3) RoPE, as vLLM's DeepseekV2MLAAttention computes it ---------------------
# vLLM (model_executor/models/deepseek_v2.py) rotates only the qk_rope_head_dim part of q and the
# shared k_pe, interleaved (``is_neox_style=False``: pairs (x[2i], x[2i+1])); a non-default rope type
# becomes ``deepseek_yarn`` (DeepseekScalingRotaryEmbedding: YaRN inverse frequencies, cos/sin times
# yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)) and the softmax scale
# qk_head_dim**-0.5 is multiplied by yarn_get_mscale(factor, mscale_all_dim)**2. With
# ``attention_factor == 1.0`` vLLM picks ``deepseek_llama_scaling`` instead, not mirrored here.

def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    import math

    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_rope(rope_dim: int, theta: float, scaling: Optional[dict]) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [rope_dim/2] float32, cos/sin scale, softmax-scale factor) of vLLM's MLA RoPE."""
    import math

    exps = torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim
    pos_freqs = theta ** exps
    if not scaling:
        return 1.0 / pos_freqs, 1.0, 1.0
    rope_type = scaling.get("rope_type")
    if rope_type != "yarn" or scaling.get("attention_factor") == 1.0:
        raise ValueError(f"the MLA draft mirrors vLLM's default and deepseek_yarn RoPE; the target's rope "
                         f"{scaling} is not one of them")
    factor = float(scaling["factor"])
    max_pos = int(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

    def corr_dim(rot):
        return (rope_dim * math.log(max_pos / (rot * 2 * math.pi))) / (2 * math.log(theta))
    low, high = max(math.floor(corr_dim(beta_fast)), 0), min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rope_dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)
    extrapolation_mask = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_mask) + (1.0 / pos_freqs) * extrapolation_mask
    mscale_all_dim = float(scaling.get("mscale_all_dim", 0) or 0)
    cs_scale = yarn_get_mscale(factor, float(scaling.get("mscale", 1))) / yarn_get_mscale(factor, mscale_all_dim)
    m = yarn_get_mscale(factor, mscale_all_dim)
    return inv_freq, float(cs_scale), float(m * m)


def rope_cos_sin_interleaved(position_ids: torch.Tensor, inv_freq: torch.Tensor, scale: float,
                             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, rope_dim/2] (one per rotated pair), for :func:`apply_rope_interleaved`."""
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    return (freqs.cos() * scale).to(dtype)[:, None], (freqs.sin() * scale).to(dtype)[:, None]


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """vLLM's GPT-J style rotation: pairs (x[2i], x[2i+1]) rotated by angle i."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
