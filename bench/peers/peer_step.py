"""One EAGLE-3 training step of the peer trainers (speculators 0.9, SpecForge) beside eagle3's, at
bench/train.py's shape, each peer in its own subprocess (a crash leaves an error row, not a broken
table). Prints one JSON line per row and a markdown table last; writes $OUT/peer_step.json (after
every peer) and $OUT/peer_step.md when OUT is set; `--table A.json B.json` prints one table of runs
made apart. What each row runs, what is not reproduced and where the peers' code comes from:
bench/peers/README.md. Results: bench/results/train_step_h200_202612.md, fp8_matmul_h200_202612.md.

    python3 bench/peers/peer_step.py                          # every peer and optimizer, 8B shape, CUDA
    python3 bench/peers/peer_step.py --small                  # CPU smoke run at a small shape
    python3 bench/peers/peer_step.py --peers speculators --optimizers muon --seq 4096
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # bench/ (bench/train.py is imported from there)
REPO = HERE.parent
PEERS = ("eagle3", "speculators", "specforge")
OPTIMIZERS = ("adamw", "muon")
SMALL = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=2048, draft_vocab=512, seq=128)
DEFAULT_PATHS = {"speculators": ("PEER_STEP_SPECULATORS_PATH", "/tmp/specsite"),
                 "specforge": ("PEER_STEP_SPECFORGE_PATH", "/tmp/specforge:/tmp/sfsite")}


# ------------------------------------------------------------------------------------- common
def fingerprint(tensors) -> list:
    """(sum, sum of squares) of each tensor in float64: tells which ones an optimizer step changed."""
    return [(float(t.detach().double().sum()), float(t.detach().double().square().sum())) for t in tensors]


def measure(step, trained: list, a, device) -> dict:
    """``a.warmup`` steps, then ``a.steps`` steps each timed alone. ``step()`` returns the loss;
    ``trained``: the tensors the optimizer updates (their change is checked, not timed)."""
    import torch

    cuda = device.type == "cuda"
    losses = []
    t0 = time.perf_counter()
    for _ in range(a.warmup):
        losses.append(float(step()))
    warm_s = time.perf_counter() - t0
    before = fingerprint(trained)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            h0 = time.perf_counter()
            loss = float(step())
            times.append(time.perf_counter() - h0)
        losses.append(float(loss))
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    changed = sum(b != c for b, c in zip(before, fingerprint(trained)))
    med = statistics.median(times)
    return {"step_ms": med * 1e3, "tokens_per_s": a.batch * a.seq / med, "peak_gib": peak,
            "step_ms_all": [round(t * 1e3, 3) for t in times], "warmup_s": round(warm_s, 1), "losses": losses,
            "params_changed": changed, "params_trained": len(trained)}


def target_weights(a, device):
    """The verifier's embedding, lm_head (draft-vocabulary rows x3, as bench/train.py's make_head),
    final norm and kept ids: drawn on ``device`` (seeded), returned on the CPU in bf16, so that no
    row's memory holds them beside the trainer's own copies."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    V, H = a.vocab, a.hidden
    embed = torch.randn(V, H, generator=gen, device=device).mul_(0.02).to(torch.bfloat16)
    lm_head = torch.randn(V, H, generator=gen, device=device).mul_(0.02)
    kept = torch.randperm(V, generator=gen, device=device)[: a.draft_vocab].sort().values
    lm_head[kept] *= 3
    norm = (1 + 0.1 * torch.randn(H, generator=gen, device=device)).to(torch.bfloat16)
    return embed.cpu(), lm_head.to(torch.bfloat16).cpu(), norm.cpu(), kept.cpu()


def sample(a, gen, n_tokens: int) -> dict:
    """One sample's verifier outputs (CPU, bf16): aux states [n, n_aux * H], last state [n, H], ids, mask."""
    import torch

    H = a.hidden
    return {"aux": torch.randn(n_tokens, a.n_aux * H, generator=gen).to(torch.bfloat16),
            "last": torch.randn(n_tokens, H, generator=gen).mul_(2).to(torch.bfloat16),
            "ids": torch.randint(0, a.vocab, (n_tokens,), generator=gen),
            "mask": torch.ones(n_tokens, dtype=torch.long)}


