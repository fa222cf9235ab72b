"""Resumable checkpoints of the train loop: ``<out>/checkpoints/step-XXXXXXXX/``.

A checkpoint is ``accelerator.save_state``: model, optimizer, RNG states and the objects registered
for checkpointing (the LR scheduler and the LoopState). It counts only once its COMPLETE marker
exists, so a save cut short by a kill is ignored on resume and overwritten; the newest
``keep_last`` complete ones are kept.

Not in a checkpoint: the data position (a pure function of the step number, eagle3/train/data.py,
so a resumed run sees exactly the batches an uninterrupted one would have) and the draft file
(written once, at the end, by eagle3/train/loop.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import List, Optional

import torch

from ..artifacts import CHECKPOINT_COMPLETE, CHECKPOINTS_DIR
from ..atomic import atomic_write_text
from .ttt import STAT_NAMES


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


def save_checkpoint(accelerator, out_dir: Path, step: int, keep_last: int) -> None:
    """Every process takes part (a sharded model saves its own shards)."""
    path = Path(out_dir) / CHECKPOINTS_DIR / f"step-{step:08d}"
    if accelerator.is_main_process and path.exists():
        shutil.rmtree(path)  # an incomplete save of this step from a killed run
    accelerator.wait_for_everyone()
    accelerator.save_state(str(path))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        atomic_write_text(path / CHECKPOINT_COMPLETE, json.dumps({"step": step}) + "\n")
        for old in complete_checkpoints(out_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_latest_checkpoint(accelerator, state: LoopState, out_dir: Path) -> Optional[Path]:
    """Loads the newest complete checkpoint into the accelerator's objects and ``state``; returns
    its path, or None when there is none (a fresh run)."""
    ckpts = complete_checkpoints(out_dir)
    if not ckpts:
        return None
    accelerator.load_state(str(ckpts[-1]))
    if not accelerator.is_main_process:  # the saved window holds the global sums: count them once
        state.window.zero_()
        state.window_tokens = 0
    return ckpts[-1]
