"""The next step's batch made ready while this step's clipping and optimizer step run.

A training step ends with work that is memory-bound (the gradient norm and fused AdamW: ~4.7 ms of
the 8B draft's ~68 ms step on an H200) and starts with work that needs nothing the step produces:
copying the next batch to the device and the frozen target head over it (a 2 TFLOP matmul over the
full vocabulary: ~3.8 ms). On CUDA, :class:`TargetsAhead` runs the second on a side stream of high
priority, started by an event recorded after the backward, so the two share the GPU instead of
following each other. The numbers are the same: the same kernels on the same inputs, only issued
earlier (tests/test_train.py trains the same model both ways).

In line (no side stream) off CUDA, with ``train.overlap_targets=false``, and for a store whose
items are on the device already (an online colocated producer: they come from another thread's
stream, and the side stream would not wait for it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .data import to_device
from .target_head import TargetHead, model_inputs


@dataclass
class Ready:
    """One optimizer step's micro-batches on the device and, made ahead, the first one's model inputs."""
    batches: list
    first: Optional[dict] = None  # model_inputs of batches[0], computed on the side stream
    done: Optional[torch.cuda.Event] = None  # recorded on the side stream after the copies and the head
    _waited: bool = field(default=False, repr=False)


class TargetsAhead:
    """Copies a step's micro-batches to the device and computes the first one's targets, on a side
    stream after a given event (:meth:`prepare`) or in line (:meth:`inline`); :meth:`inputs` hands
    each micro-batch's model inputs to the current stream."""

    def __init__(self, head: TargetHead, dtype: torch.dtype, device, enabled: bool = True,
                 in_line_ahead: bool = False):
        """``enabled``: on CUDA, a side stream. ``in_line_ahead``: without one (off CUDA), still make
        the next step's batches ready at the point where the side stream would start, in line: the
        loop's order of the ahead path with nothing to overlap (what the CPU tests train with)."""
        self.head, self.dtype, self.device = head, dtype, torch.device(device)
        self.stream = None
        if enabled and self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device, priority=-1)  # its GEMMs before AdamW's blocks
        self.in_line_ahead = enabled and in_line_ahead and self.stream is None

    @property
    def active(self) -> bool:
        """Whether the loop makes each next step's batches ready during this one (:meth:`prepare`)."""
        return self.stream is not None or self.in_line_ahead

    def mark(self) -> Optional[torch.cuda.Event]:
        """An event on the current stream (what :meth:`prepare` waits for); None in line."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def inline(self, host_batches: list) -> Ready:
        """The micro-batches copied on the current stream; their inputs computed when asked for."""
        return Ready([to_device(b, self.device) for b in host_batches])

    def prepare(self, host_batches: list, after: Optional[torch.cuda.Event]) -> Ready:
        """On the side stream, once ``after`` has happened: the copies and the first micro-batch's
        model inputs. In line without a side stream."""
        if self.stream is None:
            ready = self.inline(host_batches)
            if self.in_line_ahead:
                ready.first = model_inputs(self.head, ready.batches[0], self.dtype)
            return ready
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            batches = [to_device(b, self.device) for b in host_batches]
            first = model_inputs(self.head, batches[0], self.dtype)
            done = torch.cuda.Event()
            done.record(self.stream)
        return Ready(batches, first, done)

    def use(self, ready: Ready) -> None:
        """The current stream waits for the side stream's work on ``ready``; its tensors are marked
        as used here, so the caching allocator does not hand their memory to the side stream again
        before this stream is done with them."""
        if ready.done is None or ready._waited:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready.done)
        for d in (*ready.batches, ready.first or {}):
            for v in d.values():
                if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                    v.record_stream(current)
        ready._waited = True

    def inputs(self, ready: Ready, k: int) -> dict:
        """Model inputs of micro-batch ``k`` on the current stream: made ahead, or computed now."""
        self.use(ready)
        if k == 0 and ready.first is not None:
            first, ready.first = ready.first, None  # handed over once: its memory is the step's now
            return first
        return model_inputs(self.head, ready.batches[k], self.dtype)
