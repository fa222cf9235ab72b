"""The training loop: explicit Accelerate loop around the TTT model.

One optimizer step = ``grad_accum`` micro-batches per process (``accelerator.accumulate``), each
``batch_size`` rows; the loss of every micro-batch is divided by the number of loss positions of
the whole global batch (summed over accumulation steps and processes before the first backward),
so one process and N processes train the same model on the same global batch.

Checkpoints (``accelerator.save_state``: model, optimizer, RNG; plus the LR scheduler and the
loop state: step and the open metrics window) go to ``<out>/checkpoints/step-XXXXXXXX`` and count
only once their ``COMPLETE`` marker exists; the data position of a step is a pure function of the
step number (eagle3/train/data.py), so a resumed run sees exactly the batches an uninterrupted one
would have.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..artifacts import (CHECKPOINT_COMPLETE, CHECKPOINTS_DIR, DRAFT_CONFIG_FILE, DRAFT_FILE,  # noqa: F401
                         METRICS_FILE, VLLM_CONFIG_FILE)
from ..model.draft import Eagle3Draft, Eagle3DraftConfig, draft_config_dict
from .data import MicroBatches, plan_epoch, steps_per_epoch, to_device
from .metrics import JsonlLogger, StepMetrics, peak_flops, ttt_flops_per_token
from .optim import clip_gradients
from .target_head import TargetHead, model_inputs
from .ttt import STAT_NAMES, TTTModel, loss_denominators

log = logging.getLogger("eagle3.train")

CKPT_DIR, COMPLETE = CHECKPOINTS_DIR, CHECKPOINT_COMPLETE


@dataclass
class TrainInputs:
    train_store: Sequence  # items: dicts as eagle3.store.HiddenStates; needs .lengths
    eval_store: Optional[Sequence]
    target: dict  # {'embed': [V,H], 'norm': [H], 'lm_head': [V,H]} (eagle3.target_weights)
    rms_norm_eps: float
    d2t: torch.Tensor
    t2d: torch.Tensor
    draft_config: Eagle3DraftConfig


@dataclass
class TrainResult:
    steps: int
    train: Optional[StepMetrics]  # the last logged window; None if the run resumed at its last step
    eval: Optional[StepMetrics]  # the last eval; None without an eval split (or resumed at its last step)


class LoopState:
    """What the loop itself must carry across a resume (registered for checkpointing)."""

    def __init__(self, num_steps: int):
        self.step = 0
        self.window = torch.zeros(num_steps, len(STAT_NAMES), dtype=torch.float64)  # global sums since last log
        self.window_tokens = 0

    def state_dict(self):
        return {"step": self.step, "window": self.window.tolist(), "window_tokens": self.window_tokens}

    def load_state_dict(self, d):
        self.step = int(d["step"])
        self.window = torch.tensor(d["window"], dtype=torch.float64)
        self.window_tokens = int(d["window_tokens"])


def lr_lambda(warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def _checkpoints(out_dir: Path) -> list:
    d = out_dir / CKPT_DIR
    if not d.exists():
        return []
    return sorted(p for p in d.glob("step-*") if (p / COMPLETE).exists())


class Schedule:
    """Global step -> (epoch, step within epoch); epochs' plans made on demand (lengths only)."""

    def __init__(self, lengths, tcfg, world: int):
        self.lengths, self.tcfg, self.world = lengths, tcfg, world
        self.plans, self.starts = [], [0]

    def plan(self, epoch: int):
        while len(self.plans) <= epoch:
            e = len(self.plans)
            p = plan_epoch(self.lengths, self.tcfg.max_seq_len, self.tcfg.seed, e, self.tcfg.packing)
            n = steps_per_epoch(p, self.tcfg.batch_size, self.tcfg.grad_accum, self.world)
            if n == 0:
                raise ValueError(f"the training split has {len(p.rows)} rows of up to {self.tcfg.max_seq_len} tokens, "
                                 f"fewer than one global batch (batch_size {self.tcfg.batch_size} x grad_accum "
                                 f"{self.tcfg.grad_accum} x {self.world} processes): lower train.batch_size or "
                                 f"train.grad_accum, or extract more samples")
            self.plans.append(p)
            self.starts.append(self.starts[-1] + n)
        return self.plans[epoch]

    def total_steps(self) -> int:
        if self.tcfg.max_steps > 0:
            return self.tcfg.max_steps
        self.plan(self.tcfg.epochs - 1)
        return self.starts[self.tcfg.epochs]

    def locate(self, step: int) -> tuple:
        e = 0
        while True:
            self.plan(e)
            if step < self.starts[e + 1]:
                return e, step - self.starts[e]
            e += 1


