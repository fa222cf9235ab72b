"""``stage=plan``: what a run of this config will cost, before running it.

Counts the data (exactly from a complete prepare run of this very config, else estimated from a
seeded sample of the sources), sizes the hidden-state store for every store dtype, and estimates
the time of each stage on this machine from short measured probes (prefill of the target, decode
of the target, training steps of the draft; cached per machine and shape in
``${workspace}/plan_cache.json``) and on an H200 from the throughputs published in README.md and
bench/*.md, scaled by the work per token. Every figure says whether it was counted, measured here
or scaled, and each assumption is printed beside the table. Nothing else is written.

The estimates are coarse by nature: what the probes do not see (engine starts, the store checks,
the offline evaluator, other jobs on the machine) is added as fixed overheads stated below.
"""
from __future__ import annotations

import json
import logging
import math
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

log = logging.getLogger("eagle3.plan")

# -- assumptions (printed with every plan) ------------------------------------------------------
# Regenerated answers: share of prepare.regen.max_tokens an answer takes (its end-of-turn token
# included). The embedded default's real prepare wrote 47,655 trainable tokens in 577 regenerated
# turns at max_tokens=96 (370 of them cut there): 0.86.
REGEN_FILL = 0.86
# A vLLM engine start (model load, KV cache, warm-up), seconds, where no probe measured one (the vLLM
# probe measures the first start of a process and a later one). CPU: the embedded default's export
# ran 7 engines and the offline evaluator in 178 s (README) with ~1k tokens each, i.e. ~20 s a start;
# GPU: `stage=all debug=fast` on a 4-layer bf16 Llama spent 306 s of its export on one H200 (vLLM
# 0.25) in seven engine starts whose work took seconds: ~40 s a start (process, compile, CUDA graphs).
ENGINE_START_S = {"cpu": 20.0, "gpu": 40.0}
# Loading a checkpoint on the H200 host (the probes measure it here).
GPU_LOAD_S = 10.0
# Published H200 throughputs (bench/results/smollm2_large_h200_202611.md, bench/results/train_h200_202611.md):
H200 = {
    # extraction with the HF backend, SmolLM2-135M in float32: 40k tokens/s
    "extract_tokens_per_s": 40_000.0, "extract_params": 135e6,
    # the Llama-3.1-8B-shaped draft (TTT 7, 2048 tokens, bf16, compiled): 30.2k tokens/s
    "train_tokens_per_s": 30_200.0,
    # regeneration through transformers, bf16, 1024 rows a call: 6,954 answers (~1.3M tokens) in 224 s
    "decode_tokens_per_s": 1.33e6 / 224, "decode_params": 135e6,
}
STORE_DTYPES = ("float32", "bfloat16", "float16", "fp8")
PROBE_VERSION = 9


@dataclass
class DataCount:
    """Samples and tokens of the prepared dataset, counted or estimated."""

    samples: dict            # split -> samples
    tokens: int
    trainable_tokens: int
    exact: bool              # counted from a complete prepare run of this config
    how: str                 # where the figures come from, for the table
    lengths: list = field(default_factory=list, repr=False)  # train-split sample lengths (for the step count)
    coverage_curve: Optional[dict] = None
    draft_vocab_size: int = 0
    tokenize_s: float = 0.0  # tokenizing everything (measured on the sample, scaled; recorded when counted)
    vocab_choice: Optional[dict] = None  # prepare.draft_vocab_size=auto: the choice (recorded, or from the sample)
    vocab_note: str = ""     # prepare.draft_vocab_size=auto without a choice yet: what the plan sized with
    dataset_dir: str = ""    # the prepared dataset, when counted (the export's held-out prompts are read from it)


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------
def count_data(cfg, target, manifest, sample_size: int = 256) -> DataCount:
    """Exact from the prepare run this config would reuse (complete), else estimated."""
    from .data.dataset import prepare_config

    config = prepare_config(cfg)
    job = manifest.start("prepare", config=config, target=target.identity(), inputs={})  # names it; runs nothing
    rec = manifest.record("prepare", job.config_hash)
    if rec is not None and rec.status == "complete" and rec.facts is not None:
        return _counted(rec)
    return _estimated(cfg, target, sample_size)


def _counted(rec) -> DataCount:
    from .artifacts import DATASET_DIR, STATS_FILE
    from .extract import prepared_samples

    f = rec.facts
    stats = json.loads(rec.path(STATS_FILE).read_text()) if rec.path(STATS_FILE).is_file() else {}
    lengths = [int(n) for n in prepared_samples(rec)["train"].lengths]
    return DataCount(samples={"train": f.num_train, "eval": f.num_eval}, tokens=f.tokens,
                     trainable_tokens=f.trainable_tokens, exact=True,
                     how=f"counted: prepare run {rec.config_hash[:12]} of this config", lengths=lengths,
                     coverage_curve=getattr(f, "coverage_curve", None), draft_vocab_size=f.draft_vocab_size,
                     tokenize_s=float(stats.get("tokenize_seconds") or 0.0), vocab_choice=f.vocab_choice,
                     dataset_dir=str(rec.path(DATASET_DIR)))