def release(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def allocated_gib(device):
    import torch

    return torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:240] if text else ''}"


def impl_name(impl) -> str:
    return " + ".join(impl) if isinstance(impl, tuple) else str(impl)


def run_impls(build, impls: list, failed: dict, a, device) -> dict:
    """Measure the first implementation of ``impls`` that works. ``build(impl)`` -> (step, trained
    tensors); an implementation that raises (at build or in the warm-up, where compilation runs)
    is recorded in ``failed`` (shared by a worker's rows, so a known failure is not retried) and
    the next one is tried."""
    import torch

    tried = []
    for impl in impls:
        if impl in failed:
            tried.append(f"{impl_name(impl)} failed (an earlier row): {failed[impl]}")
            continue
        try:
            release(device)
            resident = allocated_gib(device)
            torch.manual_seed(0)
            step, trained = build(impl)
            res = measure(step, trained, a, device)
            return {**res, "impl": impl, "failed": tried, "resident_gib_before": resident}
        except Exception as e:  # the next implementation; the row names this one's failure
            traceback.print_exc()
            failed[impl] = first_line(e)
            tried.append(f"{impl_name(impl)} failed: {failed[impl]}")
            step = trained = None
            torch._dynamo.reset()
    raise RuntimeError("every implementation failed: " + "; ".join(tried))


# ------------------------------------------------------------------------------------- eagle3
def eagle3_rows(a, device, emit, work: Path) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    import train as bench_train  # bench/train.py

    from eagle3.model.draft import Eagle3Draft
    from eagle3.train.optim import build_optimizer
    from eagle3.train.ttt import TTTModel

    cuda = device.type == "cuda"
    # the train stage's attention and compilation: flex, compiled, on CUDA; sdpa, eager, on CPU
    variant, attention, compile_ = ("flex_compiled", "flex", True) if cuda else ("sdpa_eager", "sdpa", False)
    a = argparse.Namespace(**vars(a), loop_steps=a.warmup + a.steps)  # loop_config's max_steps
    failed = {}
    arms = [(opt, f8) for f8 in (("off", "on") if getattr(a, "eagle3_fp8", False) else ("off",)) for opt in a.optimizers]
    for opt, f8 in arms:
        def build(impl, opt=opt, f8=f8):
            cfg = bench_train.make_config(a)
            gen = torch.Generator(device=device).manual_seed(0)
            draft = Eagle3Draft(cfg).to(device)  # fp32 master weights
            head, _ = bench_train.make_head(cfg, device, torch.bfloat16, gen)
            head.compile = compile_
            draft.set_vocab_mapping(head.kept_ids - torch.arange(cfg.draft_vocab_size, device=device),
                                    torch.zeros(cfg.vocab_size, dtype=torch.bool, device=device)
                                    .index_fill_(0, head.kept_ids, True))
            model = TTTModel(draft, num_steps=a.ttt, decay=0.8, attention=attention, compile=compile_, fp8_matmul=f8)
            tcfg = bench_train.loop_config(a, "auto", optimizer=opt, muon_impl="fast", fp8_matmul=f8)
            optimizer = build_optimizer(model, tcfg, device)
            batch = bench_train.make_batch(cfg, a.batch, a.seq, device, torch.bfloat16, gen)

            def step():
                loss, _, _ = bench_train.train_step(model, head, batch, optimizer, torch.bfloat16, True, tcfg.grad_clip)
                return loss
            return step, [p for p in model.parameters() if p.requires_grad]

        label = (f"eagle3, AdamW (bench/train.py {variant})" if opt == "adamw"
                 else f"eagle3, Muon (FastMuon + AdamW, train.optimizer=muon; {variant})")
        if f8 != "off":
            label += f", train.fp8_matmul={f8}"
        row = {"peer": "eagle3", "variant": opt if f8 == "off" else f"{opt}+fp8", "optimizer": opt, "trainer": label,
               "precision": "fp32 weights, bf16 autocast" + ("; the layer's matmuls float8" if f8 != "off" else ""),
               "attention": attention,
               "loss_impl": "eagle3 TTT loss" + (" (compiled)" if compile_ else "")}
        try:
            row.update(run_impls(build, [variant], failed, a, device))
        except Exception as e:  # the row says why; the other rows go on
            row["error"] = first_line(e)
        emit(row)


