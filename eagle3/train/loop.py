"""The training loop: ``train()``, an explicit Accelerate loop around the TTT model.

``train()`` reads as its phases: :func:`_set_up` (accelerator, draft and target head, optimizer and
LR schedule, resume: eagle3/train/checkpoint.py), :func:`_loader` and :func:`_logs` (the batches, the
progress bar and metrics sinks), :func:`_steps` (a loop whose body calls one helper per concern: an
optimizer step, logging the metrics window, eval, a checkpoint) and :func:`_finish`, which writes the
draft (``draft.safetensors`` and its configs); it returns the last metrics as a :class:`TrainResult`.

One optimizer step = ``grad_accum`` micro-batches per process (``accelerator.accumulate``), each
``batch_size`` rows; the loss of every micro-batch is divided by the number of loss positions of
the whole global batch (summed over accumulation steps and processes before the first backward),
so one process and N processes train the same model on the same global batch.

What the step computes is elsewhere: the TTT forward and loss (ttt.py), the targets
(target_head.py), the batches and their order (data.py), clipping and the schedule (optim.py).
"""
from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..artifacts import DRAFT_CONFIG_FILE, DRAFT_FILE, METRICS_FILE, VLLM_CONFIG_FILE
from ..atomic import atomic_write_bytes, atomic_write_text
from ..interrupt import Interrupted, StopRequests, ignore_stop_signals
from ..model.draft import Eagle3Draft, Eagle3DraftConfig, draft_config_dict
from .attention import resolve_backend
from .checkpoint import LoopState, complete_checkpoints, load_latest_checkpoint, save_checkpoint
from .data import DeviceCopies, Epochs, MicroBatches, Prefetcher, epoch_order, to_device
from .inductor import restore_compile_threads
from .metrics import JsonlLogger, StepMetrics, peak_flops, step_metrics, ttt_flops_per_token
from .optim import build_optimizer, check_optimizer_distribution, clip_gradients, compiles, lr_schedule
from .source import HiddenStateSource, SourceStalled, check_source
from .target_head import InVocabCache, TargetHead, model_inputs
from .ttt import FLEX_BLOCK, STAT_NAMES, TTTModel, loss_denominators

log = logging.getLogger("eagle3.train")

SYNC_LOGS = False
"""Write each logged window before the next step, waiting for the GPU (what the loop did before its
logs were deferred: bench/results/loop_logs_h200_202612.md compares the two; tests/gpu/test_loop_gpu.py
holds them equal). Not a setting: the default never waits."""


@dataclass
class TrainInputs:
    train_store: HiddenStateSource  # a store on disk or an online source (eagle3/train/source.py)
    eval_store: Optional[HiddenStateSource]
    target: dict  # {'embed': [V,H], 'norm': [H], 'lm_head': [V,H]} (eagle3.target_weights)
    rms_norm_eps: float
    d2t: torch.Tensor
    t2d: torch.Tensor
    draft_config: Eagle3DraftConfig

    def __post_init__(self):
        check_source(self.train_store, "training split")
        if self.eval_store is not None:
            check_source(self.eval_store, "held-out split")


@dataclass
class TrainResult:
    steps: int
    train: Optional[StepMetrics]  # the last logged window; None if the run resumed at its last step
    eval: Optional[StepMetrics]  # the last eval; None without an eval split (or resumed at its last step)
    mixed_precision: Optional[str] = None  # what train.mixed_precision resolved to: "bf16" | "no"


