"""wandb runs, one per stage job: offline by default (no account), grouped by experiment.

Metric names are grouped by stage: ``prepare/*``, ``extract/*``, ``train/loss_step_{j}``,
``train/acc_step_{j}``, ``eval/*`` (held-out split during training and the offline evaluator),
``export/acceptance_per_position``, ``eval/acceptance_length``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path


def wandb_settings(cfg, stage: str, config_hash: str, upstream: dict | None = None) -> dict:
    """Keyword arguments for ``wandb.init`` (also passed to Accelerate's wandb tracker)."""
    from .hashing import _plain

    log_dir = Path(cfg.logger.dir or Path(cfg.workspace) / "wandb").expanduser().resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    return dict(project=cfg.logger.project, entity=cfg.logger.entity or None, group=cfg.name, job_type=stage,
                name=f"{cfg.name}-{stage}-{config_hash[:8]}", dir=str(log_dir), mode=cfg.logger.mode,
                config={"eagle3": _plain(dataclasses.asdict(cfg)), "config_hash": config_hash,
                        "upstream": upstream or {}, "stage": stage},
                reinit="finish_previous")


@contextlib.contextmanager
def stage_run(cfg, stage: str, job):
    """A wandb run around a stage job (a no-op object when wandb is off)."""
    if cfg.logger.backend != "wandb" or cfg.logger.mode == "disabled":
        yield _NoRun()
        return
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    run = wandb.init(**wandb_settings(cfg, stage, job.config_hash, job.upstream))
    try:
        yield run
    finally:
        run.finish()


class _NoRun:
    def log(self, *args, **kwargs) -> None:
        pass

    @property
    def summary(self) -> dict:
        return {}
