"""User-facing errors: the CLI prints their message (what is wrong and how to fix it), no traceback."""
from __future__ import annotations

import errno
from typing import Optional

# what torch.save and safetensors say when a write fails for want of space (they raise RuntimeError
# or SafetensorError, not always OSError(ENOSPC))
_DISK_FULL_WORDS = ("no space left", "storagefull", "disk quota", "file write failed")


class Eagle3Error(RuntimeError):
    """Base class for errors caused by inputs, configs or the environment rather than by a bug."""


def disk_full(e: Optional[BaseException]) -> bool:
    """Whether ``e`` (or what caused it) is a write that failed for want of space or quota."""
    for _ in range(8):  # the exception and what caused it
        if e is None:
            return False
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e).lower().replace(" ", "")
        if any(w.replace(" ", "") in text for w in _DISK_FULL_WORDS):
            return True
        e = e.__cause__ or e.__context__
    return False