def train(tcfg, inputs: TrainInputs, out_dir: Path, log_fn: Optional[Callable[[dict, int], None]] = None,
          progress: bool = True, prefetch: Optional[bool] = None, fresh: bool = False) -> TrainResult:
    """Train the draft; returns the last metrics, which the stage records as facts.

    ``log_fn(numbers, step)``: where the main process sends every logged window and eval besides
    metrics.jsonl (the stage job's wandb run: ``StageJob.log``), or None. ``prefetch``: read and
    collate the batches in a background thread (:class:`~eagle3.train.data.Prefetcher`); None =
    on a GPU with ``train.num_workers=0`` (on a CPU the thread would take cores from the step).
    ``fresh``: from step 0, the checkpoints in ``out_dir`` removed (an earlier attempt's, made from
    other inputs), instead of resuming from the latest."""
    run = _set_up(tcfg, inputs, Path(out_dir), fresh)
    loader = _loader(run)
    window = Window(run.state, run.device)
    cache = _in_vocab_cache(tcfg, inputs, run.epochs, run.state.step, run.total, run.head, run.device)
    logs = _logs(run, log_fn, progress)
    if prefetch is None:
        prefetch = run.device.type == "cuda" and tcfg.num_workers == 0
    prefetcher = Prefetcher(loader, device=run.device) if prefetch else None
    batches = prefetcher if prefetch else iter(loader)
    if run.device.type == "cuda":  # each batch's copy to the GPU beside the step before it
        batches = DeviceCopies(batches, run.device)
    try:
        last_eval = _steps(run, batches, window, cache, logs)
    finally:
        if prefetcher is not None:
            prefetcher.close()
    logs.flush(wait=True)
    logs.bar.close()
    if cache is not None:
        log.info("train: the target head took in_vocab from its cache for %d of %d micro-batches (the others "
                 "were a sample's first pass)", cache.hits, cache.hits + cache.misses)
    _finish(run)
    return TrainResult(steps=run.total, train=logs.last, eval=last_eval,
                       mixed_precision="bf16" if run.dtype == torch.bfloat16 else "no")


# -- the phases of train() -----------------------------------------------------------------------

@dataclass
class _Run:
    """What train()'s phases share: the setup, and the loop state the checkpoints carry."""
    tcfg: Any
    inputs: TrainInputs
    out_dir: Path
    accelerator: Any
    dtype: torch.dtype
    model: Any  # the TTT model, as Accelerate prepared it
    head: TargetHead
    optimizer: Any
    scheduler: Any
    state: LoopState
    epochs: Epochs
    total: int
    metrics: JsonlLogger
    resumed: Optional[Path]
    vocab_mapping: dict
    compile: bool
    pad: int

    @property
    def device(self):
        return self.accelerator.device


def _set_up(tcfg, inputs: TrainInputs, out_dir: Path, fresh: bool) -> _Run:
    """The accelerator, the draft and target head, the TTT model, the optimizer and its schedule,
    prepared by Accelerate; then the latest checkpoint loaded (unless ``fresh``) and metrics.jsonl
    cut to it."""
    from accelerate.utils import set_seed

    accelerator, mp = _accelerator(tcfg, out_dir)
    device, W, S = accelerator.device, accelerator.num_processes, tcfg.ttt_steps
    dtype = torch.bfloat16 if mp == "bf16" else torch.float32
    set_seed(tcfg.seed)
    # the target head in the compute dtype, but as read on a CPU without mixed precision (bf16 on
    # CPU too when asked for: the full-vocabulary target head is a third of a CPU step in float32)
    head_dtype = dtype if torch.cuda.is_available() or mp == "bf16" else None
    draft, head, vocab_mapping = _draft_and_head(tcfg, inputs, device, head_dtype)
    compile_ = compiles(tcfg, device)
    if compile_:
        restore_compile_threads()  # vLLM's TORCHINDUCTOR_COMPILE_THREADS=1, where it ran in this process
    model = TTTModel(draft, num_steps=S, decay=tcfg.decay, attention=tcfg.attention, compile=compile_,
                     head_loss=tcfg.head_loss, fp8_matmul=tcfg.fp8_matmul)
    head.compile = compile_
    check_optimizer_distribution(accelerator, tcfg)
    # train.optimizer: AdamW, or Muon + AdamW
    optimizer = build_optimizer(model, tcfg, device, sharded=_fsdp(accelerator))
    epochs = Epochs(inputs.train_store.lengths, tcfg, W)
    total = epochs.total_steps()
    scheduler = lr_schedule(optimizer, tcfg, total)
    check_fsdp_wrapping(accelerator)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = LoopState(S)
    accelerator.register_for_checkpointing(scheduler, state)

    metrics = JsonlLogger(out_dir / METRICS_FILE)
    resumed = load_latest_checkpoint(accelerator, state, out_dir, fresh=fresh)
    if resumed:
        log.info("train: resumed from %s (step %d of %d)", resumed.name, state.step, total)
    if accelerator.is_main_process:
        if resumed:
            metrics.truncate_after(state.step)
        else:  # a fresh run: old lines belong to an abandoned attempt
            metrics.path.unlink(missing_ok=True)
    pad = FLEX_BLOCK if resolve_backend(tcfg.attention, device) == "flex" else 1
    return _Run(tcfg, inputs, out_dir, accelerator, dtype, model, head, optimizer, scheduler, state, epochs, total,
                metrics, resumed, vocab_mapping, compile_, pad)


