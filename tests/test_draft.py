"""The draft model: vLLM's names and arithmetic, its config, and reading target tensors alone."""
from __future__ import annotations

import json

import pytest
import torch

from eagle3.config import DraftModelConfig
from eagle3.model.draft import Eagle3Draft, Eagle3DraftConfig, draft_config_dict

VLLM_LLAMA_NAMES = {  # what vLLM's LlamaForCausalLMEagle3.load_weights accepts (../shared/reference/vllm.md)
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d"}

LLAMA31_TARGET = {  # a Llama-3.1-8B config.json, shrunk in width but with its real rope scaling
    "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 8, "rms_norm_eps": 1e-5, "vocab_size": 300,
    "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def _cfg(**kw) -> Eagle3DraftConfig:
    over = DraftModelConfig(**kw)
    return Eagle3DraftConfig.from_target(LLAMA31_TARGET, [1, 4, 5], 100, over)


def test_parameter_names_and_shapes_are_vllms():
    cfg = _cfg()
    sd = Eagle3Draft(cfg).state_dict()
    assert set(sd) == VLLM_LLAMA_NAMES
    H = 128
    assert sd["fc.weight"].shape == (H, 3 * H)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (4 * 32, 2 * H)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (2 * 32, 2 * H)
    assert sd["lm_head.weight"].shape == (100, H)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and sd["t2d"].numel() == 300
    # trainable = everything but the vocabulary maps; no embedding inside the draft
    trainable = {n for n, p in Eagle3Draft(cfg).named_parameters() if p.requires_grad}
    assert trainable == VLLM_LLAMA_NAMES - {"d2t", "t2d"}
    qwen = Eagle3Draft(_cfg(architecture="qwen3")).state_dict()
    assert set(qwen) - set(sd) == {"midlayer.self_attn.q_norm.weight", "midlayer.self_attn.k_norm.weight"}


def test_config_from_target_and_vllm_config_json():
    cfg = _cfg(num_attention_heads=8, norm_before_residual=False)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (128, 8, 2, 32)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    d = draft_config_dict(cfg)
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["num_hidden_layers"] == 1
    assert d["norm_before_residual"] is False and d["num_aux_hidden_states"] == 3
    assert d["draft_vocab_size"] == 100 and d["vocab_size"] == 300 and d["target_hidden_size"] == 128
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 5]
    assert Eagle3DraftConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert draft_config_dict(_cfg(architecture="qwen3"))["architectures"] == ["Eagle3Qwen3ForCausalLM"]
    # a transformers-5 style config (rope_parameters) reads the same
    new_style = {k: v for k, v in LLAMA31_TARGET.items() if k not in ("rope_theta", "rope_scaling")}
    new_style["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA31_TARGET["rope_scaling"]}
    assert Eagle3DraftConfig.from_target(new_style, [1, 4, 5], 100).rope_scaling == cfg.rope_scaling


def _vllm_reference(draft: Eagle3Draft, aux, embeds, positions, differentiable: bool = False, fed_back: bool = False):
    """vLLM's llama_eagle3 forward written out (float64), RoPE from transformers' own Llama code.
    ``differentiable``: on the draft's own (float64) parameters, for comparing gradients.
    ``fed_back``: also the state vLLM feeds to the next chain step (its ``aux_output``)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    c = draft.config
    if differentiable:
        W = dict(draft.named_parameters())
    else:
        W = {k: v.double() for k, v in draft.state_dict().items() if v.is_floating_point()}

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))

    hf = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                     max_position_embeddings=c.max_position_embeddings,
                     rope_parameters={"rope_theta": c.rope_theta, **(c.rope_scaling or {"rope_type": "default"})})
    cos, sin = LlamaRotaryEmbedding(hf)(aux.double(), positions)
    a = aux.double()  # vLLM's combine_hidden_states: input_norm over the whole, then fc_norm per state
    if c.norm_before_fc:
        a = rms(a, W["input_norm.weight"])
    if c.fc_norm:
        a = torch.cat([rms(x, W[f"fc_norm.{i}.weight"]) for i, x in enumerate(a.chunk(c.num_aux_hidden_states, -1))], -1)
    h = a @ W["fc.weight"].T
    e = rms(embeds.double(), W["midlayer.input_layernorm.weight"])
    if c.norm_before_residual:
        x = rms(h, W["midlayer.hidden_norm.weight"])
        residual = x
    else:
        residual, x = h, rms(h, W["midlayer.hidden_norm.weight"])
    x = torch.cat([e, x], -1)
    B, T, _ = x.shape
    D, nq, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    q = (x @ W["midlayer.self_attn.q_proj.weight"].T).view(B, T, nq, D)
    k = (x @ W["midlayer.self_attn.k_proj.weight"].T).view(B, T, nkv, D)
    if c.architecture == "qwen3":  # vLLM's Qwen3Attention: RMSNorm per head on q and k, before RoPE
        q, k = rms(q, W["midlayer.self_attn.q_norm.weight"]), rms(k, W["midlayer.self_attn.k_norm.weight"])
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = (x @ W["midlayer.self_attn.v_proj.weight"].T).view(B, T, nkv, D).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
    s = (q @ k.transpose(-1, -2)) / D ** 0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    a = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, nq * D)
    residual = a @ W["midlayer.self_attn.o_proj.weight"].T + residual
    x = rms(residual, W["midlayer.post_attention_layernorm.weight"])
    gate, up = x @ W["midlayer.mlp.gate_proj.weight"].T, x @ W["midlayer.mlp.up_proj.weight"].T
    out = torch.nn.functional.silu(gate) * up @ W["midlayer.mlp.down_proj.weight"].T + residual
    normed = rms(out, W["norm.weight"])  # vLLM's LlamaModel.forward: (hidden_states, aux_output)
    if fed_back:
        return normed @ W["lm_head.weight"].T, out, (normed if c.norm_output else out)
    return normed @ W["lm_head.weight"].T, out


@pytest.mark.parametrize("norm_before_residual,architecture", [(True, "llama"), (False, "llama"), (True, "qwen3")])
def test_forward_matches_vllm_arithmetic(norm_before_residual, architecture):
    torch.manual_seed(0)
    draft = Eagle3Draft(_cfg(norm_before_residual=norm_before_residual, architecture=architecture))
    with torch.no_grad():  # non-trivial norms so that a swapped norm would show
        for n, p in draft.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    aux, emb = torch.randn(2, 24, 3 * 128), torch.randn(2, 24, 128)
    pos = torch.arange(100, 124).expand(2, 24)  # large positions: llama3 scaling matters
    logits, out = draft(aux, emb, pos)
    ref_logits, ref_out = _vllm_reference(draft, aux, emb, pos)
    assert torch.allclose(out.double(), ref_out, atol=1e-4, rtol=1e-4)
    assert torch.allclose(logits.double(), ref_logits, atol=1e-4, rtol=1e-4)
    # the other setting computes something else (the test can fail)
    other = Eagle3Draft(_cfg(norm_before_residual=not norm_before_residual, architecture=architecture))
    other.load_state_dict(draft.state_dict())
    assert not torch.allclose(other(aux, emb, pos)[1], out, atol=1e-3)


@pytest.mark.parametrize("norm_before_residual,architecture", [(True, "llama"), (False, "qwen3")])
def test_gradients_match_vllm_arithmetic(norm_before_residual, architecture):
    """The forward computes q/k/v as two matmuls with input_layernorm's weight folded into the
    embedding half (so the backward needs no gradient of the normalised embeddings): every
    parameter's gradient equals that of vLLM's concat form, in float64."""
    torch.manual_seed(0)
    draft = Eagle3Draft(_cfg(norm_before_residual=norm_before_residual, architecture=architecture)).double()
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    aux, emb = torch.randn(2, 24, 3 * 128, dtype=torch.float64), torch.randn(2, 24, 128, dtype=torch.float64)
    pos = torch.arange(24).expand(2, 24)
    r = torch.randn(2, 24, draft.config.draft_vocab_size, dtype=torch.float64)

    def grads(logits):
        draft.zero_grad()
        (logits * r).sum().backward()
        return {n: p.grad.clone() for n, p in draft.named_parameters()}
    mine = grads(draft(aux, emb, pos)[0])
    ref = grads(_vllm_reference(draft, aux, emb, pos, differentiable=True)[0])
    assert mine.keys() == ref.keys() and ref["midlayer.input_layernorm.weight"].abs().sum() > 0
    for n in ref:
        # 1e-6, not 1e-12: the reference's RoPE comes from transformers in float32 (~1e-7 relative)
        err = float((mine[n] - ref[n]).norm() / ref[n].norm())
        assert err < 1e-6, (n, err)


# EAGLE-3.1: every combination vLLM 0.32's llama_eagle3.py / qwen3_eagle3.py accept (all of them: the
# four flags are independent there), for both draft classes
COMBOS = [dict(zip(("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), bits))
          for bits in __import__("itertools").product((False, True), repeat=4)]


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_eagle31_options_match_vllm_arithmetic(architecture):
    """Each combination of norm_before_residual, norm_before_fc, fc_norm and norm_output: logits,
    pre-norm output and the fed-back state equal vLLM's computation in float64, and the gradients
    of every parameter (the norms' own included) equal those of the written-out reference."""
    torch.manual_seed(0)
    aux, emb = torch.randn(2, 12, 3 * 128, dtype=torch.float64), torch.randn(2, 12, 128, dtype=torch.float64)
    aux = aux * torch.tensor([0.5, 3.0, 20.0], dtype=torch.float64).repeat_interleave(128)  # unequal state scales
    pos = torch.arange(100, 112).expand(2, 12)
    r = torch.randn(2, 12, 100, dtype=torch.float64)
    seen = set()
    for combo in COMBOS:
        draft = Eagle3Draft(_cfg(architecture=architecture, **combo)).double()
        names = set(draft.state_dict())
        assert ("input_norm.weight" in names) == combo["norm_before_fc"]
        assert {f"fc_norm.{i}.weight" for i in range(3)} <= names if combo["fc_norm"] else not any(
            n.startswith("fc_norm.") for n in names)
        with torch.no_grad():
            for n, p in draft.named_parameters():
                if "norm" in n:
                    p.copy_(1 + 0.3 * torch.randn_like(p))
        logits, out = draft(aux, emb, pos)
        ref_logits, ref_out, ref_fed = _vllm_reference(draft, aux, emb, pos, differentiable=True, fed_back=True)
        err = max(float((logits - ref_logits).detach().abs().max() / ref_logits.detach().abs().max()),
                  float((out - ref_out).detach().abs().max() / ref_out.detach().abs().max()),
                  float((draft.feedback(out) - ref_fed).detach().abs().max() / ref_fed.detach().abs().max()))
        assert err < 1e-6, (combo, err)  # transformers' RoPE is float32 (~1e-7 relative)
        draft.zero_grad()
        (logits * r).sum().backward()
        mine = {n: p.grad.clone() for n, p in draft.named_parameters()}
        draft.zero_grad()
        (ref_logits * r).sum().backward()
        for n, p in draft.named_parameters():
            assert float((mine[n] - p.grad).norm() / p.grad.norm()) < 1e-6, (combo, n)
        seen.add((round(float(logits.sum()), 6), round(float(draft.feedback(out).sum()), 6)))
    assert len(seen) == len(COMBOS)  # every option changes what is computed (the test can fail)


def test_eagle31_options_in_configs_and_absent_at_their_defaults():
    from eagle3.model.draft import NORM_OPTIONS

    plain = _cfg()
    d = draft_config_dict(plain)
    assert not set(NORM_OPTIONS) & set(d) and not set(NORM_OPTIONS) & set(plain.to_dict())
    on = _cfg(norm_before_fc=True, fc_norm=True, norm_output=True)
    d = draft_config_dict(on)
    assert all(d[k] is True for k in NORM_OPTIONS)
    assert Eagle3DraftConfig.from_dict(json.loads(json.dumps(on.to_dict()))) == on
    assert Eagle3DraftConfig.from_dict(json.loads(json.dumps(plain.to_dict()))) == plain
    sd = Eagle3Draft(on).state_dict()
    assert sd["input_norm.weight"].shape == (3 * 128,) and sd["fc_norm.2.weight"].shape == (128,)


def test_export_state_dict_dtypes():
    sd = Eagle3Draft(_cfg()).export_state_dict(torch.bfloat16)
    assert sd["fc.weight"].dtype == torch.bfloat16 and sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool


# -- reading target tensors without the model ------------------------------------------------------

def _write_sharded(path, tensors_per_shard: list, config: dict):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    n = len(tensors_per_shard)
    for k, tensors in enumerate(tensors_per_shard):
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(path / name))
        weight_map.update({t: name for t in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def opened_files(monkeypatch):
    import safetensors

    opened = []
    real = safetensors.safe_open

    def spy(path, *a, **kw):
        opened.append(str(path).rsplit("/", 1)[-1])
        return real(path, *a, **kw)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    return opened


def test_reads_only_the_needed_shards(tmp_path, opened_files):
    from eagle3.target_weights import read_target_head

    V, H = 50, 8
    g = torch.Generator().manual_seed(0)
    shards = [{"model.embed_tokens.weight": torch.randn(V, H, generator=g)}]
    for i in range(6):  # the body: decoder layers, stored quantized (int) as a served INT4 model would
        shards.append({f"model.layers.{i}.mlp.down_proj.weight_packed": torch.randint(0, 9, (H, H), dtype=torch.int32),
                       f"model.layers.{i}.input_layernorm.weight": torch.ones(H)})
    shards.append({"model.norm.weight": torch.rand(H, generator=g), "lm_head.weight": torch.randn(V, H, generator=g)})
    ckpt = _write_sharded(tmp_path / "ckpt", shards, {"hidden_size": H, "vocab_size": V})
    out = read_target_head(ckpt)
    assert sorted(set(opened_files)) == ["model-00001-of-00008.safetensors", "model-00008-of-00008.safetensors"]
    assert torch.equal(out["embed"], shards[0]["model.embed_tokens.weight"])
    assert torch.equal(out["lm_head"], shards[-1]["lm_head.weight"])
    assert out["names"] == {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def test_family_names_tied_and_errors(tmp_path):
    from eagle3.target_weights import TargetWeightsError, read_target_head

    V, H = 20, 4
    emb, norm = torch.randn(V, H), torch.rand(H)
    # multimodal wrapper (language_model.*), tied embeddings, and DeepSeek-style MTP layer tensors
    ckpt = _write_sharded(tmp_path / "mm", [
        {"language_model.model.embed_tokens.weight": emb, "vision_tower.embed_tokens.weight": torch.randn(3, H)},
        {"language_model.model.norm.weight": norm, "model.layers.61.embed_tokens.weight": torch.randn(V, H),
         "model.layers.61.shared_head.norm.weight": torch.rand(H)}],
        {"text_config": {"hidden_size": H, "vocab_size": V, "tie_word_embeddings": True}})
    out = read_target_head(ckpt)
    assert torch.equal(out["lm_head"], emb) and torch.equal(out["norm"], norm)
    assert out["names"]["lm_head"] == "language_model.model.embed_tokens.weight"
    # untied and no lm_head: a clear error, not the embedding
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["tie_word_embeddings"] = False
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TargetWeightsError, match="no lm_head"):
        read_target_head(ckpt)
    # a quantized lm_head is refused with the reason
    q = _write_sharded(tmp_path / "q", [{"model.embed_tokens.weight": emb, "model.norm.weight": norm,
                                         "lm_head.weight": torch.zeros(V, H, dtype=torch.int8)}], {})
    with pytest.raises(TargetWeightsError, match="not floating point"):
        read_target_head(q)


def test_single_file_checkpoint(tiny_llama_dir):
    from safetensors import safe_open

    from eagle3.target_weights import read_target_head

    out = read_target_head(tiny_llama_dir)
    with safe_open(str(tiny_llama_dir / "model.safetensors"), framework="pt") as f:
        assert torch.equal(out["norm"], f.get_tensor("model.norm.weight"))
        assert torch.equal(out["lm_head"], f.get_tensor("lm_head.weight"))


# ----------------------------------------------------------------------------------------------
# the MLA draft (architecture=deepseek): vLLM 0.32's deepseek_eagle3.py
# ----------------------------------------------------------------------------------------------
MLA_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=1024,
                beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)


def _mla_target(q_lora_rank=32, rope=MLA_YARN) -> dict:
    """A DeepSeek-V3-style config (the tiny test target's shape, smaller kv_lora_rank)."""
    return dict(model_type="deepseek_v3", hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                intermediate_size=96, vocab_size=120, kv_lora_rank=48, q_lora_rank=q_lora_rank, qk_rope_head_dim=16,
                qk_nope_head_dim=32, v_head_dim=24, rms_norm_eps=1e-6, max_position_embeddings=4096,
                rope_parameters=dict(rope))


def _mla_cfg(q_lora_rank=32, rope=MLA_YARN, **options):
    return Eagle3DraftConfig.from_target(_mla_target(q_lora_rank, rope), [1, 2, 3], 100,
                                         DraftModelConfig(architecture="deepseek", **options))


def _vllm_mla_reference(draft: Eagle3Draft, aux, embeds, positions):
    """vLLM 0.32's Eagle3DeepseekV2ForCausalLM forward written out in float64 from its source
    (deepseek_eagle3.py: combine_hidden_states, DeepseekV2Eagle3DecoderLayer, DeepseekV2Eagle3Model;
    deepseek_v2.py: DeepseekV2MLAAttention's projections, rope-type rewrite and softmax scale; the
    MLA attention in its non-absorbed (prefill) form, k = [k_nope, k_pe] with k_pe shared by the heads).
    The RoPE is vLLM's own DeepseekScalingRotaryEmbedding / RotaryEmbedding module (built by get_rope
    from the draft's written config.json, its float32 cos/sin cache applied in float64). The whole MLA
    module is not run: it needs an attention backend and a forward context.
    Returns (logits, pre-norm out, the state fed back to the next chain step)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import yarn_get_mscale

    c = draft.config
    hf = draft_config_dict(c)  # what vLLM reads
    W = dict(draft.named_parameters())
    eps = hf["rms_norm_eps"]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    a = aux.double()
    if hf.get("fc_norm", False):
        a = torch.cat([rms(x, W[f"fc_norm.{i}.weight"]) for i, x in enumerate(a.chunk(hf["num_aux_hidden_states"], -1))],
                      -1)
    h = a @ W["fc.weight"].T
    e = rms(embeds.double(), W["midlayer.input_layernorm.weight"])
    if hf.get("norm_before_residual", False):
        x = rms(h, W["midlayer.hidden_norm.weight"])
        residual = x
    else:
        residual, x = h, rms(h, W["midlayer.hidden_norm.weight"])
    x = torch.cat([e, x], -1)
    B, T, _ = x.shape
    nh, nope, rd, vd = hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    kl, ql = hf["kv_lora_rank"], hf["q_lora_rank"]
    p = "midlayer.self_attn."
    if ql is not None:
        q = rms(x @ W[p + "q_a_proj.weight"].T, W[p + "q_a_layernorm.weight"]) @ W[p + "q_b_proj.weight"].T
    else:
        q = x @ W[p + "q_proj.weight"].T
    kv_c, k_pe = (x @ W[p + "kv_a_proj_with_mqa.weight"].T).split([kl, rd], -1)
    kv_c = rms(kv_c, W[p + "kv_a_layernorm.weight"])
    q = q.reshape(B * T, nh, nope + rd)
    k_pe = k_pe.reshape(B * T, 1, rd)
    rope = dict(hf["rope_parameters"])
    scaling = (nope + rd) ** -0.5
    if rope["rope_type"] != "default":  # DeepseekV2MLAAttention.__init__
        rope["rope_type"] = "deepseek_llama_scaling" if rope.get("attention_factor") == 1.0 else "deepseek_yarn"
    with set_current_vllm_config(VllmConfig()):
        rotary = get_rope(rd, max_position=hf["max_position_embeddings"], rope_parameters=rope, is_neox_style=False,
                          dtype=torch.float32)
    if rope["rope_type"] == "deepseek_yarn":
        mscale = yarn_get_mscale(rope["factor"], float(rope.get("mscale_all_dim", False)))
        scaling = scaling * mscale * mscale
    q_pe, k_pe = rotary.forward_static(positions.reshape(-1), q[..., nope:].clone(), k_pe, rotary.head_size,
                                       rotary.rotary_dim, rotary.cos_sin_cache.double(), rotary.is_neox_style)
    q = torch.cat([q[..., :nope], q_pe], -1).view(B, T, nh, nope + rd).transpose(1, 2)
    kv = (kv_c @ W[p + "kv_b_proj.weight"].T).view(B, T, nh, nope + vd).transpose(1, 2)
    k = torch.cat([kv[..., :nope], k_pe.view(B, 1, T, rd).expand(B, nh, T, rd)], -1)
    v = kv[..., nope:]
    s = (q @ k.transpose(-1, -2)) * scaling
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, nh * vd)
    residual = attn @ W[p + "o_proj.weight"].T + residual
    y = rms(residual, W["midlayer.post_attention_layernorm.weight"])
    gate, up = y @ W["midlayer.mlp.gate_proj.weight"].T, y @ W["midlayer.mlp.up_proj.weight"].T
    out = torch.nn.functional.silu(gate) * up @ W["midlayer.mlp.down_proj.weight"].T + residual
    normed = rms(out, W["norm.weight"])
    return normed @ W["lm_head.weight"].T, out, (normed if hf.get("norm_output", False) else out)


MLA_COMBOS = [dict(zip(("norm_before_residual", "fc_norm", "norm_output"), bits))
              for bits in __import__("itertools").product((False, True), repeat=3)]


@pytest.mark.parametrize("q_lora_rank,rope", [(32, MLA_YARN), (None, MLA_YARN), (32, {"rope_type": "default",
                                                                                          "rope_theta": 10000.0})])
def test_mla_draft_matches_vllm_arithmetic(q_lora_rank, rope):
    """Every combination of the options vLLM's deepseek_eagle3.py reads (norm_before_residual, fc_norm,
    norm_output), with and without q LoRA, YaRN and plain RoPE: logits, pre-norm output, fed-back state
    and every parameter's gradient equal vLLM's computation in float64."""
    torch.manual_seed(0)
    aux, emb = torch.randn(2, 12, 3 * 64, dtype=torch.float64), torch.randn(2, 12, 64, dtype=torch.float64)
    aux = aux * torch.tensor([0.5, 3.0, 20.0], dtype=torch.float64).repeat_interleave(64)
    pos = torch.arange(1500, 1512).expand(2, 12)  # past original_max_position_embeddings: YaRN matters
    r = torch.randn(2, 12, 100, dtype=torch.float64)
    seen = set()
    for combo in MLA_COMBOS:
        draft = Eagle3Draft(_mla_cfg(q_lora_rank, rope, **combo)).double()
        with torch.no_grad():
            for n, prm in draft.named_parameters():
                if "norm" in n:
                    prm.copy_(1 + 0.3 * torch.randn_like(prm))
                else:  # larger weights than the init: attention far from uniform
                    prm.mul_(3)
        logits, out = draft(aux, emb, pos)
        ref_logits, ref_out, ref_fed = _vllm_mla_reference(draft, aux, emb, pos)
        err = max(float((logits - ref_logits).detach().abs().max() / ref_logits.detach().abs().max()),
                  float((out - ref_out).detach().abs().max() / ref_out.detach().abs().max()),
                  float((draft.feedback(out) - ref_fed).detach().abs().max() / ref_fed.detach().abs().max()))
        # not 1e-12: the draft's rms_norm normalises in float32 (as vLLM's RMSNorm), ~1e-7 relative;
        # the cos/sin are bit-equal to vLLM's float32 cache
        assert err < 1e-6, (combo, err)
        draft.zero_grad()
        (logits * r).sum().backward()
        mine = {n: prm.grad.clone() for n, prm in draft.named_parameters()}
        draft.zero_grad()
        (ref_logits * r).sum().backward()
        for n, prm in draft.named_parameters():
            # the backward of rms_norm's float32 cast is float32 too, through up to four norms in a row on
            # the MLA paths (input/hidden norm, q_a/kv_a_layernorm): measured up to ~5e-6 relative
            err = float((mine[n] - prm.grad).norm() / prm.grad.norm())
            assert err < 2e-5, (combo, n, err)
        seen.add((round(float(logits.sum()), 6), round(float(draft.feedback(out).sum()), 6)))
    assert len(seen) == len(MLA_COMBOS)  # every option changes what is computed (the test can fail)


def test_mla_draft_config_names_and_refusals():
    from eagle3.model.draft import resolve_architecture

    cfg = _mla_cfg()
    assert (cfg.architecture, cfg.head_dim, cfg.q_lora_rank, cfg.kv_lora_rank) == ("deepseek", 48, 32, 48)
    d = Eagle3Draft(cfg)
    names = {n: tuple(t.shape) for n, t in d.state_dict().items()}
    a = "midlayer.self_attn."
    assert names[a + "q_a_proj.weight"] == (32, 128) and names[a + "kv_a_proj_with_mqa.weight"] == (48 + 16, 128)
    assert names[a + "q_b_proj.weight"] == (2 * 48, 32) and names[a + "kv_b_proj.weight"] == (2 * (32 + 24), 48)
    assert names[a + "o_proj.weight"] == (64, 2 * 24) and a + "q_proj.weight" not in names
    assert a + "q_proj.weight" in Eagle3Draft(_mla_cfg(q_lora_rank=None)).state_dict()
    hf = draft_config_dict(cfg)
    assert hf["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and hf["model_type"] == "deepseek_v2"
    assert hf["rope_parameters"]["rope_type"] == "yarn" and hf["first_k_dense_replace"] == 1
    assert Eagle3DraftConfig.from_dict(cfg.to_dict()) == cfg
    from eagle3.model.draft import count_matmul_params

    for c in (cfg, _mla_cfg(q_lora_rank=None)):  # FLOP estimates count every matrix of the layer once
        layer = Eagle3Draft(c).midlayer
        assert count_matmul_params(c)["layer"] == sum(p.numel() for n, p in layer.named_parameters() if "norm" not in n)
    # auto: deepseek for an MLA target, llama (today's default) otherwise; a llama draft's dict has no MLA keys
    assert resolve_architecture("auto", _mla_target()) == "deepseek"
    assert resolve_architecture("auto", {"text_config": _mla_target()}) == "deepseek"
    assert resolve_architecture("auto", LLAMA31_TARGET) == "llama"
    llama = Eagle3DraftConfig.from_target(LLAMA31_TARGET, [1, 4, 5], 100, DraftModelConfig(architecture="auto"))
    assert llama.architecture == "llama" and not set(llama.to_dict()) & {"kv_lora_rank", "q_lora_rank"}
    with pytest.raises(ValueError, match="this target has no MLA"):
        Eagle3DraftConfig.from_target(LLAMA31_TARGET, [1, 4, 5], 100, DraftModelConfig(architecture="deepseek"))
    with pytest.raises(ValueError, match="no input_norm"):
        DraftModelConfig(architecture="deepseek", norm_before_fc=True)
    with pytest.raises(ValueError, match="does not apply to an MLA"):
        Eagle3DraftConfig.from_target(_mla_target(), [1, 2, 3], 100, DraftModelConfig(architecture="deepseek",
                                                                                       head_dim=16))
    with pytest.raises(ValueError, match="deepseek_yarn"):
        Eagle3Draft(_mla_cfg(rope=dict(MLA_YARN, attention_factor=1.0)))


def test_mla_draft_in_the_ttt_step():
    """TTT step 0 of the MLA draft is its plain forward; the sdpa backend's attention over the
    diagonals equals the key-by-key reference with v_head_dim != q/k head dim and the MLA scale."""
    from eagle3.train.attention import TTTMask, merge_diagonals, naive_ttt_attention, ttt_attention
    from eagle3.train.ttt import TTTModel

    torch.manual_seed(0)
    draft = Eagle3Draft(_mla_cfg()).double()
    B, T, S = 2, 10, 3
    aux, emb = torch.randn(B, T, 192, dtype=torch.float64), torch.randn(B, T, 64, dtype=torch.float64)
    pos = torch.arange(T).expand(B, T)
    doc = torch.tensor([[0] * 6 + [1] * 4, [0] * 10])
    q = torch.randn(B, 2, T, 48, dtype=torch.float64)
    ks = [torch.randn(B, 2, T, 48, dtype=torch.float64) for _ in range(S)]
    vs = [torch.randn(B, 2, T, 24, dtype=torch.float64) for _ in range(S)]
    mask = TTTMask(doc, S, "sdpa")
    got = ttt_attention(q, ks, vs, mask.dense(S - 1), scale=draft.attn_scale)
    ref = naive_ttt_attention(q, ks, vs, doc, scale=draft.attn_scale)
    assert torch.allclose(got, ref.flatten(2) if ref.dim() == 4 else ref, atol=1e-10)
    # the flex path's merge of the diagonals with a narrower value width
    out0 = ttt_attention(q, ks[:1], vs[:1], mask.dense(0), scale=0.3).view(B, T, 2, 24).transpose(1, 2)
    s0 = (q @ ks[0].transpose(-1, -2)) * 0.3
    s0 = s0.masked_fill(~mask.dense(0)[..., :T], float("-inf"))
    merged = merge_diagonals(q, out0, s0.logsumexp(-1), ks[1:], vs[1:], 0.3)
    assert torch.allclose(merged.transpose(1, 2).flatten(2), ttt_attention(q, ks, vs, mask.dense(S - 1), scale=0.3),
                          atol=1e-6)
    m = TTTModel(draft, num_steps=S)
    probs = torch.softmax(torch.randn(B, T, 100, dtype=torch.float64), -1)
    loss, stats = m(aux, emb, probs, torch.ones(B, T, dtype=torch.bool), torch.ones(B, T), pos, doc)
    loss.backward()
    assert torch.isfinite(loss) and draft.midlayer.self_attn.kv_b_proj.weight.grad.abs().sum() > 0


def test_mla_draft_ttt_loss_equal_under_every_attention_backend():
    """flex and flex_stacked (forward only on CPU: torch's flex has no CPU backward) give sdpa's TTT
    loss for the MLA draft, whose values are narrower than its queries and keys."""
    from eagle3.train.ttt import TTTModel

    torch.manual_seed(0)
    d = Eagle3Draft(_mla_cfg())
    B, T = 1, 128
    args = (torch.randn(B, T, 192), torch.randn(B, T, 64), torch.softmax(torch.randn(B, T, 100), -1),
            torch.ones(B, T, dtype=torch.bool), torch.ones(B, T), torch.arange(T)[None],
            torch.tensor([[0] * 50 + [1] * 78]))
    with torch.no_grad():
        loss = {b: TTTModel(d, num_steps=3, attention=b)(*args)[0] for b in ("sdpa", "flex", "flex_stacked")}
    assert torch.allclose(loss["flex"], loss["sdpa"], rtol=1e-5) and torch.allclose(loss["flex_stacked"], loss["sdpa"],
                                                                                     rtol=1e-5)
