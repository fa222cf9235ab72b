"""Where this process stands in a distributed launch: the one place eagle3 reads the launcher's
environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, which torchrun and
accelerate launch set; a plain ``python -m eagle3`` sets none: one process).

Read from the environment, not from ``accelerate.PartialState()`` or ``torch.distributed``: the stage
glue needs the rank before the Accelerator exists (creating that state early would fix its device and
distributed mode), and no process group is needed to read it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class Launch:
    world_size: int = 1
    """Processes in the launch."""
    rank: int = 0
    """This process's global rank (0: the main process, which records the run)."""
    local_rank: Optional[int] = None
    """This process's rank on its host (its GPU under torchrun); None outside a launcher."""
    local_world_size: Optional[int] = None
    """Processes on this host; None where the launcher does not say."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def one_host(self) -> bool:
        """Every process on this host (as far as the launcher says)."""
        return (self.local_world_size if self.local_world_size is not None else self.world_size) == self.world_size


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    if name not in env:
        return None
    try:
        value = int(env[name])
    except ValueError:
        raise ValueError(f"the launcher's {name}={env[name]!r} is not an integer: start eagle3 with torchrun or "
                         f"accelerate launch, or unset {name} for one process") from None
    if value < 0:
        raise ValueError(f"the launcher's {name}={value} is negative: unset {name} for one process")
    return value


def launch(env: Optional[Mapping[str, str]] = None) -> Launch:
    """This process's place in the launch, from ``env`` (default: ``os.environ``)."""
    env = os.environ if env is None else env
    world, rank = _int(env, "WORLD_SIZE"), _int(env, "RANK")
    out = Launch(world_size=1 if world is None else world, rank=0 if rank is None else rank,
                 local_rank=_int(env, "LOCAL_RANK"), local_world_size=_int(env, "LOCAL_WORLD_SIZE"))
    if out.world_size < 1 or out.rank >= out.world_size:
        raise ValueError(f"the launcher's RANK={out.rank} is not below WORLD_SIZE={out.world_size}: start eagle3 "
                         "with torchrun or accelerate launch, or unset both for one process")
    return out