def _loader(run: _Run):
    """The DataLoader of this process's micro-batches from the current step on (the source told
    what it will be asked for)."""
    tcfg, store, device = run.tcfg, run.inputs.train_store, run.device
    order = run.epochs.micro_batches(run.state.step, run.total, run.accelerator.process_index)
    store.expect(order)  # an online source computes what it will be asked for
    # host batches go to the GPU from pinned memory (async copies): collated straight into it in
    # this process, or pinned by the DataLoader after its worker processes; an online colocated
    # store's items are on the GPU already
    pin = device.type == "cuda" and not store.on_device
    return torch.utils.data.DataLoader(
        MicroBatches(store, order, tcfg.max_seq_len, run.pad, pin=pin and tcfg.num_workers == 0,
                     head_rows_steps=tcfg.ttt_steps if tcfg.loss_rows_only else None),
        batch_size=None, shuffle=False, num_workers=tcfg.num_workers, pin_memory=pin and tcfg.num_workers > 0,
        worker_init_fn=ignore_stop_signals if tcfg.num_workers else None)


def _logs(run: _Run, log_fn, progress: bool) -> "Logs":
    """The progress bar and the logged windows' sinks (metrics.jsonl, ``log_fn``)."""
    from tqdm.auto import tqdm

    tcfg = run.tcfg
    flops_per_token = ttt_flops_per_token(run.inputs.draft_config, tcfg.max_seq_len, tcfg.ttt_steps,
                                          run.inputs.draft_config.vocab_size)
    bar = tqdm(total=run.total, initial=run.state.step, desc="train",
               disable=not (progress and run.accelerator.is_local_main_process))
    return Logs(run.accelerator, (run.metrics, log_fn), bar, tcfg.decay, flops_per_token)