def _estimated(cfg, target, sample_size: int) -> DataCount:
    """Conversations read in full (cheap); a seeded sample of them tokenized; scaled to all."""
    from collections import Counter

    from .data.chat_template import generation_prompt_ids
    from .data.dataset import load_conversations, tokenize_all
    from .data.sources import ReadReport
    from .data.vocab import build_vocab_mapping, coverage_curve, draft_vocab_size_for
    from .target import load_tokenizer

    report, drops = ReadReport(), Counter()
    convs = load_conversations(cfg, report, drops)
    n = len(convs)
    if not n:
        from .data.sources import DataError

        raise DataError("stage=plan: the data sources hold no conversations (check data.path / data.sources)")
    rng = random.Random(cfg.prepare.seed)
    sample = convs if n <= sample_size else rng.sample(convs, sample_size)
    tok = load_tokenizer(target, cfg.target.chat_template)
    max_len = cfg.prepare.max_length
    curve = choice = None
    auto = cfg.prepare.draft_vocab_size == "auto"
    # auto before any frequencies were counted (answers to regenerate): sized as the default would be
    requested = (vocab_choice_default(target.vocab_size) if auto else cfg.prepare.draft_vocab_size)
    if cfg.prepare.regenerate:
        fill = REGEN_FILL * cfg.prepare.regen.max_tokens
        lengths, trainable = [], 0
        for msgs in sample:
            slots = sum(m["role"] == "assistant" for m in msgs) + (msgs[-1]["role"] == "user")
            prompt = [m for m in msgs if m["role"] != "assistant"]
            base = len(generation_prompt_ids(tok, prompt)) if prompt else 0
            lengths.append(min(max_len, int(base + slots * (fill + 8))))  # +8: the template around each answer
            trainable += slots * fill
        how = (f"estimated: {len(sample)} of {n} conversations tokenized, answers assumed "
               f"{REGEN_FILL:.2f} x prepare.regen.max_tokens ({cfg.prepare.regen.max_tokens})")
        kept = 1.0
        tokenize_s = 0.0
    else:
        t_tok = time.perf_counter()
        rows, _ = tokenize_all(sample, tok, cfg, Counter(), progress=False)
        tokenize_s = (time.perf_counter() - t_tok) * n / len(sample)
        kept = len(rows) / len(sample)
        lengths = [len(r["input_ids"]) for r in rows]
        trainable = sum(sum(r["loss_mask"]) for r in rows)
        how = f"estimated: {len(sample)} of {n} conversations tokenized"
        if rows:
            from .data.dataset import token_frequencies

            freq = token_frequencies(rows, target.vocab_size, target.path)
            if auto:
                from .data.vocab_choice import choose_for_target

                choice = choose_for_target(freq, target.config, cfg.prepare.vocab_choice)
                requested = choice["chosen"]
            curve = coverage_curve(freq, chosen=build_vocab_mapping(freq, requested).draft_vocab_size)
            how += "; coverage from the sample's answers"
    scale = n / len(sample)
    total = int(round(n * kept))
    n_eval = max(int(round(total * cfg.prepare.eval_fraction)), cfg.prepare.eval_min if cfg.prepare.eval_fraction else 0)
    full_lengths = [lengths[i % len(lengths)] for i in range(total - n_eval)] if lengths else []
    return DataCount(samples={"train": total - n_eval, "eval": n_eval}, tokens=int(sum(lengths) * scale),
                     trainable_tokens=int(trainable * scale), exact=False, how=how, lengths=full_lengths,
                     coverage_curve=curve, tokenize_s=tokenize_s,
                     draft_vocab_size=draft_vocab_size_for(requested, target.vocab_size), vocab_choice=choice,
                     vocab_note=(f"auto: chosen by prepare from the regenerated answers' frequencies; sized here as "
                                 f"{draft_vocab_size_for(requested, target.vocab_size)}") if auto and choice is None else "")


def export_prompt_lengths(cfg, target, data: DataCount) -> tuple[list, str]:
    """(token count of each prompt the export's verification serves, how they were had): export.prompts'
    file or the counted eval split's prompts, tokenized as verification reads them, else the eval split's
    share estimated from the data count; then export.extra_prompts' documents, tokenized."""
    from .export.prompts import eval_prompts, extra_prompts_path, file_prompts

    x, trust = cfg.export, target.trust_remote_code
    if x.prompts:
        lengths, how = [len(q) for q in file_prompts(x.prompts, x.eval_prompts, target.path,
                                                     trust_remote_code=trust)], "export.prompts, tokenized"
    elif data.dataset_dir:
        lengths, how = [len(q) for q in eval_prompts(data.dataset_dir, x.eval_prompts)], "the eval split's, counted"
    else:
        n = min(x.eval_prompts, data.samples.get("eval", 0))
        total = max(1, sum(data.samples.values()))
        lengths = [int((data.tokens - data.trainable_tokens) / total)] * n  # a sample's tokens outside the answers
        how = "the eval split's, estimated"
    if x.extra_prompts:
        extra = [len(q) for q in file_prompts(extra_prompts_path(x.extra_prompts), None, target.path,
                                              trust_remote_code=trust, key="export.extra_prompts")]
        lengths, how = lengths + extra, how + f" and {len(extra)} of export.extra_prompts"
    return lengths, how


