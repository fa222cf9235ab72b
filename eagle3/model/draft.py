"""The EAGLE-3 draft: parameter names and arithmetic as vLLM's ``LlamaForCausalLMEagle3``.

vLLM (``model_executor/models/llama_eagle3.py``, same in ``qwen3_eagle3.py``) computes, per token:

    a        = concat(aux states)                         # [n_aux * H_target]
    norm_before_fc=True: a = input_norm(a)                # one RMSNorm over the concatenation
    fc_norm=True:        a = concat(fc_norm[i](a_i))      # one RMSNorm per aux state (after input_norm)
    h        = fc(a)                                      # step 0; later steps feed back `out` (below)
    e        = input_layernorm(embed(next token))
    norm_before_residual=False: residual = h;               x = hidden_norm(h)
    norm_before_residual=True:  residual = hidden_norm(h);  x = residual
    a        = o_proj(attn(q,k,v from concat(e, x)))      # concat order: embeds first
    residual = a + residual
    out      = mlp(post_attention_layernorm(residual)) + residual   # pre-norm, fed back
    logits   = lm_head(norm(out))                         # over the draft vocabulary
    norm_output=True: the state fed back is norm(out) (with its weight), not out

The three EAGLE-3.1 options (``norm_before_fc``, ``fc_norm``, ``norm_output``; all False by default
and then absent from every written file) are read by vLLM 0.32's llama_eagle3.py and qwen3_eagle3.py
from the draft's config.json (``norm_before_fc`` also from ``eagle_config``); every combination loads.

architecture=deepseek is vLLM's deepseek_eagle3.py (``Eagle3DeepseekV2ForCausalLM``): the same
layer with DeepSeek's MLA attention (``Eagle3MLAAttention``; q_a_proj/q_proj and kv_a_proj_with_mqa read
concat(e, x)) sized from the target's MLA config; it reads fc_norm, norm_output and norm_before_residual,
not norm_before_fc.

The attention is split into ``pre_attention`` / ``post_attention`` so the training-time test can
run its own attention over the keys of all steps in between (eagle3/train/ttt.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.fp8_matmul import linear, quantize_weight
from .rope import (
    apply_rope,
    apply_rope_interleaved,
    inv_freq_and_scale,
    mla_rope,
    rope_cos_sin,
    rope_cos_sin_interleaved,
    rope_parameters,
)

# deepseek: vLLM 0.32's deepseek_eagle3.py (registered as Eagle3DeepseekV2ForCausalLM and, an alias,
# Eagle3DeepseekV3ForCausalLM); its config must say model_type deepseek_v2 (with deepseek_v3 vLLM's
# SpeculativeConfig rewrites the draft into an MTP model, bench/results/mla_draft_probe_cpu_202611.md)
ARCHITECTURES = {"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM",
                 "deepseek": "Eagle3DeepseekV2ForCausalLM"}
MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "deepseek": "deepseek_v2"}
# the MLA sizes (DeepSeek-V2/V3 config keys), only in a deepseek draft's config
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def is_mla_config(target_config: dict) -> bool:
    """The target attends with MLA (DeepSeek-V2/V3, Kimi-K2): its config has ``kv_lora_rank``."""
    tc = target_config.get("text_config", target_config)
    return bool(tc.get("kv_lora_rank"))
# EAGLE-3.1's draft options (vLLM's config keys), each False by default
NORM_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")


@dataclass
class Eagle3DraftConfig:
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: List[int]
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 8192
    norm_before_residual: bool = True
    architecture: str = "llama"
    initializer_range: float = 0.02
    norm_before_fc: bool = False  # RMSNorm ``input_norm`` over the concatenated aux states, before fc
    fc_norm: bool = False  # one RMSNorm ``fc_norm.<i>`` per aux state, before fc
    norm_output: bool = False  # feed back the normed output (what the lm_head sees), not the pre-norm one
    # MLA (architecture=deepseek only; head_dim is then qk_nope_head_dim + qk_rope_head_dim)
    q_lora_rank: Optional[int] = None  # None: q_proj straight from the 2H input, no q LoRA
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"draft architecture {self.architecture!r} is not one of {sorted(ARCHITECTURES)}")
        if self.architecture == "deepseek":
            if not (self.kv_lora_rank and self.qk_rope_head_dim and self.v_head_dim):
                raise ValueError("an MLA (deepseek) draft needs kv_lora_rank, qk_rope_head_dim and v_head_dim "
                                 "(a DeepSeek-V2/V3-style target's config has them)")
            if self.norm_before_fc:
                raise ValueError("norm_before_fc: vLLM 0.32's deepseek_eagle3.py has no input_norm (it reads "
                                 "fc_norm, norm_output and norm_before_residual only); not for a deepseek draft")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"draft num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if not self.aux_layer_ids:
            raise ValueError("the draft needs the aux layer ids the hidden states were extracted at")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} exceeds the target vocab {self.vocab_size}")

    @property
    def num_aux_hidden_states(self) -> int:
        return len(self.aux_layer_ids)

    def to_dict(self) -> dict:
        """Plain fields; the EAGLE-3.1 options only when set (a default draft's file is as before)."""
        d = asdict(self)
        for name in NORM_OPTIONS:
            if not d[name]:
                del d[name]
        if self.architecture != "deepseek":
            for name in MLA_FIELDS:
                del d[name]
        return d

    @property
    def norm_options(self) -> dict:
        """The EAGLE-3.1 options that are set, as vLLM's config keys."""
        return {name: True for name in NORM_OPTIONS if getattr(self, name)}

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3DraftConfig":
        return cls(**d)

    @classmethod
    def from_target(cls, target_config: dict, aux_layer_ids, draft_vocab_size: int,
                    overrides=None) -> "Eagle3DraftConfig":
        """The draft for a target's config.json (``text_config`` of multimodal configs), with
        ``overrides`` an :class:`eagle3.config.DraftModelConfig` (0 = take the target's value).
        architecture ``auto``: deepseek (MLA) for an MLA target, else llama; ``deepseek`` for a
        target without MLA is refused (vLLM's MLA draft takes its sizes from the target's MLA)."""
        tc = target_config.get("text_config", target_config)
        H = int(tc["hidden_size"])
        arch = resolve_architecture(getattr(overrides, "architecture", "llama"), target_config)
        if arch == "deepseek":
            return cls._mla_from_target(tc, aux_layer_ids, draft_vocab_size, overrides)
        heads = getattr(overrides, "num_attention_heads", 0) or int(tc["num_attention_heads"])
        kv = getattr(overrides, "num_key_value_heads", 0) or int(tc.get("num_key_value_heads") or heads)
        head_dim = getattr(overrides, "head_dim", 0) or int(tc.get("head_dim") or H // heads)
        inter = getattr(overrides, "intermediate_size", 0) or int(tc["intermediate_size"])
        theta, scaling = rope_parameters(tc)
        return cls(hidden_size=H, target_hidden_size=H, num_attention_heads=heads, num_key_value_heads=kv,
                   head_dim=head_dim, intermediate_size=inter,
                   rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)), vocab_size=int(tc["vocab_size"]),
                   draft_vocab_size=int(draft_vocab_size), aux_layer_ids=[int(i) for i in aux_layer_ids],
                   rope_theta=theta, rope_scaling=scaling,
                   max_position_embeddings=int(tc.get("max_position_embeddings", 8192)),
                   norm_before_residual=bool(getattr(overrides, "norm_before_residual", True)),
                   architecture=arch,
                   **{name: bool(getattr(overrides, name, False)) for name in NORM_OPTIONS})

    @classmethod
    def _mla_from_target(cls, tc: dict, aux_layer_ids, draft_vocab_size: int, overrides) -> "Eagle3DraftConfig":
        for name in ("num_key_value_heads", "head_dim"):
            if getattr(overrides, name, 0):
                raise ValueError(f"train.model.{name} does not apply to an MLA (deepseek) draft: its heads are "
                                 "sized by the target's qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
        H = int(tc["hidden_size"])
        heads = getattr(overrides, "num_attention_heads", 0) or int(tc["num_attention_heads"])
        inter = getattr(overrides, "intermediate_size", 0) or int(tc["intermediate_size"])
        theta, scaling = rope_parameters(tc)
        mla = {name: int(tc[name]) for name in MLA_FIELDS if name != "q_lora_rank"}
        q_lora = tc.get("q_lora_rank")
        return cls(hidden_size=H, target_hidden_size=H, num_attention_heads=heads, num_key_value_heads=heads,
                   head_dim=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"], intermediate_size=inter,
                   rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)), vocab_size=int(tc["vocab_size"]),
                   draft_vocab_size=int(draft_vocab_size), aux_layer_ids=[int(i) for i in aux_layer_ids],
                   rope_theta=theta, rope_scaling=scaling,
                   max_position_embeddings=int(tc.get("max_position_embeddings", 8192)),
                   norm_before_residual=bool(getattr(overrides, "norm_before_residual", True)),
                   architecture="deepseek", q_lora_rank=int(q_lora) if q_lora else None, **mla,
                   **{name: bool(getattr(overrides, name, False)) for name in NORM_OPTIONS})