def _micro_batch_rows(schedule: Schedule, start: int, total: int, rank: int, tcfg, world: int) -> list:
    rows = []
    for s in range(start, total):
        e, k = schedule.locate(s)
        plan = schedule.plan(e)
        for a in range(tcfg.grad_accum):
            rows.append(plan.micro_batch(k, a, rank, tcfg.batch_size, tcfg.grad_accum, world))
    return rows


def train(tcfg, inputs: TrainInputs, out_dir: Path, tracker: Optional[dict] = None,
          progress: bool = True) -> TrainResult:
    """Train the draft; returns the last metrics, which the stage records as facts.

    ``tracker``: {'project': ..., 'init_kwargs': {...}} for Accelerate's wandb tracker, or None."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, set_seed
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    use_cuda = torch.cuda.is_available()
    mp = tcfg.mixed_precision if tcfg.mixed_precision != "auto" else ("bf16" if use_cuda else "no")
    if not use_cuda:
        from ..cpu import warn_if_slow_bf16

        warn_if_slow_bf16(mp)
    accelerator = Accelerator(mixed_precision=mp, gradient_accumulation_steps=tcfg.grad_accum,
                              log_with="wandb" if tracker else None, project_dir=str(out_dir),
                              kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    device, W, rank = accelerator.device, accelerator.num_processes, accelerator.process_index
    dtype = torch.bfloat16 if mp == "bf16" else torch.float32
    S = tcfg.ttt_steps
    set_seed(tcfg.seed)

    draft_cfg = inputs.draft_config
    draft = Eagle3Draft(draft_cfg)
    draft.set_vocab_mapping(inputs.d2t, inputs.t2d)
    # The vocabulary mapping is an input, not trained state: kept out of the state dict that the
    # loop shards, checkpoints and gathers (Accelerate's FSDP2 loading takes every state-dict entry
    # for a sharded parameter) and written back into the draft at the end.
    vocab_mapping = {name: getattr(draft, name).clone() for name in ("d2t", "t2d")}
    for name in vocab_mapping:
        draft.register_buffer(name, getattr(draft, name), persistent=False)
    head = TargetHead(inputs.target["embed"], inputs.target["norm"], inputs.target["lm_head"],
                      inputs.rms_norm_eps, draft.kept_token_ids.clone())
    if tcfg.model.lm_head_init == "target":
        with torch.no_grad():
            draft.lm_head.weight.copy_(head.kept_lm_head().float())
    # bf16 on CPU too when asked for: the full-vocabulary target head is a third of a CPU step in float32
    head = head.to(device=device, dtype=dtype if use_cuda or mp == "bf16" else head.embed_weight.dtype)
    compile_ = tcfg.compile == "true" or (tcfg.compile == "auto" and device.type == "cuda")
    model = TTTModel(draft, num_steps=S, decay=tcfg.decay, attention=tcfg.attention, compile=compile_)
    head.compile = compile_
    optimizer = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, betas=tuple(tcfg.betas),
                                  weight_decay=tcfg.weight_decay, fused=device.type in ("cuda", "cpu"))
    schedule = Schedule(inputs.train_store.lengths, tcfg, W)
    total = schedule.total_steps()
    # the scheduler is stepped by hand once per optimizer step (Accelerate's prepared scheduler
    # would step once per process and so run N times faster with N processes)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tcfg.warmup_steps, total, tcfg.min_lr_ratio))
    check_fsdp_wrapping(accelerator)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = LoopState(S)
    accelerator.register_for_checkpointing(scheduler, state)

    metrics = JsonlLogger(out_dir / METRICS_FILE)
    ckpts = _checkpoints(out_dir)
    if ckpts:
        accelerator.load_state(str(ckpts[-1]))
        if not accelerator.is_main_process:  # the saved window holds the global sums: count them once
            state.window.zero_()
            state.window_tokens = 0
        log.info("train: resumed from %s (step %d of %d)", ckpts[-1].name, state.step, total)
        if accelerator.is_main_process:
            metrics.truncate_after(state.step)
    elif accelerator.is_main_process and metrics.path.exists():
        metrics.path.unlink()  # a fresh run (no checkpoint): old lines belong to an abandoned attempt
    if tracker:
        accelerator.init_trackers(tracker["project"], config=tracker.get("config"),
                                  init_kwargs={"wandb": tracker.get("init_kwargs", {})})

    pad = 128 if model_backend_is_flex(tcfg, device) else 1
    rows = _micro_batch_rows(schedule, state.step, total, rank, tcfg, W)
    loader = torch.utils.data.DataLoader(MicroBatches(inputs.train_store, rows, tcfg.max_seq_len, pad),
                                         batch_size=None, shuffle=False, num_workers=tcfg.num_workers,
                                         pin_memory=device.type == "cuda")
    batches = iter(loader)
    flops_tok = ttt_flops_per_token(draft_cfg, tcfg.max_seq_len, S, draft_cfg.vocab_size)
    peak = peak_flops(torch.cuda.get_device_name()) if device.type == "cuda" else None

    window = state.window.to(device)
    window_tokens = torch.tensor(float(state.window_tokens), device=device)
    last_train, last_eval, grad_norm = None, None, torch.zeros((), device=device)
    t_window = time.perf_counter()
    bar = tqdm(total=total, initial=state.step, desc="train", disable=not (progress and accelerator.is_local_main_process))
    while state.step < total:
        micro = [next(batches) for _ in range(tcfg.grad_accum)]
        micro = [to_device(b, device) for b in micro]
        den = sum(loss_denominators(b["loss_mask"] * (b["doc_ids"] >= 0), b["doc_ids"], S) for b in micro)
        den = accelerator.reduce(den, reduction="sum") / (W * tcfg.grad_accum)
        for b in micro:
            with accelerator.accumulate(model):
                mi = model_inputs(head, b, dtype)
                with accelerator.autocast():
                    loss, stats = model(**mi, denominators=den)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = clip_gradients(accelerator, model, optimizer, tcfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            window += stats.detach()
            window_tokens += b["num_tokens"]
        lr_used = scheduler.get_last_lr()[0]  # the rate this step's update used
        scheduler.step()
        state.step += 1
        bar.update(1)
        step = state.step
        if step % tcfg.log_every == 0 or step == total:
            g_window = accelerator.reduce(window, reduction="sum")
            g_tokens = float(accelerator.reduce(window_tokens, reduction="sum"))
            elapsed = time.perf_counter() - t_window
            last_train = StepMetrics.from_stats(g_window, tcfg.decay)
            record = last_train.to_log("train")
            record.update(step=step, epoch=schedule.locate(step - 1)[0], lr=lr_used,
                          grad_norm=float(grad_norm), tokens=g_tokens, tokens_per_s=g_tokens / max(elapsed, 1e-9))
            if device.type == "cuda":
                record["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                if peak:
                    record["mfu"] = flops_tok * record["tokens_per_s"] / (peak * W)
            if accelerator.is_main_process:
                metrics.log(record)
            accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)
            bar.set_postfix(loss=f"{record['train/loss']:.3f}", acc0=f"{record['train/acc_step_0']:.3f}")
            window.zero_()
            window_tokens.zero_()
            t_window = time.perf_counter()
        if inputs.eval_store is not None and (step % tcfg.eval_every == 0 or step == total):
            last_eval = evaluate(model, head, inputs.eval_store, tcfg, accelerator, dtype, pad)
            record = {**last_eval.to_log("eval"), "step": step}
            if accelerator.is_main_process:
                metrics.log(record)
            accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)
        if step % tcfg.save_every == 0 or step == total:
            state.window = accelerator.reduce(window, reduction="sum").cpu()
            state.window_tokens = int(accelerator.reduce(window_tokens, reduction="sum"))
            _save(accelerator, out_dir, step, tcfg.keep_last)
    bar.close()

    accelerator.wait_for_everyone()
    result = TrainResult(steps=total, train=last_train, eval=last_eval)
    full_state = accelerator.get_state_dict(model)  # all ranks take part (FSDP gathers the shards)
    if accelerator.is_main_process:
        _write_draft({**full_state, **{f"draft.{k}": v for k, v in vocab_mapping.items()}}, draft_cfg, out_dir)
    accelerator.end_training()
    return result


def check_fsdp_wrapping(accelerator) -> None:
    """FSDP must shard the draft as one unit (auto wrap policy NO_WRAP, Accelerate's default).

    The TTT forward reads the layer's weights directly (packed, cast once per step) instead of
    calling each submodule's forward, and FSDP gathers a separately wrapped submodule's shards only
    inside that submodule's forward: they would arrive sharded. The draft is one decoder layer, so
    one unit costs nothing: its parameters and optimizer state are still sharded across ranks."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP:
        return
    policy = getattr(accelerator.state.fsdp_plugin, "auto_wrap_policy", None)
    if policy is not None:
        name = getattr(getattr(policy, "func", policy), "__name__", str(policy))
        raise ValueError(f"FSDP auto wrap policy {name!r}: the draft must be wrapped as one unit; set "
                         "fsdp_auto_wrap_policy: NO_WRAP in the accelerate config (or --fsdp_auto_wrap_policy "
                         "NO_WRAP), the TTT forward reads the layer's weights outside the submodules' forward")


def model_backend_is_flex(tcfg, device) -> bool:
    from .attention import resolve_backend

    return resolve_backend(tcfg.attention, device) == "flex"


@torch.no_grad()
def evaluate(model, head, store, tcfg, accelerator, dtype, pad: int) -> StepMetrics:
    """Loss/accuracy/acceptance on a held-out split (every row once, shared over processes)."""
    W, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    plan = plan_epoch(store.lengths, tcfg.max_seq_len, tcfg.seed, 0, tcfg.packing, shuffle=False)
    rows = plan.rows[rank::W]
    S = tcfg.ttt_steps
    total = torch.zeros(S, len(STAT_NAMES), dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    ds = MicroBatches(store, [rows[i:i + tcfg.batch_size] for i in range(0, len(rows), tcfg.batch_size)],
                      tcfg.max_seq_len, pad)
    for k in range(len(ds)):
        b = to_device(ds[k], device)
        mi = model_inputs(head, b, dtype)
        with accelerator.autocast():
            _, stats = model(**mi)
        total += stats
    model.train(was_training)
    return StepMetrics.from_stats(accelerator.reduce(total, reduction="sum"), tcfg.decay)


def _save(accelerator, out_dir: Path, step: int, keep_last: int) -> None:
    ckpt_root = out_dir / CKPT_DIR
    path = ckpt_root / f"step-{step:08d}"
    if accelerator.is_main_process and path.exists():
        shutil.rmtree(path)  # an incomplete save of this step from a killed run
    accelerator.wait_for_everyone()
    accelerator.save_state(str(path))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (path / COMPLETE).write_text(json.dumps({"step": step}) + "\n")
        for old in _checkpoints(out_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def _write_draft(model_state: dict, cfg: Eagle3DraftConfig, out_dir: Path) -> None:
    """draft.safetensors under vLLM's names (float32 master weights; export casts), and configs."""
    from safetensors.torch import save_file

    state = {k[len("draft."):]: v.detach().cpu().contiguous() for k, v in model_state.items()
             if k.startswith("draft.")}
    with torch.device("meta"):
        expected = set(Eagle3Draft(cfg).state_dict())
    if set(state) != expected:
        raise RuntimeError(f"the trained state does not have the draft's tensors: missing "
                           f"{sorted(expected - set(state))[:5]}, unexpected {sorted(set(state) - expected)[:5]}")
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    tmp = out_dir / (DRAFT_FILE + ".tmp")
    save_file(state, str(tmp))
    tmp.replace(out_dir / DRAFT_FILE)
    (out_dir / DRAFT_CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    (out_dir / VLLM_CONFIG_FILE).write_text(json.dumps(draft_config_dict(cfg), indent=2) + "\n")