def vocab_choice_default(target_vocab: int) -> int:
    from .data.vocab_choice import DEFAULT_SIZE

    return min(DEFAULT_SIZE, int(target_vocab))


# ----------------------------------------------------------------------------------------------
# probes (measured here, cached)
# ----------------------------------------------------------------------------------------------
def _machine() -> str:
    import os

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return f"{platform.node()}|{platform.processor() or platform.machine()}|{os.cpu_count()} cpus|{gpu}|" \
           f"{torch.get_num_threads()} threads"


def cached_probe(cache_path: Path, key: dict, fn) -> dict:
    """``fn()`` once per key (machine, target, shape): later plans reuse the measurement."""
    key = {**key, "machine": _machine(), "version": PROBE_VERSION}
    skey = json.dumps(key, sort_keys=True)
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    if skey in cache:
        return {**cache[skey], "cached": True}
    result = fn()
    cache[skey] = result
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    tmp.replace(cache_path)
    return {**result, "cached": False}


def probe_prefill(target_path, dtype: str, seq: int = 256, batch: int = 4, reps: int = 3,
                  trust_remote_code: bool = False) -> dict:
    """Target forward with every hidden state (what extraction computes), tokens per second."""
    import torch
    from transformers import AutoModelForCausalLM

    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=getattr(torch, dtype),
                                                 trust_remote_code=trust_remote_code)
    model.eval()
    load_s = time.perf_counter() - t_load
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    with torch.inference_mode():
        model(input_ids=ids[:, :16], output_hidden_states=True)  # warm up
        t0 = time.perf_counter()
        for _ in range(reps):
            model(input_ids=ids, output_hidden_states=True)
        dt = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    return {"tokens_per_s": reps * batch * seq / dt, "params": params, "load_s": load_s,
            "shape": f"{reps} x {batch} x {seq} tokens"}