def resolve_architecture(architecture: str, target_config: dict) -> str:
    """``train.model.architecture`` for this target: ``auto`` -> deepseek for an MLA target, else
    llama (the default's value); ``deepseek`` for a target without MLA -> ValueError with the reason."""
    mla = is_mla_config(target_config)
    if architecture == "auto":
        return "deepseek" if mla else "llama"
    if architecture == "deepseek" and not mla:
        raise ValueError("train.model.architecture=deepseek is an MLA draft (vLLM's Eagle3DeepseekV2ForCausalLM), "
                         "sized by the target's MLA (kv_lora_rank, qk_rope_head_dim, ...); this target has no MLA "
                         "(no kv_lora_rank in its config). Use llama, qwen3 or auto.")
    return architecture


def draft_config_dict(cfg: Eagle3DraftConfig, torch_dtype: str = "bfloat16") -> dict:
    """config.json for vLLM (``LlamaForCausalLMEagle3`` / ``Eagle3Qwen3ForCausalLM``).

    ``norm_before_residual`` and ``num_aux_hidden_states`` are written explicitly: vLLM's defaults
    differ between config styles, and the Llama draft sizes ``fc`` from ``num_aux_hidden_states``.
    The EAGLE-3.1 options are written top-level when set (vLLM's default for each is False).
    """
    if cfg.architecture == "deepseek":
        return _mla_config_dict(cfg, torch_dtype)
    d = {
        "architectures": [ARCHITECTURES[cfg.architecture]],
        "model_type": cfg.architecture,
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.target_hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "attention_bias": False,
        "mlp_bias": False,
    }
    return _with_eagle3_keys(d, cfg, torch_dtype)


