"""Response regeneration by the target (prepare.regenerate): both backends, on a tiny random Llama."""
from __future__ import annotations

import pytest

from eagle3.config import RegenerateConfig

CONVERSATIONS = [
    # ends on a user turn: one new final answer
    [{"role": "user", "content": "Write a haiku about rivers."}],
    # an earlier assistant turn is replaced, then a final answer is added after the last user turn
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "ORIGINAL-1"}, {"role": "user", "content": "And times 3?"}],
    # ends on an assistant turn: only that turn is rewritten
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "ORIGINAL-2"}],
]


def _regen(tiny_llama_dir, backend: str, **kw):
    from transformers import AutoTokenizer

    from eagle3.data.regenerate import regenerate

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    dtype = kw.pop("dtype", "float32")
    cfg = RegenerateConfig(backend=backend, max_tokens=kw.pop("max_tokens", 12), max_model_len=kw.pop("max_model_len", 512),
                           kv_cache_gb=0.25, hf_batch_size=kw.pop("hf_batch_size", 2), **kw)
    return regenerate([list(c) for c in CONVERSATIONS], tok, str(tiny_llama_dir), cfg, progress=False,
                      dtype=dtype)


def _check_shape(convs):
    assert len(convs) == 3
    for new, old in zip(convs, CONVERSATIONS):
        # the user/system turns are kept verbatim and in order; every assistant turn is new
        assert [m for m in new if m["role"] != "assistant"] == [m for m in old if m["role"] != "assistant"]
        assert new[-1]["role"] == "assistant"
        assert all(not m["content"].startswith("ORIGINAL") for m in new if m["role"] == "assistant")
    assert [m["role"] for m in convs[1]] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in convs[2]] == ["user", "assistant"]


@pytest.mark.vllm
def test_hf_backend_writes_what_vllm_writes(tiny_llama_dir):
    """Greedy regeneration through transformers (batched, left padded, batches of 2 over prompts of
    different lengths) writes the same turns as vLLM, both running the float32 model in float32
    (vLLM's own dtype=auto would run it in bfloat16 on a CPU)."""
    hf, hf_stats = _regen(tiny_llama_dir, "hf")
    _check_shape(hf)
    vl, vl_stats = _regen(tiny_llama_dir, "vllm")
    _check_shape(vl)
    assert hf == vl
    assert hf_stats == vl_stats
    assert hf_stats["regenerated_turns"] == 4  # 1 + 2 + 1


def test_hf_backend_counts_truncation_and_drops_long_prompts(tiny_llama_dir):
    convs, stats = _regen(tiny_llama_dir, "hf", max_tokens=3, max_model_len=40)
    # the 3-token cap cuts every turn of a random model; prompts over 40 - 3 tokens are dropped
    assert stats["truncated_turns"] == stats["regenerated_turns"] > 0
    assert stats["dropped_too_long"] >= 1
    assert len(convs) == 3 - stats["dropped_too_long"] - stats["empty_response"]


def test_hf_backend_batch_size_does_not_change_the_output(tiny_llama_dir):
    one, _ = _regen(tiny_llama_dir, "hf", hf_batch_size=1)
    three, _ = _regen(tiny_llama_dir, "hf", hf_batch_size=3)
    assert one == three


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="prepare.regen.backend"):
        RegenerateConfig(backend="sglang")