def _steps(run: _Run, batches, window: "Window", cache, logs: "Logs") -> Optional[StepMetrics]:
    """The optimizer steps up to the last, each followed by its logged window, eval and checkpoint
    when due; a stop request saves a checkpoint and raises Interrupted, a stalled source saves one
    between steps and re-raises. Returns the last eval."""
    tcfg, accelerator, state, total = run.tcfg, run.accelerator, run.state, run.total
    W, last_eval = accelerator.num_processes, None
    first = state.step + 1
    if run.compile and state.step < total and accelerator.is_main_process:
        import torch._inductor.config as inductor_config

        log.info("train: compiling the training step (torch.compile, %d compile threads); the first step waits "
                 "for it", inductor_config.compile_threads)
    t_first = time.perf_counter()
    saved_step = state.step if run.resumed else -1  # the step whose checkpoint is on disk
    between_steps = True  # nothing of the next step done yet (a checkpoint now is the last step's state)
    try:
        # SIGTERM / SIGINT: finish the step, save a checkpoint, raise Interrupted
        with StopRequests() as stop:
            while state.step < total:
                between_steps = True
                micro = [next(batches) for _ in range(tcfg.grad_accum)]
                between_steps = False
                lr = run.scheduler.get_last_lr()[0]  # the rate this step's update uses
                grad_norm = _optimizer_step(accelerator, run.model, run.optimizer, run.head, micro, window, tcfg,
                                            run.dtype, cache)
                if isinstance(batches, DeviceCopies) and state.step + 1 < total:
                    batches.ahead(tcfg.grad_accum)  # the next step's copies, beside this step's work
                run.scheduler.step()
                state.step += 1
                logs.bar.update(1)
                step = state.step
                if step == first and run.compile and accelerator.is_main_process:
                    float(grad_norm)  # the first step done on the device (one sync, once)
                    log.info("train: first step done in %.1f s, compilation included", time.perf_counter() - t_first)
                if step % tcfg.log_every == 0 or step == total:
                    logs.add(window.close(accelerator, grad_norm, step=step, epoch=run.epochs.locate(step - 1)[0], lr=lr))
                logs.flush(wait=SYNC_LOGS)
                if run.inputs.eval_store is not None and (step % tcfg.eval_every == 0 or step == total):
                    logs.flush(wait=True)
                    last_eval = evaluate(run.model, run.head, run.inputs.eval_store, tcfg, accelerator, run.dtype,
                                         run.pad)
                    _log(accelerator, logs.sinks, {**last_eval.to_log("eval"), "step": step})
                saved = step % tcfg.save_every == 0 or step == total
                if saved:
                    logs.flush(wait=True)
                    path = _checkpoint(accelerator, state, window, run.out_dir, tcfg.keep_last, run.metrics)
                    saved_step = step
                # several processes agree at logged steps only (a collective), one process at every step
                if step < total and (W == 1 or step % tcfg.log_every == 0) and (signum := stop.requested(accelerator)):
                    if not saved:
                        logs.flush(wait=True)
                        path = _checkpoint(accelerator, state, window, run.out_dir, tcfg.keep_last, run.metrics)
                    raise Interrupted(signum, f"train: interrupted by {signal.Signals(signum).name} at step {step} of "
                                              f"{total}; checkpoint saved in {path}. Run the same command again to "
                                              f"resume from step {step}.")
    except SourceStalled as e:
        _stalled(e, accelerator, state, window, logs, run.metrics, run.out_dir, tcfg.keep_last, total,
                 save=between_steps and state.step != saved_step)
        raise
    return last_eval


def _finish(run: _Run) -> None:
    """The trained draft written by the main process, with its vocabulary mapping (every process
    takes part in gathering it)."""
    accelerator = run.accelerator
    accelerator.wait_for_everyone()
    full_state = accelerator.get_state_dict(run.model)  # all ranks take part (FSDP gathers the shards)
    if accelerator.is_main_process:
        _write_draft({**full_state, **{f"draft.{k}": v for k, v in run.vocab_mapping.items()}},
                     run.inputs.draft_config, run.out_dir)
    accelerator.end_training()


# -- setup ---------------------------------------------------------------------------------------