def _with_eagle3_keys(d: dict, cfg: Eagle3DraftConfig, torch_dtype: str) -> dict:
    """The keys every EAGLE-3 draft config ends with (vocabularies, aux layers, dtype, 3.1 norms)."""
    d.update({
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "num_aux_hidden_states": cfg.num_aux_hidden_states,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
                         "use_aux_hidden_state": True},
        "torch_dtype": torch_dtype,
    })
    d.update(cfg.norm_options)
    return d


def _mla_config_dict(cfg: Eagle3DraftConfig, torch_dtype: str) -> dict:
    """config.json for vLLM's Eagle3DeepseekV2ForCausalLM (deepseek_eagle3.py): a DeepseekV2Config
    (model_type deepseek_v2) with one dense layer (``first_k_dense_replace`` covers it, no MoE keys),
    the MLA sizes and the target's RoPE, which vLLM's MLA attention reads from ``rope_parameters``.
    That class reads fc_norm, norm_output and norm_before_residual (default False there: written)."""
    rope = {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})}
    d = {
        "architectures": [ARCHITECTURES["deepseek"]],
        "model_type": MODEL_TYPES["deepseek"],
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.target_hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "num_hidden_layers": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "attention_bias": False,
    }
    return _with_eagle3_keys(d, cfg, torch_dtype)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Normalise in float32, scale in the input dtype (as vLLM's and HF's Llama RMSNorm);
    ``weight=None``: normalised only (the weight applied elsewhere)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(dtype) if weight is None else xf.to(dtype) * weight.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3DraftConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(2 * H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(2 * H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(2 * H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        if cfg.architecture == "qwen3":  # Qwen3 normalises q and k per head before RoPE
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def qkv(self, pe: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: dict):
        """q [B, Hq, T, D], k and v [B, Hkv, T, D], RoPE applied, from the token embeddings' part
        of the projection ``pe`` (:meth:`Eagle3MidLayer.project_embeds`) and the hidden input ``x``
        (vLLM's qkv_proj of concat(e, x), its columns split in two: w['qkv_e'] and w['qkv_h'], each
        packing q_proj, k_proj, v_proj row-wise)."""
        B, T, _ = x.shape
        D, nq, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = (pe + linear(x, w["qkv_h"])).split([nq * D, nkv * D, nkv * D], dim=-1)
        q, k, v = q.view(B, T, nq, D), k.view(B, T, nkv, D), v.view(B, T, nkv, D)
        if self.q_norm is not None:
            q, k = rms_norm(q, w["q_norm"], self.q_norm.eps), rms_norm(k, w["k_norm"], self.k_norm.eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class Eagle3MLAAttention(nn.Module):
    """vLLM's DeepseekV2MLAAttention with a 2H input (deepseek_eagle3.py, layer 0), computed in the
    non-absorbed form: full per-head q, k, v from the up-projections (q_b_proj, kv_b_proj), the rope
    part of k (``k_pe``) shared by all heads. Equal to vLLM's absorbed MLA kernels up to rounding."""

    def __init__(self, cfg: Eagle3DraftConfig):
        super().__init__()
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = self.num_kv_heads = nh
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.head_dim = self.nope + self.rope_dim
        self.eps = cfg.rms_norm_eps
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(2 * H, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * self.head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(2 * H, nh * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * H, cfg.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, H, bias=False)

    def input_projections(self) -> tuple:
        """The weights that read the 2H input, packed row-wise in this order."""
        q = self.q_a_proj.weight if self.q_lora_rank else self.q_proj.weight
        return q, self.kv_a_proj_with_mqa.weight

    def extra_weights(self) -> dict:
        w = {"kv_a_layernorm": self.kv_a_layernorm.weight, "kv_b": self.kv_b_proj.weight}
        if self.q_lora_rank:
            w.update(q_a_layernorm=self.q_a_layernorm.weight, q_b=self.q_b_proj.weight)
        return w

    def qkv(self, pe: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: dict):
        """q, k [B, nh, T, nope+rope] and v [B, nh, T, v_head_dim] (rope part rotated, interleaved),
        from the embeddings' part of the input projection ``pe`` and the hidden input ``x``."""
        B, T, _ = x.shape
        nh, nope, rd = self.num_heads, self.nope, self.rope_dim
        q_width = self.q_lora_rank or nh * self.head_dim
        q, kv_a = (pe + linear(x, w["qkv_h"])).split([q_width, self.kv_lora_rank + rd], -1)
        if self.q_lora_rank:
            q = F.linear(rms_norm(q, w["q_a_layernorm"], self.eps), w["q_b"])
        q = q.view(B, T, nh, nope + rd).transpose(1, 2)
        kv_c, k_pe = kv_a.split([self.kv_lora_rank, rd], -1)
        kv = F.linear(rms_norm(kv_c, w["kv_a_layernorm"], self.eps), w["kv_b"]).view(B, T, nh, nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([nope, self.v_dim], -1)
        q_nope, q_pe = q.split([nope, rd], -1)
        q = torch.cat([q_nope, apply_rope_interleaved(q_pe, cos, sin)], -1)
        k_pe = apply_rope_interleaved(k_pe[:, None], cos, sin).expand(B, nh, T, rd)
        return q, torch.cat([k_nope, k_pe], -1), v


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, w: dict):
        gate, up = linear(x, w["gate_up"]).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, w["down"])


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3DraftConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3MLAAttention(cfg) if cfg.architecture == "deepseek" else Eagle3Attention(cfg)
        self.mlp = Eagle3MLP(cfg)

    def weights(self, dtype: Optional[torch.dtype] = None, fp8: str = "off") -> dict:
        """The layer's weights for one forward: q/k/v and gate/up packed for one matmul each,
        cast to ``dtype`` once (differentiable: gradients flow back to the fp32 parameters).
        ``fp8`` (``train.fp8_matmul``, eagle3.kernels.fp8_matmul): the packed matmuls' weights also quantized
        once, for every step's float8 matmuls.

        q/k/v's columns come in two halves: those that multiply the token embeddings (with the
        input norm's weight folded in: qkv(norm(e) * w) == qkv * w applied to norm(e)) and those
        that multiply the hidden input. The embeddings are constants, so with the norm's weight
        folded into the matrix nothing needs the gradient of the normalised embeddings: the
        backward skips that matmul (2 x T x H x (Hq+2Hkv)*D per step) and gets the norm weight's
        gradient from the weight's instead (an elementwise product and a column sum)."""
        a, m = self.self_attn, self.mlp
        H = self.input_layernorm.weight.shape[0]
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
        mla = isinstance(a, Eagle3MLAAttention)
        proj = a.input_projections() if mla else (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
        w = {"hidden_norm": self.hidden_norm.weight,
             "post_attention_layernorm": self.post_attention_layernorm.weight,
             # folded in the parameters' dtype (float32), then cast once
             "qkv_e": torch.cat([p[:, :H] for p in proj]) * self.input_layernorm.weight,
             "qkv_h": torch.cat([cast(p[:, H:]) for p in proj]),
             "o": a.o_proj.weight,
             "gate_up": torch.cat([cast(m.gate_proj.weight), cast(m.up_proj.weight)]), "down": m.down_proj.weight}
        if mla:
            w.update(a.extra_weights())
        elif a.q_norm is not None:
            w["q_norm"], w["k_norm"] = a.q_norm.weight, a.k_norm.weight
        w = {k: cast(v) for k, v in w.items()}
        for k in ("qkv_e", "qkv_h", "o", "gate_up", "down"):
            w[k] = quantize_weight(w[k], fp8)
        return w

    def project_embeds(self, embeds: torch.Tensor, w: Optional[dict] = None) -> torch.Tensor:
        """The token embeddings' part of the attention's input projection, w['qkv_e'] applied to
        norm(embeds) [..., H] (input_layernorm's weight is folded into w['qkv_e']).

        It depends on the token alone, not on the step: the training-time test, whose step j reads
        the embedding of token t+j+1 at index t, projects the row's embeddings once and hands each
        step a shifted window (eagle3/train/ttt.py), where projecting every step's shifted copy
        would repeat the same rows' product S times, forward and in the weight's gradient."""
        w = w if w is not None else self.weights()
        return linear(rms_norm(embeds, None, self.hidden_norm.eps), w["qkv_e"])

    def pre_attention(self, hidden: torch.Tensor, embeds: torch.Tensor, cos, sin, w: Optional[dict] = None,
                      projected: bool = False):
        """(q, k, v, residual) for one step from its hidden input [B,T,H] and token embeddings
        [B,T,H] (with ``projected``: their :meth:`project_embeds`)."""
        w = w if w is not None else self.weights()
        eps = self.hidden_norm.eps
        pe = embeds if projected else self.project_embeds(embeds, w)
        if self.norm_before_residual:
            x = rms_norm(hidden, w["hidden_norm"], eps)
            residual = x
        else:
            residual = hidden
            x = rms_norm(hidden, w["hidden_norm"], eps)
        q, k, v = self.self_attn.qkv(pe, x, cos, sin, w)
        return q, k, v, residual

    def post_attention(self, attn: torch.Tensor, residual: torch.Tensor, w: Optional[dict] = None) -> torch.Tensor:
        """The pre-norm output [B,T,H] from the attention output [B,T,Hq*D]."""
        w = w if w is not None else self.weights()
        residual = linear(attn, w["o"]) + residual
        x = rms_norm(residual, w["post_attention_layernorm"], self.post_attention_layernorm.eps)
        return self.mlp(x, w) + residual


class Eagle3Draft(nn.Module):
    """Trainable draft parameters (vLLM names) plus the vocabulary maps ``d2t`` and ``t2d``.

    The target's embedding is not part of this module: it is frozen, lives with the target's
    final norm and lm_head in :class:`eagle3.train.target_head.TargetHead`, and is not exported.
    """

    def __init__(self, cfg: Eagle3DraftConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_aux_hidden_states * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        # EAGLE-3.1 (vLLM's names): registered only when set, so a default draft's state is as before
        self.input_norm = (RMSNorm(cfg.num_aux_hidden_states * cfg.target_hidden_size, cfg.rms_norm_eps)
                           if cfg.norm_before_fc else None)
        self.fc_norm = (nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
                                      for _ in range(cfg.num_aux_hidden_states)) if cfg.fc_norm else None)
        self.midlayer = Eagle3MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        if cfg.architecture == "deepseek":  # vLLM's MLA RoPE: interleaved, on the rope part only
            inv_freq, scale, softmax_factor = mla_rope(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
            self.attn_scale: Optional[float] = cfg.head_dim ** -0.5 * softmax_factor
        else:
            inv_freq, scale = inv_freq_and_scale(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.hidden_size,
                                                 cfg.num_attention_heads, cfg.max_position_embeddings)
            self.attn_scale = None  # head_dim ** -0.5, SDPA's default
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_scale = scale
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab mapping shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not fit "
                             f"the draft (draft vocab {self.d2t.numel()}, target vocab {self.t2d.numel()})")
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    @property
    def kept_token_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, in draft order (id = draft id + d2t[draft id])."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        if self.config.architecture == "deepseek":
            return rope_cos_sin_interleaved(position_ids, self.inv_freq, self.rope_scale, dtype)
        return rope_cos_sin(position_ids, self.inv_freq, self.rope_scale, dtype)

    def fc_input(self, aux: torch.Tensor) -> torch.Tensor:
        """The concatenated aux states [..., n_aux*H] as fc sees them: ``input_norm`` over the whole
        (norm_before_fc), then ``fc_norm[i]`` over each state (fc_norm), as vLLM's
        ``combine_hidden_states``; unchanged when neither is set."""
        eps = self.config.rms_norm_eps
        if self.input_norm is not None:
            aux = rms_norm(aux, self.input_norm.weight, eps)
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([rms_norm(c, n.weight, eps) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return aux

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """fc over the concatenated aux states: [B, T, n_aux*H] (or [B, T, n_aux, H]) -> [B, T, H]."""
        if aux_hidden_states.dim() == 4:
            aux_hidden_states = aux_hidden_states.flatten(-2)
        return self.fc(self.fc_input(aux_hidden_states))

    def feedback(self, out: torch.Tensor, norm_weight=None) -> torch.Tensor:
        """The state the next chain step receives from a step's pre-norm output ``out``: ``out``
        itself, or with norm_output its normed form (vLLM's ``aux_output``)."""
        if not self.config.norm_output:
            return out
        return self.head_input(out, norm_weight)

    def head_input(self, out: torch.Tensor, norm_weight=None) -> torch.Tensor:
        """What the draft head (lm_head) multiplies: the final norm of a step's pre-norm output."""
        return rms_norm(out, self.norm.weight if norm_weight is None else norm_weight, self.norm.eps)

    def logits(self, out: torch.Tensor, norm_weight=None, lm_head_weight=None) -> torch.Tensor:
        lm_head_weight = self.lm_head.weight if lm_head_weight is None else lm_head_weight
        return F.linear(self.head_input(out, norm_weight), lm_head_weight)

    def forward(self, aux_hidden_states: torch.Tensor, input_embeds: torch.Tensor,
                position_ids: torch.Tensor):
        """One plain causal pass (TTT step 0, as vLLM's first draft pass): (logits, pre-norm out);
        the state fed back to the next step is ``feedback(out)``.

        ``input_embeds[t]`` is the embedding of token t+1; positions are those of the aux states.
        """
        dtype = input_embeds.dtype
        h = self.fuse(aux_hidden_states).to(dtype)
        cos, sin = self.rope(position_ids, dtype)
        q, k, v, residual = self.midlayer.pre_attention(h, input_embeds, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.attn_scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
        out = self.midlayer.post_attention(attn.transpose(1, 2).flatten(2), residual)
        return self.logits(out), out

    def export_state_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict:
        """Tensors under vLLM's names (``t2d`` kept: vLLM ignores it, other tools read it)."""
        out = {}
        for name, t in self.state_dict().items():
            t = t.detach().cpu()
            out[name] = t.to(dtype) if t.is_floating_point() else t
        return out


def count_matmul_params(cfg: Eagle3DraftConfig) -> dict:
    """Weights multiplied per token, for FLOP estimates (fc once; layer and head per TTT step)."""
    H, D = cfg.hidden_size, cfg.head_dim
    attn = 2 * H * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D + cfg.num_attention_heads * D * H
    if cfg.architecture == "deepseek":
        nh, kl, q = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.q_lora_rank
        q_params = 2 * H * q + q * nh * D if q else 2 * H * nh * D
        attn = q_params + 2 * H * (kl + cfg.qk_rope_head_dim) + kl * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) \
            + nh * cfg.v_head_dim * H
    mlp = 3 * H * cfg.intermediate_size
    return {"fc": cfg.num_aux_hidden_states * cfg.target_hidden_size * H, "layer": attn + mlp,
            "lm_head": H * cfg.draft_vocab_size}
