"""Resumable checkpoints of the train loop: ``<out>/checkpoints/step-XXXXXXXX/``.

A checkpoint is ``accelerator.save_state``: model, optimizer, RNG states and the objects registered
for checkpointing (the LR scheduler and the LoopState). It is written into a hidden sibling
(``.step-XXXXXXXX.partial``), gets its COMPLETE marker there and is renamed into place, so a
``step-*`` directory is always whole: a save cut short by a kill or a full disk leaves the previous
checkpoints as they were (a full disk is a :class:`CheckpointError` naming the directory, the
bytes needed and the bytes free). The newest ``keep_last`` complete ones are kept, removed only
after the new one is in place. Files get the umask's modes (safetensors writes them owner-only).

Not in a checkpoint: the data position (a pure function of the step number, eagle3/train/data.py,
so a resumed run sees exactly the batches an uninterrupted one would have) and the draft file
(written once, at the end, by eagle3/train/loop.py).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import List, Optional

import torch

from ..artifacts import CHECKPOINT_COMPLETE, CHECKPOINTS_DIR
from ..atomic import apply_umask, atomic_write_text, fsync_dir
from ..errors import Eagle3Error, disk_full
from ..units import fmt_size
from .ttt import STAT_NAMES


class CheckpointError(Eagle3Error):
    """A checkpoint could not be written (a full disk); the previous ones are intact."""


class LoopState:
    """What the loop itself must carry across a resume (registered for checkpointing): the step,
    and the statistics of the metrics window still open at that step (summed over processes)."""

    def __init__(self, num_steps: int):
        self.step = 0
        self.window = torch.zeros(num_steps, len(STAT_NAMES), dtype=torch.float64)
        self.window_tokens = 0

    def state_dict(self):
        return {"step": self.step, "window": self.window.tolist(), "window_tokens": self.window_tokens}

    def load_state_dict(self, d):
        self.step = int(d["step"])
        self.window = torch.tensor(d["window"], dtype=torch.float64)
        self.window_tokens = int(d["window_tokens"])


def complete_checkpoints(out_dir: Path) -> List[Path]:
    """The checkpoints whose save finished, oldest first."""
    d = Path(out_dir) / CHECKPOINTS_DIR
    if not d.exists():
        return []
    return sorted(p for p in d.glob("step-*") if (p / CHECKPOINT_COMPLETE).exists())


def checkpoint_path(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / CHECKPOINTS_DIR / f"step-{step:08d}"


def save_checkpoint(accelerator, out_dir: Path, step: int, keep_last: int) -> Path:
    """Every process takes part (a sharded model saves its own shards); returns the checkpoint's path."""
    path = checkpoint_path(out_dir, step)
    partial = path.with_name(f".{path.name}.partial")
    needed = _bytes_needed(accelerator, out_dir)
    if accelerator.is_main_process:
        for stale in (partial, path):  # a save of this step cut short in an earlier run
            if stale.exists():
                shutil.rmtree(stale)
        partial.parent.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    failure = None
    try:
        accelerator.save_state(str(partial))
    except Exception as e:  # every rank must learn of it before the next collective
        failure = e
    if _any_failed(accelerator, failure):
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        _raise_save_error(failure, partial.parent, step, needed)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        try:
            atomic_write_text(partial / CHECKPOINT_COMPLETE, json.dumps({"step": step}) + "\n")
            apply_umask(partial)
            os.replace(partial, path)
            fsync_dir(path.parent)
        except Exception as e:
            shutil.rmtree(partial, ignore_errors=True)
            _raise_save_error(e, partial.parent, step, needed)
        for old in complete_checkpoints(out_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def _bytes_needed(accelerator, out_dir: Path) -> int:
    """What a checkpoint takes: the last complete one's size, else the tensors it will hold (this
    process's model and optimizer state)."""
    done = complete_checkpoints(out_dir)
    if done:
        return sum(p.stat().st_size for p in done[-1].rglob("*") if p.is_file())

    def tensor_bytes(obj) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size()
        if isinstance(obj, dict):
            return sum(tensor_bytes(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(tensor_bytes(v) for v in obj)
        return 0

    # parameters and optimizer state as held (no state_dict(): under FSDP that would gather shards)
    return sum(tensor_bytes(list(m.parameters())) for m in accelerator._models) + \
        sum(tensor_bytes(list(getattr(o, "optimizer", o).state.values())) for o in accelerator._optimizers)


def _any_failed(accelerator, failure: Optional[BaseException]) -> bool:
    if accelerator.num_processes == 1:
        return failure is not None
    flag = torch.tensor([float(failure is not None)], device=accelerator.device)
    return accelerator.reduce(flag, reduction="sum").item() > 0


def _raise_save_error(e: Optional[BaseException], directory: Path, step: int, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    previous = complete_checkpoints(directory.parent)
    kept = (f"The previous checkpoint {previous[-1]} is intact: a re-run resumes from it." if previous
            else "There is no earlier checkpoint: a re-run starts from step 0.")
    if e is None:  # another process failed
        raise CheckpointError(f"writing the checkpoint of step {step} into {directory} failed on another process. "
                              f"{kept}")
    if disk_full(e) or free < needed:
        raise CheckpointError(
            f"no space left for the checkpoint of step {step} in {directory}: it needs about {needed} bytes "
            f"({fmt_size(needed)}), {free} bytes ({fmt_size(free)}) are free there. {kept} Free space there (or "
            f"lower train.keep_last), then run the same command again.") from e
    raise e


def load_latest_checkpoint(accelerator, state: LoopState, out_dir: Path, fresh: bool = False) -> Optional[Path]:
    """Loads the newest complete checkpoint into the accelerator's objects and ``state``; returns
    its path, or None when there is none (a fresh run). ``fresh`` (the main process's word):
    every checkpoint is removed instead (an earlier attempt's, trained on inputs that are no longer
    these: the manifest's ``StageJob.stale``). The main process cleans up while the others wait, so
    every process then finds the same checkpoints."""
    if accelerator.is_main_process:
        if fresh:
            shutil.rmtree(Path(out_dir) / CHECKPOINTS_DIR, ignore_errors=True)
        for partial in (Path(out_dir) / CHECKPOINTS_DIR).glob(".step-*.partial"):  # saves cut short by a kill
            shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    ckpts = complete_checkpoints(out_dir)
    if not ckpts:
        return None
    accelerator.load_state(str(ckpts[-1]))
    if not accelerator.is_main_process:  # the saved window holds the global sums: count them once
        state.window.zero_()
        state.window_tokens = 0
    return ckpts[-1]
