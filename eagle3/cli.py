"""Dispatch a composed config to the stages, print the status table, handle failures."""
from __future__ import annotations

import gc
import importlib
import logging
import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .config import STAGES, Config, to_config
from .errors import Eagle3Error
from .manifest import Manifest

log = logging.getLogger("eagle3")


def experiment_dir(cfg: Config) -> Path:
    return Path(cfg.workspace).expanduser().resolve() / cfg.name


def run_stage(name: str, cfg: Config, manifest: Manifest):
    module = importlib.import_module(f"stages.{name}")
    before = {h: r.get("ended") for h, r in manifest.read()["stages"].get(name, {}).get("runs", {}).items()}
    t0 = time.perf_counter()
    record = module.run(cfg, manifest)
    log.info("stage %s finished in %.1f s", name, time.perf_counter() - t0)
    ran = record is not None and before.get(record.config_hash) != record.data.get("ended")
    if ran and name in ("extract", "export"):  # prepare and train log their own runs
        from .tracking import log_stage_facts

        log_stage_facts(cfg, name, record)
    return record


def _release_memory() -> None:
    """Free what a job held so the next job of a multirun starts clean."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _in_multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:
        return False


def run(cfg: Config) -> dict:
    """Run the configured stage(s); returns a summary dict (used by sweeps and tests)."""
    exp_dir = experiment_dir(cfg)
    manifest = Manifest(exp_dir)
    if cfg.stage == "status":
        print_status(manifest)
        return {"stage": "status"}
    names = list(STAGES) if cfg.stage == "all" else [cfg.stage]
    records = {}
    from .cpu import cpu_threads

    with cpu_threads(cfg.cpu_threads):
        for name in names:
            records[name] = run_stage(name, cfg, manifest)
    if cfg.stage == "all":
        from .summary import print_pipeline_summary

        print_pipeline_summary(manifest)
    return {"stage": cfg.stage, "experiment_dir": str(exp_dir),
            "records": {k: (v.config_hash if v is not None else None) for k, v in records.items()}}


def run_from_hydra(dcfg: DictConfig):
    try:
        cfg = to_config(dcfg)
    except Exception as e:  # validation errors from __post_init__
        msg = str(e).splitlines()[0] if str(e) else repr(e)
        if _in_multirun():  # one bad job of a sweep is reported, the others go on
            log.error("job failed: invalid config: %s", msg)
            return {"error": f"invalid config: {msg}"}
        print(f"eagle3: invalid config: {msg}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        result = run(cfg)
        if cfg.objective != "none":
            from .sweep import objective_value

            value = objective_value(Manifest(experiment_dir(cfg)), cfg.objective)
            if value is None:
                raise Eagle3Error(f"objective={cfg.objective} but the run recorded no such value "
                                  f"(stage={cfg.stage} must include train for eval_loss, export for acceptance_length)")
            return float(value)
        return result
    except Eagle3Error as e:
        if _in_multirun():
            log.error("job failed: %s", e)
            return float("nan") if cfg.objective != "none" else {"stage": cfg.stage, "error": str(e)}
        print(f"eagle3: error: {e}", file=sys.stderr)
        if os.environ.get("EAGLE3_DEBUG"):
            raise
        raise SystemExit(1) from None
    except Exception as e:
        if _in_multirun():
            log.exception("job failed: %s", e)
            return float("nan") if cfg.objective != "none" else {"stage": cfg.stage, "error": f"{type(e).__name__}: {e}"}
        raise
    finally:
        _release_memory()


def _fmt_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def status_rows(manifest: Manifest) -> list[dict]:
    data = manifest.read()
    rows = []
    for stage in STAGES:
        entry = data["stages"].get(stage)
        if not entry:
            rows.append({"stage": stage, "status": "not run"})
            continue
        rec = manifest.current(stage)
        latest = entry.get("latest")
        note = ""
        if latest and (rec is None or latest != rec.config_hash):
            last = entry["runs"][latest]
            note = f"latest run {latest[:12]} is {last['status']}: {last.get('error', '')}".strip(": ")
        if rec is None:
            rows.append({"stage": stage, "status": entry["runs"][latest]["status"] if latest else "not run",
                         "config": (latest or "")[:12], "runs": len(entry.get("runs", {})), "note": note})
            continue
        stale = manifest.stale_reason(rec) if rec.status == "complete" else None
        size = sum(m["size"] for m in rec.data.get("outputs", {}).values())
        facts = rec.facts
        shown = {k: facts[k] for k in ("num_train", "num_eval", "coverage", "layer_ids", "store_dtype",
                                        "final_loss", "acceptance_length", "format") if k in facts}
        rows.append({"stage": stage, "status": "stale" if stale else rec.status, "config": rec.config_hash[:12],
                     "runs": len(entry.get("runs", {})), "size": _fmt_size(size),
                     "started": rec.data.get("started") or "", "ended": rec.data.get("ended") or "",
                     "facts": ", ".join(f"{k}={v}" for k, v in shown.items()),
                     "note": "; ".join(x for x in (stale, note) if x)})
    return rows


def print_status(manifest: Manifest) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"eagle3 experiment {manifest.exp_dir}")
    cols = ("stage", "status", "config", "runs", "size", "started", "ended", "facts", "note")
    for c in cols:
        table.add_column(c, overflow="fold")
    for row in status_rows(manifest):
        table.add_row(*(str(row.get(c, "")) for c in cols))
    Console(width=200).print(table)
    if not manifest.path.exists():
        print(f"(no manifest at {manifest.path}: nothing has run in this experiment yet)")