def probe_decode(target_path, dtype: str, batch: int = 8, new_tokens: int = 16, trust_remote_code: bool = False) -> dict:
    """Batched greedy decoding with transformers (regeneration, verification), tokens per second."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_path), dtype=getattr(torch, dtype),
                                                 trust_remote_code=trust_remote_code)
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, 32), generator=g)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, do_sample=False, min_new_tokens=2)  # warm up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        dt = time.perf_counter() - t0
    return {"tokens_per_s": batch * new_tokens / dt, "shape": f"{batch} rows x {new_tokens} new tokens"}


def probe_vllm(target_path, dtype: str, vocab: int, prompts: int = 32, prompt_len: int = 64,
               new_tokens: int = 32, trust_remote_code: bool = False, prefill_prompts: int = 16,
               prefill_len: int = 256, work: str = "decode") -> dict:
    """A vLLM engine of the target (what regeneration, vLLM extraction and verification run): its start,
    prefill (``prefill_prompts`` x ``prefill_len`` tokens, one token out: extraction's batches) and
    batched greedy decoding of ``prompts`` requests, tokens per second."""
    import torch

    from .export.vllm_eval import generate_counted
    from .vllm_engine import build_llm, shutdown_llm

    g = torch.Generator().manual_seed(0)
    max_len = max(prompt_len + new_tokens, prefill_len + 1) + 16
    t0 = time.perf_counter()
    llm = build_llm(str(target_path), max_model_len=max_len, kv_cache_gb=0.25, dtype=dtype,
                    disable_log_stats=False, trust_remote_code=trust_remote_code, work=work)
    start_s = time.perf_counter() - t0
    try:
        ids = torch.randint(100, vocab - 100, (prompts, prompt_len), generator=g).tolist()
        long = torch.randint(100, vocab - 100, (prefill_prompts, prefill_len), generator=g).tolist()
        generate_counted(llm, ids[:2], 2, set(), 0)  # warm up
        # the prefill timed the second time: the first of a batch shape also builds its kernels (oneDNN
        # primitives on a CPU), which a stage of thousands of batches pays once
        generate_counted(llm, long, 1, set(), 0)
        t0 = time.perf_counter()
        generate_counted(llm, long, 1, set(), 0)
        prefill = prefill_prompts * prefill_len / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        generate_counted(llm, ids, 1, set(), 0)
        short_prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = generate_counted(llm, ids, new_tokens, set(), 0)
        decode_s = time.perf_counter() - t0 - short_prefill_s
        decode = out.generated_tokens / max(decode_s, 1e-6)
    finally:
        shutdown_llm(llm)
    # a later start in the same process (vLLM imported, its kernels loaded): what the stages' other
    # engines cost when `python -m eagle3` runs them in one process
    t0 = time.perf_counter()
    shutdown_llm(build_llm(str(target_path), max_model_len=max_len, kv_cache_gb=0.25, dtype=dtype,
                           disable_log_stats=False, trust_remote_code=trust_remote_code))
    restart_s = time.perf_counter() - t0
    return {"start_s": start_s, "restart_s": restart_s, "prefill_tokens_per_s": prefill, "tokens_per_s": decode,
            "shape": f"engine start, prefill {prefill_prompts} x {prefill_len} tokens, {prompts} prompts x "
                     f"{prompt_len} tokens, {new_tokens} new tokens each, {dtype}"}


def probe_train(target, tcfg, layer_ids, draft_vocab_size: int, steps: int = 5) -> dict:
    """Training steps of the draft on random states of the configured shape (max_seq_len rows of
    batch_size, TTT steps, mixed precision, the target's real head), seconds per optimizer step."""
    import torch

    from .model.draft import Eagle3Draft, Eagle3DraftConfig
    from .target_weights import read_target_head
    from .train.target_head import TargetHead, model_inputs
    from .train.ttt import TTTModel

    t_setup = time.perf_counter()
    cfg = Eagle3DraftConfig.from_target(target.config, layer_ids, draft_vocab_size, tcfg.model)
    from .cpu import resolve_precision

    mp = resolve_precision(tcfg.mixed_precision, torch.cuda.is_available())
    dtype = torch.bfloat16 if mp == "bf16" else torch.float32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    head_t = read_target_head(target.path, target.config)
    V, H = cfg.vocab_size, cfg.hidden_size
    kept = torch.arange(draft_vocab_size)  # which ids does not change the cost
    head = TargetHead(*(head_t[k].to(device, dtype) for k in ("embed", "norm", "lm_head")), cfg.rms_norm_eps,
                      kept.to(device))
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg).to(device)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    draft.set_vocab_mapping(torch.zeros(draft_vocab_size, dtype=torch.long), t2d)
    model = TTTModel(draft, num_steps=tcfg.ttt_steps, decay=tcfg.decay, attention=tcfg.attention,
                     compile=tcfg.compile == "true", fp8_matmul=tcfg.fp8_matmul)
    from .train.optim import build_optimizer

    opt = build_optimizer(model, tcfg, device)  # the configured one (Muon's step costs more than AdamW's)
    B, T, n = tcfg.batch_size, tcfg.max_seq_len, len(layer_ids)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, V, (B, T), generator=g), "loss_mask": torch.ones(B, T, dtype=torch.long),
             "aux_hidden_states": torch.randn(B, T, n * H, generator=g).to(dtype),
             "last_hidden_state": torch.randn(B, T, H, generator=g).to(dtype),
             "position_ids": torch.arange(T).expand(B, T).contiguous(), "doc_ids": torch.zeros(B, T, dtype=torch.long)}
    batch = {k: v.to(device) for k, v in batch.items()}

    def step():
        inputs = model_inputs(head, batch, dtype)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss, _ = model(**inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm up
    setup_s = time.perf_counter() - t_setup
    times = []
    for _ in range(steps):  # the median step: one step slowed by another job on the machine counts once
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    from .train.metrics import ttt_flops_per_token

    return {"seconds_per_micro_batch": dt, "tokens_per_s": B * T / dt, "setup_s": setup_s,
            "flops_per_token": ttt_flops_per_token(cfg, T, tcfg.ttt_steps, V),
            "shape": f"{steps} steps of {B} x {T} tokens, TTT {tcfg.ttt_steps}, {str(dtype).replace('torch.', '')}, "
                     f"{tcfg.optimizer}"}


# ----------------------------------------------------------------------------------------------
# the plan
# ----------------------------------------------------------------------------------------------
def train_steps(cfg, lengths: list) -> int:
    """Optimizer steps the train stage will take (its own epoch plan, on the counted or estimated lengths)."""
    import numpy as np

    from .train.data import Epochs

    if cfg.train.max_steps:
        return int(cfg.train.max_steps)
    if not lengths:
        return 0
    return int(Epochs(np.asarray(lengths, dtype=np.int64), cfg.train, 1).total_steps())


def check_online_window(cfg, data: DataCount, layout) -> None:
    """An external producer's window (``train.online.window_bytes``) must hold the largest
    micro-batch of the run's data order, which the trainer refuses only when it starts: refused
    here with the trainer's message, over the counted lengths (or the estimated ones, said so). Not
    a config check: the bytes depend on the target's hidden size and the samples' lengths."""
    import numpy as np

    from .online.exchange import cached_count, largest_micro_batch, window_too_small
    from .train.data import Epochs

    if not data.lengths:
        return
    ocfg, lengths = cfg.train.online, np.asarray(data.lengths, dtype=np.int64)
    epochs = Epochs(lengths, cfg.train, 1)
    micro_batches = epochs.micro_batches(0, epochs.total_steps(), 0)
    if not micro_batches:
        return
    need, index = largest_micro_batch(lengths, layout, micro_batches, cached_count(lengths, layout, ocfg.cache_bytes))
    if need > ocfg.window_bytes:
        how = "" if data.exact else f" ({data.how}; prepare counts them exactly)"
        raise window_too_small(ocfg.window_bytes, len(micro_batches[index]), need, index, how)


def make_plan(cfg, manifest, probe: bool = True) -> dict:
    """Every figure of the table, with where it came from."""
    import dataclasses

    from .extract.layout import derive_store_layout
    from .target import resolve

    target = resolve(cfg.target, cfg.workspace)
    data = count_data(cfg, target, manifest)
    auto_layers = cfg.extract.layer_ids == "auto"  # chosen by extract's layer probe: sized with the default's count
    derived = derive_store_layout(cfg.extract, target, cfg.target.dtype,  # the store extract writes
                                  layer_ids=[] if auto_layers else None)
    L, H, layer_ids = derived.layout.last_layer_id, derived.layout.hidden_size, derived.layout.layer_ids
    split_tokens = data.tokens  # extract.splits: train and eval by default
    store = {}
    for dt in STORE_DTYPES:
        lay = dataclasses.replace(derived.layout, dtype=dt)
        store[dt] = {"bytes_per_token": lay.bytes_per_token, "bytes": lay.bytes_per_token * split_tokens}
    store_dtype, run_dtype = derived.layout.dtype, derived.target_dtype
    steps = train_steps(cfg, data.lengths)
    if cfg.train.hidden_states == "online" and cfg.train.online.producer == "external":
        check_online_window(cfg, data, derived.layout)  # before the probes: the trainer would refuse it
    rows_per_step = cfg.train.batch_size * cfg.train.grad_accum
    plan = {"target": str(target.path), "target_quantization": target.quantization, "layer_ids": list(layer_ids),
            "layer_ids_auto": auto_layers, "hidden_size": H, "num_layers": L,
            "data": asdict(data) | {"lengths": None}, "store": store, "store_dtype": store_dtype,
            "store_layout": derived.layout.to_json(), "target_dtype": run_dtype,
            "train_steps": steps, "rows_per_step": rows_per_step, "probes": {}, "times": {}, "assumptions": []}
    engines, runs = export_engines(cfg.export)
    export_lengths, export_how = export_prompt_lengths(cfg, target, data) if cfg.export.verify else ([], "")
    plan["export_prompts"] = {"num": len(export_lengths), "tokens": sum(export_lengths), "how": export_how}
    export_tokens = len(export_lengths) * cfg.export.eval_max_tokens * len(cfg.export.eval_temperatures)
    export_prompts = (len(export_lengths), sum(export_lengths))
    regen_tokens = data.trainable_tokens if cfg.prepare.regenerate else 0
    cache = Path(cfg.workspace).expanduser().resolve() / "plan_cache.json"
    if probe:
        key, trust = {"target": target.hash, "dtype": run_dtype}, target.trust_remote_code
        pre = cached_probe(cache, {**key, "probe": "prefill"},
                           lambda: probe_prefill(target.path, run_dtype, trust_remote_code=trust))
        uses_vllm = ((cfg.prepare.regenerate and cfg.prepare.regen.backend == "vllm") or cfg.export.verify
                     or cfg.extract.backend.startswith("vllm"))
        if uses_vllm:
            dec = cached_probe(cache, {**key, "probe": "vllm"},
                               lambda: probe_vllm(target.path, run_dtype, target.vocab_size, trust_remote_code=trust))
        else:
            dec = cached_probe(cache, {**key, "probe": "decode"}, lambda: probe_decode(target.path, run_dtype, trust_remote_code=trust))
        tr = cached_probe(cache, {**key, "probe": "train", "train": _train_shape(cfg), "layers": list(layer_ids),
                                  "draft_vocab": data.draft_vocab_size},  # as prepare builds it (counted or capped)
                          lambda: probe_train(target, cfg.train, layer_ids, data.draft_vocab_size))
        plan["probes"] = {"prefill": pre, "decode": dec, "train": tr}
        if auto_layers:
            plan["layer_probe_s"] = layer_probe_seconds(cfg.extract.layer_probe, data.lengths, pre)
        regen_tps = regen_prefill_tps = None
        if cfg.prepare.regenerate and cfg.prepare.regen.backend == "vllm" and "start_s" in dec:
            # regeneration sends every conversation's next turn at once, in its own dtype: many requests decode
            # together (the 32-request probe ran at a third of the embedded default's regeneration rate)
            regen_dtype = cfg.prepare.regen.dtype
            if regen_dtype == "native":
                from .cpu import bf16_is_fast

                regen_dtype = "bfloat16" if bf16_is_fast(_on_gpu()) else "auto"
            regen_dtype = run_dtype if regen_dtype == "auto" else regen_dtype
            rg = cached_probe(cache, {**key, "dtype": regen_dtype, "probe": "vllm_regen"},
                              lambda: probe_vllm(target.path, regen_dtype, target.vocab_size, prompts=128, prompt_len=32,
                                                 new_tokens=16, prefill_prompts=4, prefill_len=64,
                                                 trust_remote_code=trust, work="batch"))
            plan["probes"]["regenerate"] = rg
            regen_tps, regen_prefill_tps = rg["tokens_per_s"], rg.get("prefill_tokens_per_s")
        prefill_tps = (dec["prefill_tokens_per_s"] if cfg.extract.backend.startswith("vllm") and "start_s" in dec
                       else pre["tokens_per_s"])
        here = stage_times(cfg, data, split_tokens, steps, rows_per_step, engines, export_tokens, regen_tokens,
                           runs=runs, prefill_tps=prefill_tps, decode_tps=dec["tokens_per_s"], hf_prefill_tps=pre["tokens_per_s"],
                           step_s=tr["seconds_per_micro_batch"], load_s=pre["load_s"], setup_s=tr["setup_s"],
                           engine_s=dec.get("start_s", ENGINE_START_S["gpu" if _on_gpu() else "cpu"]),
                           restart_s=dec.get("restart_s"), regen_tps=regen_tps, regen_prefill_tps=regen_prefill_tps,
                           export_prompts=export_prompts)
        plan["times"]["here"] = here
        # an H200, from the published throughputs scaled by the work per token
        from .model.draft import Eagle3DraftConfig
        from .train.metrics import ttt_flops_per_token

        scale_params = pre["params"] / H200["extract_params"]
        big = Eagle3DraftConfig(hidden_size=4096, target_hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5, vocab_size=128256,
                                draft_vocab_size=32000, aux_layer_ids=[0, 1, 2])
        train_tps = H200["train_tokens_per_s"] * ttt_flops_per_token(big, 2048, 7, 128256) / tr["flops_per_token"]
        h200 = stage_times(cfg, data, split_tokens, steps, rows_per_step, engines, export_tokens, regen_tokens,
                           runs=runs, prefill_tps=H200["extract_tokens_per_s"] / scale_params,
                           decode_tps=H200["decode_tokens_per_s"] / scale_params,
                           hf_prefill_tps=H200["extract_tokens_per_s"] / scale_params,
                           step_s=cfg.train.max_seq_len * cfg.train.batch_size / train_tps, load_s=GPU_LOAD_S,
                           setup_s=GPU_LOAD_S, engine_s=ENGINE_START_S["gpu"], export_prompts=export_prompts)
        plan["times"]["h200"] = h200
        plan["h200_train_tokens_per_s"] = train_tps
    # online training keeps at most the window ahead of the trainer plus the cache (train.online.*),
    # never more than the whole store would take
    from .units import fmt_size

    ocfg = cfg.train.online
    window = min(ocfg.window_bytes + ocfg.cache_bytes, store[store_dtype]["bytes"])
    plan["offline_online"] = {
        "offline": {"disk": store[store_dtype]["bytes"]},
        "online": {"disk": window},
    }
    # what an external producer sends the trainer: every token's states at the trainer's rate (its
    # probe here, the 8B-shaped reference on an H200); the network between the hosts must carry it
    bpt = store[store_dtype]["bytes_per_token"]
    plan["offline_online"]["online"]["bytes_per_token"] = bpt
    rates = {"here": plan["probes"].get("train", {}).get("tokens_per_s"), "h200": plan.get("h200_train_tokens_per_s")}
    for where, tps in rates.items():
        if tps:
            plan["offline_online"]["online"][f"network_bytes_per_s_{where}"] = bpt * tps
    for where, t in plan["times"].items():
        plan["offline_online"]["offline"][f"seconds_{where}"] = t["extract"] + t["train"]
        plan["offline_online"]["online"][f"seconds_{where}_same_device"] = t["extract"] + t["train"]
        plan["offline_online"]["online"][f"seconds_{where}_separate_devices"] = max(t["extract"], t["train"])
    plan["assumptions"] = [
        f"regenerated answers fill {REGEN_FILL:.2f} of prepare.regen.max_tokens (0.86 on the embedded default's run)"
        if cfg.prepare.regenerate else "answers as in the sources (no regeneration)",
        f"a vLLM engine start: measured here by the probe, the process's first (vLLM imported) and a later one "
        f"(else {ENGINE_START_S['cpu']:.0f} s); {ENGINE_START_S['gpu']:.0f} s on an H200 (seven starts of a debug "
        "run's export there); the stages run in one process (python -m eagle3); export: one engine start "
        "(export.shared_engines; one more when prompt lookup is served, export.prompt_lookup) and one run of "
        "export.eval_prompts x eval_max_tokens each for plain decoding, each k and prompt lookup served, the "
        "offline evaluator as transformers' forward over the prompts and their greedy paths; model loads: "
        f"measured here, {GPU_LOAD_S:.0f} s on the H200 host",
        "extraction (extract.backend=vllm*) timed as vLLM's prefill of the probe engine (the capture of the "
        "hidden states and the store writes not included); extract.backend=hf as the transformers forward with every "
        "hidden state; the parity sample as the latter",
        "regeneration timed as a probe engine's batched greedy decoding of 128 requests in prepare.regen.dtype, "
        "verification as 32 requests' in the dtype the target runs in; without vLLM in the config, as transformers' "
        "batched greedy decoding",
        "the machine as it is now: other jobs on it slow the probes and the estimate alike",
        "H200: extraction and regeneration scaled from SmolLM2-135M's published rates by parameter count; training "
        "from the Llama-3.1-8B-shaped draft's 30.2k tokens/s by FLOPs per token (small drafts do not fill an H200: "
        "their time is a lower bound)",
        f"online training (train.hidden_states=online): disk at most train.online.window_bytes + cache_bytes "
        f"({fmt_size(ocfg.window_bytes)} + {fmt_size(ocfg.cache_bytes)}, or the store if smaller); time = extract + "
        "train on one device, the longer of the two when the target and the draft have a device each (producers "
        "run one sample per forward: on a GPU batched extraction is faster than that)",
    ]
    return plan


def layer_probe_seconds(probe_cfg, train_lengths, prefill: dict) -> float:
    """``extract.layer_ids=auto``: the layer probe's time, estimated as a model load and the
    transformers forward over its tokens (the first ``samples`` training samples, at most
    ``max_tokens``) at the prefill probe's rate; the ridge fits (seconds) are not counted."""
    tokens = min(probe_cfg.max_tokens, sum(int(n) for n in list(train_lengths)[:probe_cfg.samples]))
    return prefill["load_s"] + tokens / prefill["tokens_per_s"]


def export_engines(export_cfg) -> tuple[int, int]:
    """(vLLM engine starts, generation runs) of the export's verification: a run each for plain
    decoding, every k and prompt lookup unless it is replayed (export.prompt_lookup); one start with
    export.shared_engines (plain decoding and every k in the draft's engine) and one more for prompt
    lookup served, else one per run."""
    if not export_cfg.verify:
        return 0, 0
    from .export.lookup_replay import lookup_mode

    served = lookup_mode(export_cfg.prompt_lookup, export_cfg.eval_temperatures) == "served"
    runs = 1 + served + len({export_cfg.num_speculative_tokens, *map(int, export_cfg.eval_ks)})
    return (1 + served if export_cfg.shared_engines else runs), runs


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def stage_times(cfg, data, split_tokens, steps, rows_per_step, engines, export_tokens, regen_tokens, *,
                prefill_tps, decode_tps, hf_prefill_tps, step_s, load_s, setup_s, engine_s, runs=None,
                restart_s=None, regen_tps=None, regen_prefill_tps=None, export_prompts=None) -> dict:
    """Seconds per stage from throughputs and fixed costs (both stated in the plan). ``engine_s``: the
    first vLLM engine start of the process (vLLM's import included), ``restart_s`` each later one (the
    stages of `python -m eagle3` run in one process). ``regen_tps`` / ``regen_prefill_tps``:
    regeneration's decoding and prefill rates (else ``decode_tps`` / ``prefill_tps``); the offline
    evaluator runs at ``hf_prefill_tps`` (transformers' forward). ``export_prompts``: (prompts, their
    tokens) the export serves, each prefilled in every run (default: export.eval_prompts of the data's
    mean length)."""
    started = []

    def start() -> float:
        started.append(1)
        return engine_s if len(started) == 1 or restart_s is None else restart_s

    vllm_regen = cfg.prepare.regen.backend == "vllm"
    # regeneration: every answer decoded, every prompt (the tokens outside the answers) prefilled
    regen_prefill = max(0, data.tokens - data.trainable_tokens) / (regen_prefill_tps or prefill_tps)
    prepare = data.tokenize_s + (((start() if vllm_regen else load_s) + regen_tokens / (regen_tps or decode_tps)
                                  + regen_prefill) if cfg.prepare.regenerate else 0.0)
    mean_len = split_tokens / max(1, sum(data.samples.values()))
    e = cfg.extract
    extract = (start() if e.backend.startswith("vllm") else load_s) + split_tokens / prefill_tps
    extract += (load_s + e.verify_samples * mean_len / hf_prefill_tps) if e.verify_samples else 0.0  # parity sample
    evals = (steps // cfg.train.eval_every + 1) if data.samples.get("eval") else 0
    eval_tokens = data.samples.get("eval", 0) * mean_len
    train = setup_s + steps * rows_per_step * step_s + evals * eval_tokens * step_s / cfg.train.max_seq_len / 3
    export = 0.0
    if engines:  # each engine start; each run (plain, each k, prompt lookup served) prefills every prompt and
        # generates export_tokens; the offline evaluator: the target in transformers over every prompt and its
        # greedy path (one teacher-forced forward each, at the prefill rate), the draft replayed on it
        runs = engines if runs is None else runs
        x = cfg.export
        n, prompt_tokens = export_prompts or (x.eval_prompts, x.eval_prompts * mean_len)
        path = x.eval_max_tokens + max([x.num_speculative_tokens, *x.eval_ks]) + 1
        temps = len(x.eval_temperatures)
        export = sum(start() for _ in range(engines)) \
            + runs * (temps * prompt_tokens / prefill_tps + export_tokens / decode_tps) \
            + load_s + (prompt_tokens + n * path) / hf_prefill_tps
    return {"prepare": prepare, "extract": extract, "train": train, "export": export}


def _train_shape(cfg) -> dict:
    t = cfg.train
    return {"batch_size": t.batch_size, "max_seq_len": t.max_seq_len, "ttt_steps": t.ttt_steps,
            "mixed_precision": t.mixed_precision, "model": asdict(t.model), "attention": t.attention,
            "compile": t.compile, "optimizer": t.optimizer}


def _hms(s: float) -> str:
    if s is None or not math.isfinite(s):
        return ""
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def print_plan(plan: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from .quantization import summary
    from .units import fmt_size

    console = Console(width=160)
    console.print(f"target {plan['target']}: {plan.get('target_dtype')}, quantization: "
                  f"{summary(plan.get('target_quantization'))}")
    d = plan["data"]
    mark = "counted" if d["exact"] else "estimated"
    t = Table(title=f"eagle3 plan: data ({d['how']})")
    for col in ("figure", "value", "source"):
        t.add_column(col)
    t.add_row("samples (train / eval)", f"{d['samples']['train']} / {d['samples']['eval']}", mark)
    t.add_row("tokens", f"{d['tokens']:,}", mark)
    t.add_row("trainable tokens", f"{d['trainable_tokens']:,}", mark)
    t.add_row("optimizer steps", f"{plan['train_steps']:,}", "train's epoch plan on these lengths")
    if d.get("coverage_curve"):
        t.add_row("draft vocabulary coverage", ", ".join(
            f"{int(n) // 1024 if int(n) % 1024 == 0 else n}{'k' if int(n) % 1024 == 0 else ''}"
            f"{'*' if int(n) == d['draft_vocab_size'] else ''} {v:.4f}"
            for n, v in sorted(d["coverage_curve"].items(), key=lambda kv: int(kv[0]))), mark + " (* = chosen)")
    else:
        t.add_row("draft vocabulary coverage", "known after prepare (answers are regenerated)", "")
    if d.get("vocab_choice"):
        from .contracts import vocab_choice_line

        t.add_row("draft vocabulary size", vocab_choice_line(d["vocab_choice"]), mark)
    elif d.get("vocab_note"):
        t.add_row("draft vocabulary size", d["vocab_note"], "")
    console.print(t)
    layers = plan["layer_ids"]
    if plan.get("layer_ids_auto"):
        secs = plan.get("layer_probe_s")
        layers = (f"auto (chosen at extract time, probe ~{secs:.0f} s; sized as the default {layers})"
                  if secs is not None else f"auto (chosen at extract time; sized as the default {layers})")
    t = Table(title=f"the store: layers {layers} + {plan['num_layers']}, hidden {plan['hidden_size']}")
    for col in ("store dtype", "bytes / token", "store size", ""):
        t.add_column(col)
    for dt, s in plan["store"].items():
        t.add_row(dt, str(s["bytes_per_token"]), fmt_size(s["bytes"]), "<- extract.store_dtype" if dt == plan[
            "store_dtype"] else "")
    console.print(t)
    times = plan["times"]
    if times:
        t = Table(title="time per stage (h:mm:ss)")
        t.add_column("stage")
        cols = [("here", "this machine (measured probes)"), ("h200", "one H200 (published rates, scaled)")]
        for _, label in cols:
            t.add_column(label)
        for stage in ("prepare", "extract", "train", "export"):
            t.add_row(stage, *(_hms(times[w][stage]) for w, _ in cols if w in times))
        t.add_row("total", *(_hms(sum(times[w].values())) for w, _ in cols if w in times))
        console.print(t)
        h = sum(times["h200"].values()) / 3600
        console.print(f"GPU-hours on H200s: {h:.3f} (one GPU); this machine: {sum(times['here'].values()) / 3600:.3f} h")
        for name, p in plan["probes"].items():
            extra = (f" decoding, {p['prefill_tokens_per_s']:.0f} tokens/s prefill, engine start {p['start_s']:.0f} s"
                     + (f" (a later one {p['restart_s']:.0f} s)" if "restart_s" in p else "")
                     if "start_s" in p else "")
            console.print(f"probe {name}: {p['tokens_per_s']:.0f} tokens/s{extra} ({p['shape']}"
                          f"{', cached' if p.get('cached') else ', measured now'})")
    oo = plan["offline_online"]
    t = Table(title="offline (a store on disk) vs online (hidden states streamed to the trainer)")
    for col in ("mode", "disk", "extract + train here", "extract + train on an H200"):
        t.add_column(col)
    t.add_row("offline", fmt_size(oo["offline"]["disk"]), _hms(oo["offline"].get("seconds_here")),
              _hms(oo["offline"].get("seconds_h200")))
    on = oo["online"]
    t.add_row("online, one device", fmt_size(on["disk"]) + " (window + cache)", _hms(on.get("seconds_here_same_device")),
              _hms(on.get("seconds_h200_same_device")))
    t.add_row("online, a device each", fmt_size(on["disk"]) + " (window + cache)",
              _hms(on.get("seconds_here_separate_devices")), _hms(on.get("seconds_h200_separate_devices")))
    console.print(t)
    net = [f"{fmt_size(on[k])}/s ({8 * on[k] / 1e9:.2f} Gbit/s) {where}" for k, where in
           (("network_bytes_per_s_here", "at this machine's training rate"),
            ("network_bytes_per_s_h200", "at an H200's")) if on.get(k)]
    if net:
        console.print(f"online with the producer on another host: the network carries {fmt_size(on['bytes_per_token'])} "
                      f"a token ({plan['store_dtype']} states) to the trainer, {'; '.join(net)}")
    console.print("assumptions:\n" + "\n".join(f"  - {a}" for a in plan["assumptions"]))
