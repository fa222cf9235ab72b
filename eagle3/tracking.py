"""wandb runs, one per stage job: offline by default (no account), grouped by experiment.

One path for every stage: the runner gives the manifest a :class:`Tracker`; a stage job opens its
run when the work starts (``with job:``), the stage logs along the way through ``job.log`` (the
train loop its curve, prepare its statistics), and when the job completes the tracker logs the
stage's facts (``eagle3.contracts``) and finishes the run; a failed job finishes it as failed.

Metric names are grouped by stage: ``prepare/*``, ``extract/*``, ``train/loss_step_{j}``,
``train/acc_step_{j}``, ``eval/*`` (held-out split during training and the offline evaluator),
``export/acceptance_per_position``, ``eval/acceptance_length``.
"""
from __future__ import annotations

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


class Tracker:
    """Opens and closes the wandb run of each stage job (``logger.backend=wandb``, mode not disabled)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.enabled = cfg.logger.backend == "wandb" and cfg.logger.mode != "disabled"

    def open(self, stage: str, config_hash: str, upstream: dict):
        if not self.enabled:
            return _NoRun()
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        return wandb.init(**wandb_settings(self.cfg, stage, config_hash, upstream))

    def close(self, run, stage: str, facts) -> None:
        """Log the completed job's facts (None: the job failed) and finish its run."""
        if isinstance(run, _NoRun):
            return
        if facts is None:
            run.finish(exit_code=1)
            return
        try:
            run.log(stage_summary(stage, facts))
        finally:
            run.finish()


def stage_summary(stage: str, facts) -> dict:
    """The row logged when a stage job completes: its scalar facts, and for export the acceptance
    figures under the names the dashboards use."""
    row = facts.metrics(stage)
    if stage in ("export", "eval") and facts.acceptance_length is not None:
        row[f"{stage}/acceptance_length"] = facts.acceptance_length
        row["eval/acceptance_length"] = facts.acceptance_length
        for k, v in (facts.acceptance_by_k or {}).items():
            row[f"{stage}/acceptance_length_k{k}"] = v
        per_pos = facts.acceptance_per_position or []
        for i, v in enumerate(per_pos, 1):
            row[f"{stage}/acceptance_pos_{i}"] = v
        import wandb

        row[f"{stage}/acceptance_per_position"] = wandb.Table(
            columns=["position", "acceptance_rate"], data=[[i, v] for i, v in enumerate(per_pos, 1)])
    return row


class _NoRun:
    def log(self, *args, **kwargs) -> None:
        pass

    def finish(self, *args, **kwargs) -> None:
        pass

    @property
    def summary(self) -> dict:
        return {}


def read_offline_run(run_dir: str | Path, timeout: float = 60.0) -> dict:
    """Read an offline wandb run back (config, history rows, group, job type) from its .wandb file.

    wandb >= 0.19 no longer ships a Python reader; the file is wandb's LevelDB-style record log:
    a 7-byte file header, then 32 KiB blocks of chunks (crc32, length, type) holding protobuf
    ``Record`` messages. ``run.finish()`` can return before wandb's service has flushed the log
    (seen with wandb 0.31 in offline mode: a 7-byte file right after ``finish``), so this waits up to
    ``timeout`` seconds for the run's ``exit`` record before reading it.
    """
    import json
    import time

    from wandb.proto import wandb_internal_pb2 as pb

    run_dir = Path(run_dir)
    (path,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        records = [pb.Record.FromString(data) for data in _log_records(path.read_bytes())]
        if any(rec.WhichOneof("record_type") == "exit" for rec in records):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} has no exit record after {timeout:.0f} s ({path.stat().st_size} bytes): "
                               "the run is still open, or wandb stopped before flushing it")
        time.sleep(0.1)
    out = {"config": {}, "history": [], "group": None, "job_type": None, "name": None}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.update(group=rec.run.run_group, job_type=rec.run.job_type, name=rec.run.display_name)
            for item in rec.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in rec.history.item})
    return out


def _log_records(raw: bytes) -> list[bytes]:
    """The complete records of a LevelDB-style log (a partly written last record is left out)."""
    import struct

    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(raw):
        left = block - (pos % block)
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if pos + 7 + length > len(raw):  # still being written
            break
        chunk = raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records
