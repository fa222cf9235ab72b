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


def test_regenerated_answers_do_not_move_a_prompt_between_splits(tiny_llama_dir, tmp_path):
    """Sample ids and splits are hashed from the source conversations: two prepare runs whose
    regenerated answers differ (4 against 12 new tokens a turn; on GPUs a bf16 token can differ
    between machines the same way) hold out the same prompts. They once were hashed from the
    regenerated text, and the smollm2_large held-out split moved by 8 of ~125 conversations
    between two H200s."""
    import contextlib
    import io
    import json

    import datasets
    from conftest import chat_records, write_jsonl

    from eagle3.__main__ import compose_config
    from eagle3.manifest import Manifest
    from eagle3.runner import run

    chats = write_jsonl(tmp_path / "chats.jsonl", chat_records(24, turns=2, seed=3))
    splits, answers = [], []
    for max_tokens in (4, 12):
        ws = tmp_path / f"ws{max_tokens}"
        with contextlib.redirect_stdout(io.StringIO()):
            run(compose_config([f"target.path={tiny_llama_dir}", f"data.path={chats}", f"workspace={ws}",
                                "experiment=split", "logger=jsonl", "progress=false", "stage=prepare",
                                "prepare.draft_vocab_size=64", "prepare.eval_fraction=0.3",
                                "prepare.regenerate=true", "prepare.regen.backend=hf",
                                f"prepare.regen.max_tokens={max_tokens}"]))
        run_dir = ws / "split" / Manifest(ws / "split").current("prepare").out_dir
        ds = datasets.load_from_disk(str(run_dir / "dataset"))
        splits.append({name: sorted(ds[name]["sample_id"]) for name in ("train", "eval")})
        answers.append([json.loads(line) for line in open(run_dir / "regenerated.jsonl")])
    assert answers[0] != answers[1]  # the regenerated answers differ ...
    assert splits[0]["eval"] and splits[0]["train"]
    # ... and every prompt both runs kept is in the same split under the same id (a run may drop an
    # answer the target ended at once: no trainable token)
    both = set(splits[0]["train"] + splits[0]["eval"]) & set(splits[1]["train"] + splits[1]["eval"])
    assert len(both) >= 20
    for name in ("train", "eval"):
        assert set(splits[0][name]) & both == set(splits[1][name]) & both


def test_prepare_runs_that_regenerate_hash_their_split_scheme(compose):
    """A regenerating prepare run of an older version (splits hashed from the regenerated text) and one
    of this version hold out other prompts, so their config hashes differ; without regeneration
    nothing changed and the hash stays."""
    from eagle3.data.dataset import prepare_config

    assert prepare_config(compose("prepare.regenerate=true"))["split_key"] == "source"
    assert "split_key" not in prepare_config(compose("data.path=/d.jsonl", "prepare.regenerate=false"))