# -------------------------------------------------------------------------------- speculators
SPEC_IMPLS_CUDA = [("simple_flex_attention", "fused"), ("simple_flex_attention", "eager"), ("sdpa", "eager")]
SPEC_IMPLS_CPU = [("sdpa", "eager")]  # flex: no CPU backward; fused: a Triton kernel


def spec_verifier(a, d: Path, device) -> None:
    """A random verifier for speculators' builder: config.json (a Llama of the bench shape),
    model.safetensors (embed_tokens, lm_head, final norm: what load_verifier_weights reads),
    d2t.npy / t2d.npy (its offset / mask convention)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=a.hidden, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      head_dim=a.head_dim, intermediate_size=a.intermediate, vocab_size=a.vocab,
                      num_hidden_layers=max(4, a.n_aux + 1), rms_norm_eps=1e-5, tie_word_embeddings=False,
                      max_position_embeddings=max(8192, a.seq * a.batch), hidden_act="silu",
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(d))
    embed, lm_head, norm, kept = target_weights(a, device)
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": lm_head, "model.norm.weight": norm},
              str(d / "model.safetensors"))
    del embed, lm_head
    t2d = torch.zeros(a.vocab, dtype=torch.bool)
    t2d[kept] = True
    np.save(d / "d2t.npy", (kept - torch.arange(a.draft_vocab)).numpy())
    np.save(d / "t2d.npy", t2d.numpy())


def speculators_rows(a, device, emit, work: Path) -> None:
    import importlib.metadata as md

    import speculators.train.cli as C
    import speculators.train.trainer as TR
    import torch
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.config import TrainConfig
    from speculators.train.data import CollateFn

    version = md.version("speculators")
    cuda = device.type == "cuda"
    if not cuda:  # CPU plumbing, as bench/peers/peer_speculators.py's launcher: its Trainer places on .to(int)
        TR.get_local_rank = lambda: "cpu"
    spec_verifier(a, work, device)
    gen = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(a.batch):  # seq + 1 tokens: shift_batch drops one
        s = sample(a, gen, a.seq + 1)
        samples.append({"hidden_states": s["aux"], "input_ids": s["ids"], "verifier_last_hidden_states": s["last"],
                        "loss_mask": s["mask"], "lengths": torch.tensor([a.seq + 1]), "position_ids": torch.arange(a.seq + 1)})
    failed = {}
    for opt in a.optimizers:
        def build(impl, opt=opt):
            attn, loss_impl = impl
            argv = ["--verifier-name-or-path", str(work), "--speculator-type", "eagle3", "--data-path", str(work),
                    "--d2t-path", str(work / "d2t.npy"), "--t2d-path", str(work / "t2d.npy"),
                    "--draft-vocab-size", str(a.draft_vocab), "--target-layer-ids", *map(str, range(a.n_aux)),
                    "--ttt-steps", str(a.ttt), "--total-seq-len", str(a.batch * a.seq), "--epochs", "1",
                    "--optimizer", opt, "--draft-attn-impl", attn, "--loss-implementation", loss_impl,
                    "--mask-token-id", "0", "--save-path", str(work / "ckpt"), "--no-resume-from-checkpoint"]
            args = argparse.Namespace(**TrainConfig.resolve(argv).flatten())
            d2t, t2d, draft_vocab = C.parse_vocab_mappings(args)
            model_class = SpeculatorModel.registry[args.speculator_type]
            draft = C.build_draft_model(args, model_class, t2d, d2t, draft_vocab)
            train_kwargs, val_kwargs = model_class.get_trainer_kwargs(**vars(args))
            tcfg = TR.TrainerConfig(  # as speculators.train.cli.main builds it
                num_epochs=args.epochs, save_path=args.save_path, lr=args.lr,
                resume_from_checkpoint=not args.no_resume_from_checkpoint, train_call_kwargs=train_kwargs,
                val_call_kwargs=val_kwargs, optimizer=args.optimizer, weight_decay=args.weight_decay,
                muon_lr=args.muon_lr, muon_momentum=args.muon_momentum, muon_weight_decay=args.muon_weight_decay,
                muon_ns_steps=args.muon_ns_steps, muon_adjust_lr_fn=args.muon_adjust_lr_fn,
                scheduler_type=args.scheduler_type, scheduler_warmup_steps=args.scheduler_warmup_steps,
                scheduler_warmup_ratio=args.scheduler_warmup_ratio, scheduler_total_steps=args.scheduler_total_steps,
                scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles, checkpoint_freq=args.checkpoint_freq,
                save_best=args.save_best, hidden_states_dtype=getattr(torch, args.hidden_states_dtype),
                log_freq=args.log_freq, fsdp_shard=args.fsdp_shard, gradient_checkpointing=args.gradient_checkpointing,
                max_steps=args.max_steps)

            class Steps(list):  # the train loader: only its length is read (the LR schedule's horizon)
                batch_sampler = None

            trainer = TR.Trainer(draft, tcfg, Steps([None] * (a.warmup + a.steps)))
            if not cuda:
                trainer.device_type = "cpu"  # it autocasts on "cuda" when no accelerator is found
            batch = CollateFn(a.batch * a.seq, a.hidden, a.n_aux, tcfg.hidden_states_dtype, shift_batch)(samples)
            batch = {k: v.to(trainer.local_rank) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

            def step():  # the body of speculators.train.trainer.Trainer.train_epoch for one batch
                gpu_batch = {k: v.to(trainer.local_rank, non_blocking=True) if isinstance(v, torch.Tensor) else v
                             for k, v in batch.items()}
                with torch.autocast(trainer.device_type, dtype=trainer.config.hidden_states_dtype):
                    _draft_tokens, loss, metrics = trainer.model(**gpu_batch, **(trainer.config.train_call_kwargs or {}))
                trainer._optimizers_zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0)
                metrics["error_records_sum"] = torch.tensor(batch["error_records"], dtype=torch.float32, device=loss.device)
                metrics["error_records_total"] = torch.tensor(1.0, dtype=torch.float32, device=loss.device)
                trainer._optimizers_step()
                trainer._schedulers_step()
                _logged = {k: v.item() for k, v in metrics.items()}  # log_freq=1: every step's metrics come back
                return loss.detach()
            return step, [p for p in trainer.model.parameters() if p.requires_grad]

        label = f"speculators {version} step, " + ("AdamW" if opt == "adamw" else "Muon (its default)")
        row = {"peer": "speculators", "variant": opt, "optimizer": opt, "trainer": label,
               "precision": "fp32 weights, bf16 autocast"}
        try:
            res = run_impls(build, SPEC_IMPLS_CUDA if cuda or a.try_defaults else SPEC_IMPLS_CPU, failed, a, device)
            attn, loss_impl = res.pop("impl")
            row.update(res, attention=attn, loss_impl=loss_impl + (" (fallback)" if res["failed"] else ""))
            if not cuda and not a.try_defaults:
                row["notes"] = ["its defaults not run on CPU: simple_flex_attention (no CPU backward), fused (Triton)"]
        except Exception as e:  # the row says why; the other rows go on
            row["error"] = first_line(e)
        emit(row)


# ---------------------------------------------------------------------------------- specforge
def specforge_version(src: Path) -> str:
    ver = (src / "version.txt").read_text().strip() if (src / "version.txt").exists() else "?"
    commit = (src / "COMMIT").read_text().strip()[:7] if (src / "COMMIT").exists() else ""
    return f"{ver} ({commit})" if commit else ver


def init_one_rank(device) -> None:
    """A one-rank default process group, as torchrun with one process gives SpecForge's Trainer."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def specforge_rows(a, device, emit, work: Path) -> None:
    import specforge
    import specforge.algorithms.eagle3.model as sf_model
    import specforge.core.loss as sf_loss
    import torch
    import torch.distributed as dist
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.config.schema import ModelConfig, TrainingConfig
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.modeling.auto import AutoDraftModel
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import Eagle3TrainStrategy
    from transformers import LlamaConfig

    version = specforge_version(Path(specforge.__file__).resolve().parents[1])
    cuda = device.type == "cuda"
    t = TrainingConfig()  # its defaults: lr, clip, warm-up, schedule, attention, sharding (TTT: --ttt; its default 7)
    dtype = getattr(torch, ModelConfig.model_fields["torch_dtype"].default)
    if not cuda:  # LogSoftmaxLoss is a Triton kernel: its torch form (same file, same math) on CPU
        class TorchLogSoftmaxLoss:
            apply = staticmethod(sf_loss._compute_loss)
        sf_model.LogSoftmaxLoss = TorchLogSoftmaxLoss
    loss_name = "Triton LogSoftmaxLoss" if cuda else "torch _compute_loss (LogSoftmaxLoss is Triton)"
    cfg = LlamaConfig(architectures=["LlamaForCausalLMEagle3"], hidden_size=a.hidden, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, head_dim=a.head_dim, intermediate_size=a.intermediate,
                      vocab_size=a.vocab, num_hidden_layers=1, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      pad_token_id=0, hidden_act="silu", max_position_embeddings=max(2048, a.seq),
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    cfg.draft_vocab_size = a.draft_vocab
    cfg.save_pretrained(str(work))  # TargetHead reads the target's config.json
    embed, lm_head, _, kept = target_weights(a, device)
    t2d = torch.zeros(a.vocab, dtype=torch.bool)
    t2d[kept] = True
    torch.save({"t2d": t2d, "d2t": kept - torch.arange(a.draft_vocab)}, work / "vocab_mapping.pt")
    gen = torch.Generator().manual_seed(1)
    raws = []
    for _ in range(a.batch):
        s = sample(a, gen, a.seq)
        raws.append(normalize_offline_sample({"aux_hidden_state": s["aux"], "hidden_state": s["last"],
                                              "input_ids": s["ids"], "loss_mask": s["mask"]}, max_len=a.seq))
    tensors = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in DataCollatorWithPadding()(raws).items()}
    batch = TrainBatch(sample_ids=[str(i) for i in range(a.batch)], strategy="eagle3", tensors=tensors,
                       metadata={"target_repr": "hidden_state"})
    impls = [t.attention_backend] + (["sdpa"] if t.attention_backend != "sdpa" else [])
    if not cuda and not a.try_defaults:
        impls = ["sdpa"]  # flex_attention: no backward on CPU
    failed = {}
    for mode in ("unwrapped", "fsdp1"):
        label = f"SpecForge {version}, AdamW (BF16Optimizer), " + (
            "unwrapped" if mode == "unwrapped" else f"FSDP1 {t.fsdp_sharding}, 1 rank")
        row = {"peer": "specforge", "variant": mode, "optimizer": "adamw", "trainer": label,
               "precision": f"{ModelConfig.model_fields['torch_dtype'].default} weights, fp32 AdamW masters, no autocast"}
        if mode == "fsdp1" and not cuda:
            row["error"] = "skipped: FSDP1 needs an accelerator (torch: 'FSDP needs a non-CPU accelerator device')"
            emit(row)
            continue
        if mode == "fsdp1" and not dist.is_initialized():
            init_one_rank(device)

        def build(attention, mode=mode):
            draft = AutoDraftModel.from_config(cfg, attention_backend=attention, torch_dtype=dtype)  # build_eagle3_draft
            draft.load_vocab_mapping(str(work / "vocab_mapping.pt"))
            with torch.no_grad():
                draft.embed_tokens.weight.copy_(embed)  # load_embedding from the target
            draft.freeze_embedding()
            draft = draft.to(device=device, dtype=dtype)
            model = sf_model.OnlineEagle3Model(draft_model=draft, length=a.ttt, attention_backend=attention,
                                               lk_loss_type=t.lk_loss_type, kl_scale=t.kl_scale,
                                               kl_decay=t.kl_decay).to(device=device, dtype=dtype)
            head = TargetHead(str(work))
            with torch.no_grad():
                head.fc.weight.copy_(lm_head)
            head.freeze_weights()
            head = head.eval().to(device=device, dtype=torch.bfloat16)

            def optimizer_factory(module):  # its _ConfiguredOptimizerFactory
                return BF16Optimizer(module, lr=t.learning_rate, max_grad_norm=t.max_grad_norm,
                                     warmup_ratio=t.warmup_ratio, lr_scheduler=t.lr_scheduler,
                                     total_steps=a.warmup + a.steps, offload_master=t.optimizer_cpu_offload)
            backend = FSDPTrainingBackend(ParallelConfig.from_distributed(sharding_strategy=t.fsdp_sharding),
                                          optimizer_factory=optimizer_factory)
            wrapped = backend.prepare_model(model, wrap=mode == "fsdp1", optimizer_target=model.draft_model)
            core = TrainerCore(Eagle3TrainStrategy(wrapped, target_head=head, compact_teacher=t.compact_teacher,
                                                   compact_teacher_chunk_size=t.compact_teacher_chunk_size),
                               backend, accumulation_steps=t.accumulation_steps)
            return (lambda: core.train_step(batch).loss), backend.optimizer.fp32_params

        try:
            res = run_impls(build, impls, failed, a, device)
            attention = res.pop("impl")
            row.update(res, attention=attention + (" (fallback)" if res["failed"] else ""), loss_impl=loss_name)
            if not cuda and not a.try_defaults:
                row["notes"] = [f"its default {t.attention_backend} not run on CPU (no CPU backward)"]
        except Exception as e:  # the row says why; the other rows go on
            row["error"] = first_line(e)
        emit(row)
    if dist.is_initialized():
        dist.destroy_process_group()


