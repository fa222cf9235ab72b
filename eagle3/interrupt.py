"""SIGTERM and SIGINT: what schedulers send before a kill, and Ctrl-C.

Python's default for SIGTERM ends the process at once: no ``finally``, no ``with job:`` exit, so
the manifest kept the run ``running`` and a training run lost every step since its last checkpoint.
Two layers here:

- :func:`signals_raise`, around a whole command (``eagle3.runner``): SIGTERM raises
  :class:`Interrupted` where the process is, as Ctrl-C raises KeyboardInterrupt, so the stage's job
  is recorded ``interrupted`` and its cleanup runs.
- :class:`StopRequests`, around the train loop: either signal only sets a flag; the loop finishes
  its optimizer step, saves a checkpoint and raises :class:`Interrupted` saying how to resume. A
  second Ctrl-C while it does so takes the first layer's way (stop now); a second SIGTERM is ignored.

A process killed with SIGKILL runs nothing; ``stage=status`` shows its run as interrupted because
its run lock is free (``eagle3.manifest.Manifest.status_of``).
"""
from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """The process was asked to stop (SIGTERM or SIGINT). A KeyboardInterrupt, so that library code
    catching ``Exception`` does not swallow it; the command exits with 128 + the signal number."""

    def __init__(self, signum: int, message: str = ""):
        self.signum = int(signum)
        super().__init__(message or f"interrupted by {signal.Signals(self.signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def signals_raise():
    """Inside: SIGTERM raises :class:`Interrupted` (SIGINT keeps raising KeyboardInterrupt).
    Outside the main thread (where no handler can be set) nothing changes."""
    if not _main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    stopping = False
    try:
        yield
    except KeyboardInterrupt:
        stopping = True
        raise
    finally:  # stopping: a repeated SIGTERM must not cut the exit (and its exit code) short
        signal.signal(signal.SIGTERM, signal.SIG_IGN if stopping else previous)


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader worker's ``worker_init_fn``: a scheduler signals every process of the job, and a
    worker that died of it would fail the loop (torch's SIGCHLD handler) before its checkpoint; the
    main process stops the workers itself."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)


class StopRequests:
    """``with StopRequests() as stop:``: SIGTERM/SIGINT set ``stop.signum`` instead of stopping;
    ``stop.requested(accelerator)`` says whether any process of the run got one (a collective call
    on several processes: every rank must stop at the same step, or the checkpoint's collectives
    would hang). A second SIGINT (Ctrl-C again) restores the previous handlers and is re-delivered
    to them: stop now. Further SIGTERMs are ignored: a scheduler signals every process of the job and
    a launcher (torchrun) forwards its own to the workers, so one stop arrives twice; the
    scheduler's SIGKILL is what forces it."""

    def __init__(self):
        self.signum = 0
        self._previous: dict = {}

    def __enter__(self) -> "StopRequests":
        if _main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum and signum != signal.SIGINT:
            return
        if self.signum:  # Ctrl-C again: stop now, the way the previous handler does
            self._restore()
            handler = signal.getsignal(signum)
            if callable(handler):
                handler(signum, frame)
            else:
                raise Interrupted(signum)
            return
        self.signum = signum

    def _restore(self, keep: tuple = ()) -> None:
        for s, h in self._previous.items():
            if s not in keep:
                signal.signal(s, h)
        self._previous = {}

    def __exit__(self, exc_type, exc, tb) -> bool:
        # leaving with the stop: further SIGTERMs stay ignored while the caller records it and exits
        self._restore(keep=(signal.SIGTERM,) if isinstance(exc, Interrupted) else ())
        return False

    def requested(self, accelerator=None) -> int:
        """The signal number any process received (0: none)."""
        if accelerator is None or accelerator.num_processes == 1:
            return self.signum
        import torch

        flag = torch.tensor([float(self.signum)], device=accelerator.device)
        anyone = accelerator.reduce(flag, reduction="sum").item() > 0
        return self.signum or (int(signal.SIGTERM) if anyone else 0)