def _accelerator(tcfg, out_dir: Path):
    """(Accelerator, its mixed-precision mode): train.mixed_precision (eagle3.cpu.resolve_precision)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from ..cpu import resolve_precision

    use_cuda = torch.cuda.is_available()
    mp = resolve_precision(tcfg.mixed_precision, use_cuda)
    if not use_cuda:
        from ..cpu import warn_if_slow_bf16

        warn_if_slow_bf16(mp)
    accelerator = Accelerator(mixed_precision=mp, gradient_accumulation_steps=tcfg.grad_accum,
                              project_dir=str(out_dir),
                              kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    return accelerator, mp


def _draft_and_head(tcfg, inputs: TrainInputs, device, head_dtype: Optional[torch.dtype]):
    """(draft, target head on ``device`` in ``head_dtype`` (None: as given), the draft's vocabulary
    mapping). The draft's lm_head starts as the target's kept rows if train.model.lm_head_init=target."""
    draft = Eagle3Draft(inputs.draft_config)
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
    head = head.to(device=device, dtype=head_dtype or head.embed_weight.dtype)
    return draft, head, vocab_mapping


def _fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


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


# -- the loop body's parts -----------------------------------------------------------------------

class Window:
    """This process's TTT statistics and token count since the last logged step, summed on the
    device (read back only when logged or checkpointed, not every step). Its time runs on the
    device's clock (CUDA events on the compute stream) where the device is a GPU: a window's
    length is then what the GPU took for its steps, idle gaps included, and closing it needs no
    wait for the GPU (:meth:`close`)."""

    def __init__(self, state: LoopState, device):
        self.stats = state.window.to(device)
        self.tokens = torch.tensor(float(state.window_tokens), device=device)
        self.cuda = torch.device(device).type == "cuda"
        self.started = self._now()

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, stats: torch.Tensor, num_tokens: torch.Tensor) -> None:
        self.stats += stats.detach()
        self.tokens += num_tokens

    def global_sums(self, accelerator):
        """(statistics summed over all processes, token count likewise as a float)."""
        return (accelerator.reduce(self.stats, reduction="sum"),
                float(accelerator.reduce(self.tokens, reduction="sum")))

    def close(self, accelerator, grad_norm: torch.Tensor, **fields) -> "ClosedWindow":
        """The window's global sums, the gradient norm and its time span as a :class:`ClosedWindow`
        whose numbers arrive from the device without the host waiting (copies into pinned memory
        behind the step's work); starts the next window."""
        values = [accelerator.reduce(self.stats, reduction="sum"), accelerator.reduce(self.tokens, reduction="sum"),
                  torch.as_tensor(grad_norm, device=self.stats.device).detach().float().reshape(())]
        if self.cuda:
            values = [torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True) for v in values]
        else:
            values = [v.clone() for v in values]
        end = self._now()
        closed = ClosedWindow(values, self.started, end, fields,
                              torch.cuda.max_memory_allocated(self.stats.device) / 2**30 if self.cuda else None)
        self.stats.zero_()
        self.tokens.zero_()
        self.started = end
        return closed


@dataclass
class ClosedWindow:
    """A logged window whose numbers are on their way to the host: ``values`` (statistics [S, n],
    tokens, gradient norm) are valid once ``end`` (a CUDA event behind their copies; a host time
    on CPU) has passed on the device."""
    values: list
    start: object
    end: object
    fields: dict
    peak_mem_gib: Optional[float]

    def ready(self) -> bool:
        return not isinstance(self.end, torch.cuda.Event) or self.end.query()

    def record(self, decay: float, flops_per_token: float, num_processes: int) -> tuple:
        """(the metrics.jsonl record, StepMetrics); waits for the device where it is not ready."""
        if isinstance(self.end, torch.cuda.Event):
            self.end.synchronize()
            elapsed = self.start.elapsed_time(self.end) / 1e3
        else:
            elapsed = self.end - self.start
        stats, tokens, grad_norm = self.values
        result = step_metrics(stats, decay)
        tokens = float(tokens)
        record = {**result.to_log("train"), **self.fields, "grad_norm": float(grad_norm), "tokens": tokens,
                  "tokens_per_s": tokens / max(elapsed, 1e-9)}
        if self.peak_mem_gib is not None:
            record["peak_mem_gib"] = self.peak_mem_gib
            peak = peak_flops(torch.cuda.get_device_name())
            if peak:
                record["mfu"] = flops_per_token * record["tokens_per_s"] / (peak * num_processes)
        return record, result


class Logs:
    """The logged windows not yet written: :meth:`flush` writes (metrics.jsonl, ``log_fn``, the
    progress bar) those whose numbers have arrived, in order, without waiting, or all of them
    (``wait=True``: before an eval, a checkpoint, the end). So the loop never stops the GPU's queue
    to log: the host keeps issuing steps while a window's numbers travel."""

    def __init__(self, accelerator, sinks: tuple, bar, decay: float, flops_per_token: float):
        self.accelerator, self.sinks, self.bar = accelerator, sinks, bar
        self.decay, self.flops_per_token = decay, flops_per_token
        self.pending: list = []
        self.last: Optional[StepMetrics] = None

    def add(self, window: ClosedWindow) -> None:
        self.pending.append(window)

    def flush(self, wait: bool = False) -> None:
        while self.pending and (wait or self.pending[0].ready()):
            record, result = self.pending.pop(0).record(self.decay, self.flops_per_token,
                                                        self.accelerator.num_processes)
            _log(self.accelerator, self.sinks, record)
            self.bar.set_postfix(loss=f"{result.loss:.3f}", acc0=f"{result.acc_per_step[0]:.3f}")
            self.last = result