# -------------------------------------------------------------------------------------- worker
WORKERS = {"eagle3": eagle3_rows, "speculators": speculators_rows, "specforge": specforge_rows}


def worker(peer: str, config: dict, rows_path: str) -> None:
    """One peer's rows, each printed as a JSON line and appended to ``rows_path`` as it is done."""
    import torch

    a = argparse.Namespace(**config)
    device = torch.device(a.device)
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}

    def emit(row: dict) -> None:
        row = {**row, **info}
        print(json.dumps(row), flush=True)
        with open(rows_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    with tempfile.TemporaryDirectory(prefix=f"peer_step_{peer}_") as work:  # a verifier's files, configs
        WORKERS[peer](a, device, emit, Path(work))


def peer_env(peer: str, a) -> dict:
    path = {"speculators": a.spec_path, "specforge": a.specforge_path}.get(peer, "")
    parts = [p for p in (path, str(REPO), os.environ.get("PYTHONPATH", "")) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(parts), TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def run_peer(peer: str, a, config: dict) -> list:
    """The peer's worker subprocess; its rows, plus an error row if it died before writing them all."""
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = os.path.join(tmp, "rows.jsonl")
        Path(rows_path).touch()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", peer, "--config", json.dumps(config),
               "--rows", rows_path]
        tail = collections.deque(maxlen=40)
        t0 = time.time()
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace", env=peer_env(peer, a),
                                cwd=str(REPO), start_new_session=True)  # its own group: a timeout ends its compilers too

        def pass_stderr():  # through to ours; its tail names a crash
            for line in proc.stderr:
                sys.stderr.write(line)
                tail.append(line.rstrip())
        reader = threading.Thread(target=pass_stderr, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=a.timeout or None)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            tail.append(f"killed at --timeout {a.timeout:.0f} s")
        reader.join(timeout=10)
        rows = [json.loads(x) for x in Path(rows_path).read_text().splitlines() if x.strip()]
    if rc != 0:
        last = [x for x in tail if x.strip()][-3:]
        rows.append({"peer": peer, "trainer": f"{peer} worker", "error": f"exit code {rc} after "
                     f"{time.time() - t0:.0f} s: " + " | ".join(last)[-400:]})
    return rows


def fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def table(rows: list) -> str:
    out = ["| trainer | step ms | tokens/s | peak GiB | precision | attention / loss | notes |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['trainer']} | - | - | - | {r.get('precision', '')} | | {r['error'][:300]} |")
            continue
        notes = "; ".join((r.get("failed") or []) + (r.get("notes") or []))
        out.append(f"| {r['trainer']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {fmt(r['peak_gib'], '.2f')} | "
                   f"{r['precision']} | {r['attention']} / {r['loss_impl']} | {notes[:400]} |")
    return "\n".join(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        w = argparse.ArgumentParser()
        w.add_argument("--worker", choices=PEERS)
        w.add_argument("--config", required=True)
        w.add_argument("--rows", required=True)
        wa = w.parse_args(argv)
        return worker(wa.worker, json.loads(wa.config), wa.rows)
    sys.path.insert(0, str(HERE))
    from train import add_shape_args, describe_shape  # bench/train.py: the shape is shared

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--small", action="store_true",
                   help="a small shape for a CPU run (" + ", ".join(f"{k} {v}" for k, v in SMALL.items()) + ")")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated, run in this order")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="adamw, muon (SpecForge has AdamW only)")
    p.add_argument("--eagle3-fp8", action="store_true",
                   help="eagle3's rows also with train.fp8_matmul=on (the layer's matmuls in float8)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (compilation)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--timeout", type=float, default=0, help="seconds per peer's worker (0: none)")
    p.add_argument("--table", nargs="+", metavar="JSON", default=None,
                   help="print one table of the rows of these peer_step.json files (from calls run apart); run nothing")
    p.add_argument("--try-defaults", action="store_true",
                   help="on CPU too, try the peers' default attention/loss first (they fail there: the fallback runs)")
    for peer, (var, default) in DEFAULT_PATHS.items():
        p.add_argument(f"--{'spec' if peer == 'speculators' else peer}-path", default=os.environ.get(var, default),
                       help=f"PYTHONPATH entries that hold {peer} (${var}; default {default})")
    a = p.parse_args(argv)
    if a.table:
        print(table([r for f in a.table for r in json.loads(Path(f).read_text())["rows"]]))
        return
    if a.small:
        for k, v in SMALL.items():
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
    peers = [x for x in a.peers.split(",") if x]
    a.optimizers = [x for x in a.optimizers.split(",") if x]
    if not set(peers) <= set(PEERS) or not set(a.optimizers) <= set(OPTIMIZERS) or not peers or not a.optimizers:
        p.error(f"--peers from {PEERS}, --optimizers from {OPTIMIZERS}")
    if a.device == "auto":
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    config = {k: v for k, v in vars(a).items() if k not in ("peers", "spec_path", "specforge_path", "timeout")}
    out = {"args": vars(a), "shape": describe_shape(a), "rows": []}
    for peer in peers:
        print(f"== {peer}", flush=True)
        out["rows"] += run_peer(peer, a, config)
        if os.environ.get("OUT"):  # after every peer: a cut-off call keeps what finished
            Path(os.environ["OUT"], "peer_step.json").write_text(json.dumps(out, indent=1) + "\n")
    ok = [r for r in out["rows"] if "error" not in r]
    where = f"{ok[0]['device']}, torch {ok[0]['torch']}" if ok else a.device
    text = (f"{where}: {describe_shape(a)} tokens; step = median of {a.steps} steps each timed alone (the host "
            f"waits for its end) after {a.warmup} warm-up steps; the batch on the device; peak = "
            f"max_memory_allocated over the timed steps.\n\n{table(out['rows'])}\n")
    print("\n" + text, end="")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "peer_step.md").write_text(text)


if __name__ == "__main__":
    main()
