"""torch.compile's worker threads for the trainer, where vLLM ran in the same process.

``import vllm`` sets ``TORCHINDUCTOR_COMPILE_THREADS=1`` for the whole process (vllm/env_override.py:
fewer processes for the engine's own compilation), so Inductor then compiles every Triton kernel of
the training step, forward and backward of the unrolled TTT model, one at a time, with every core but
one idle. In ``stage=all`` (extract and train in one process) and with an online producer in the
trainer's process, that is vLLM's setting, not the user's: the trainer takes torch's own default
back, unless the user set the variable before eagle3 started.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional

log = logging.getLogger("eagle3.train")
ENV = "TORCHINDUCTOR_COMPILE_THREADS"
AT_START = os.environ.get(ENV)
"""The variable as eagle3 found it: ``import eagle3`` imports this module first, before any vLLM
import can overwrite it."""
_UNSET = object()


def restore_compile_threads(user_setting=_UNSET) -> Optional[int]:
    """Inductor's compile threads back to torch's default (``min(32, cores)``) when vLLM, not the
    user, lowered them to 1 in this process; returns the new count, or None when nothing changed.
    ``user_setting``: the variable as the user started eagle3 (default: :data:`AT_START`)."""
    if user_setting is _UNSET:
        user_setting = AT_START
    if "vllm" not in sys.modules or user_setting is not None:
        return None
    import torch
    import torch._inductor.config as inductor_config

    if inductor_config.compile_threads != 1:
        return None
    n = min(32, torch._utils.cpu_count() or 1)
    if n <= 1:
        return None
    inductor_config.compile_threads = n
    log.info("train: vLLM set %s=1 in this process (its engine's setting); torch.compile for the training step "
             "uses %d threads again (set %s before starting eagle3 to choose)", ENV, n, ENV)
    return n