def _in_vocab_cache(tcfg, inputs: TrainInputs, epochs: Epochs, start: int, total: int, head: TargetHead,
                    device) -> Optional[InVocabCache]:
    """train.target_cache: an :class:`InVocabCache` when the steps left visit a sample twice (they
    span more than one epoch) and the draft vocabulary is not the whole vocabulary; else None."""
    if not tcfg.target_cache or start >= total or head.draft_vocab_size == head.vocab_size:
        return None
    if epochs.locate(total - 1)[0] == epochs.locate(start)[0]:
        return None
    cache = InVocabCache(inputs.train_store.lengths, tcfg.max_seq_len, device)
    log.info("train: caching the target head's in_vocab bit per token (%.1f MB on %s, train.target_cache): from "
             "a sample's second epoch on, the lm_head's %d rows outside the draft vocabulary are skipped",
             cache.nbytes / 2**20, device, head.vocab_size - head.draft_vocab_size)
    return cache


def _optimizer_step(accelerator, model, optimizer, head: TargetHead, micro: list, window: Window, tcfg,
                    dtype: torch.dtype, cache: Optional[InVocabCache] = None) -> torch.Tensor:
    """One optimizer step over this process's micro-batches: forward and backward of each, then
    clip and step on the last; returns the gradient norm before clipping."""
    micro = [to_device(b, accelerator.device) for b in micro]
    # the loss positions of the global batch (padding, negative doc ids, has none), known before the
    # first backward; scaled down by what Accelerate (1/grad_accum per micro-batch) and DDP (mean
    # over processes) divide the gradients by, so that the step's gradient is the global batch's
    den = sum(loss_denominators(b["loss_mask"] * (b["doc_ids"] >= 0), b["doc_ids"], tcfg.ttt_steps) for b in micro)
    den = accelerator.reduce(den, reduction="sum") / (accelerator.num_processes * tcfg.grad_accum)
    grad_norm = None
    for b in micro:
        with accelerator.accumulate(model):
            mi = model_inputs(head, b, dtype, cache)  # outside autocast: the target head keeps its own dtype
            with accelerator.autocast():
                loss, stats = model(**mi, denominators=den)
            accelerator.backward(loss)
            if accelerator.sync_gradients:  # the step's last micro-batch
                grad_norm = clip_gradients(accelerator, model, optimizer, tcfg.grad_clip)
            optimizer.step()  # skipped by Accelerate until then
            optimizer.zero_grad(set_to_none=True)
        window.add(stats, b["num_tokens"])
    return grad_norm


def _log(accelerator, sinks: tuple, record: dict) -> None:
    """One metrics.jsonl line and the same numbers to ``log_fn`` (the main process only);
    ``sinks`` = (JsonlLogger, log_fn or None)."""
    metrics, log_fn = sinks
    if not accelerator.is_main_process:
        return
    metrics.log(record)
    if log_fn is not None:
        log_fn({k: v for k, v in record.items() if isinstance(v, (int, float))}, record["step"])


@torch.no_grad()
def evaluate(model, head, store: HiddenStateSource, tcfg, accelerator, dtype, pad: int) -> StepMetrics:
    """Loss/accuracy/acceptance on a held-out split (every row once, shared over processes)."""
    W, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    rows = epoch_order(store.lengths, tcfg.max_seq_len, tcfg.seed, 0, tcfg.packing, shuffle=False).rows[rank::W]
    total = torch.zeros(tcfg.ttt_steps, len(STAT_NAMES), dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    ds = MicroBatches(store, [rows[i:i + tcfg.batch_size] for i in range(0, len(rows), tcfg.batch_size)],
                      tcfg.max_seq_len, pad, head_rows_steps=tcfg.ttt_steps if tcfg.loss_rows_only
                      else None)
    for k in range(len(ds)):
        b = to_device(ds[k], device)
        mi = model_inputs(head, b, dtype)
        with accelerator.autocast():
            _, stats = model(**mi)
        total += stats
    model.train(was_training)
    return step_metrics(accelerator.reduce(total, reduction="sum"), tcfg.decay)


def _checkpoint(accelerator, state: LoopState, window: Window, out_dir: Path, keep_last: int,
                metrics: Optional[JsonlLogger] = None) -> Path:
    """A checkpoint of this step, with the open window's global sums (a resumed run logs the same
    window an uninterrupted one does); returns its path. metrics.jsonl's lines so far are on disk
    first (fsync): a resumed run keeps those up to its step and logs the rest again."""
    if metrics is not None and accelerator.is_main_process:
        metrics.sync()
    stats, tokens = window.global_sums(accelerator)
    state.window, state.window_tokens = stats.cpu(), int(tokens)
    return save_checkpoint(accelerator, out_dir, state.step, keep_last)


def _stalled(e: SourceStalled, accelerator, state: LoopState, window: Window, logs, metrics, out_dir: Path,
             keep_last: int, total: int, save: bool) -> None:
    """The hidden-state source gave up waiting: ``e``'s message gets which step the same command
    resumes from. ``save`` (between two steps, that step not saved yet): the state of the last
    completed step is saved first. A trainer of several processes does not save: the others are in
    a collective of the next step, which a save (every rank takes part) would meet."""
    again = "run the same command again once the producer runs"
    why = ""
    if save and state.step > 0:
        if accelerator.num_processes == 1:
            try:
                logs.flush(wait=True)
                path = _checkpoint(accelerator, state, window, out_dir, keep_last, metrics)
                resume = (f"Checkpoint of step {state.step} of {total} saved in {path}: {again}, and training "
                          f"resumes from step {state.step}")
                e.args = (f"{e.args[0] if e.args else e}. {resume}",) + tuple(e.args[1:])
                return
            except Exception as err:  # the stall is the error to report; the save's failure is said beside it
                why = f" (its checkpoint could not be saved: {err})"
        else:
            why = f" (not saved: {accelerator.num_processes} processes save at train.save_every steps only)"
    done = complete_checkpoints(out_dir)
    if done:
        resume = (f"Stopped at step {state.step} of {total}{why}: {again}, and training resumes from the last "
                  f"checkpoint, {done[-1]}")
    else:
        resume = f"Stopped at step {state.step} of {total}{why}, with no checkpoint yet: {again} to start over"
    e.args = (f"{e.args[0] if e.args else e}. {resume}",) + tuple(e.args[1:])


# -- the result ----------------------------------------------------------------------------------

def _write_draft(model_state: dict, cfg: Eagle3DraftConfig, out_dir: Path) -> None:
    """draft.safetensors under vLLM's names (float32 master weights; export casts), and configs."""
    state = {k[len("draft."):]: v.detach().cpu().contiguous() for k, v in model_state.items()
             if k.startswith("draft.")}
    with torch.device("meta"):
        expected = set(Eagle3Draft(cfg).state_dict())
    if set(state) != expected:
        raise RuntimeError(f"the trained state does not have the draft's tensors: missing "
                           f"{sorted(expected - set(state))[:5]}, unexpected {sorted(set(state) - expected)[:5]}")
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    from safetensors.torch import save

    # configs first, the weights last: a draft.safetensors that exists comes with its configs
    atomic_write_text(out_dir / DRAFT_CONFIG_FILE, json.dumps(cfg.to_dict(), indent=2) + "\n")
    atomic_write_text(out_dir / VLLM_CONFIG_FILE, json.dumps(draft_config_dict(cfg), indent=2) + "\n")
    atomic_write_bytes(out_dir / DRAFT_FILE, save(state))
