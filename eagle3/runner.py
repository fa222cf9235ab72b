"""Runs a composed config: each stage of ``cfg.stage`` in order (``eagle3.stages.<name>``: the
checkout's ``stages/<name>.py``, one ``run(cfg, manifest)`` each), the status table for ``stage=status``, the summary after
``stage=all``; user errors end the process with their message, and inside a multirun a failed
job is reported to the sweep instead of ending it (eagle3.sweep: the sweep exits 1 at its end)."""
from __future__ import annotations

import gc
import importlib
import logging
import os
import sys
import time

from omegaconf import DictConfig

from .config import Config, to_config
from .contracts import STAGES
from .errors import Eagle3Error
from .manifest import Manifest

log = logging.getLogger("eagle3")


# the kind of CPU work that dominates each stage (eagle3.cpu.threads_for): export's verification and the
# offline evaluator decode a few prompts at a time; regeneration (every conversation's turn at once),
# extraction and training run large matmuls
STAGE_WORK = {"prepare": "batch", "extract": "batch", "produce": "batch", "train": "batch", "export": "decode",
              "eval": "decode"}


def run_stage(name: str, cfg: Config, manifest: Manifest):
    from .cpu import new_stage, phase_threads

    module = importlib.import_module(f"eagle3.stages.{name}")
    t0 = time.perf_counter()
    new_stage()
    with phase_threads(STAGE_WORK.get(name, "batch"), on_cpu=_on_cpu()):
        record = module.run(cfg, manifest)
    log.info("stage %s finished in %.1f s", name, time.perf_counter() - t0)
    return record


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


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
    from .preflight import check_environment
    from .tracking import Tracker
    from .vllm_compat import ALLOW_ENV

    check_environment(cfg)  # the command line checked it before Hydra made its run directory; callers that compose do not
    if cfg.allow_untested_vllm:  # read by every engine eagle3 starts (eagle3.vllm_compat.check_installed)
        os.environ[ALLOW_ENV] = "1"
    exp_dir = cfg.experiment_dir
    manifest = Manifest(exp_dir, tracker=Tracker(cfg))
    if cfg.stage == "status":
        from .report import print_status

        print_status(manifest)
        return {"stage": "status"}
    names = list(STAGES) if cfg.stage == "all" else [cfg.stage]
    if cfg.stage == "all" and cfg.train.hidden_states == "online":  # train computes the states itself
        names.remove("extract")
    records = {}
    from .cpu import set_policy

    set_policy(cfg.cpu_threads)
    for name in names:
        records[name] = run_stage(name, cfg, manifest)
    if cfg.stage == "all":
        from .report import print_pipeline_summary

        print_pipeline_summary(manifest)
    if cfg.logger.dashboard:  # logger=wandb_online logger.dashboard=true: the wandb workspace and report
        from .dashboard import after_run

        after_run(cfg)
    return {"stage": cfg.stage, "experiment_dir": str(exp_dir),
            "records": {k: (v.config_hash if v is not None else None) for k, v in records.items()}}


def run_from_hydra(dcfg: DictConfig):
    try:
        cfg = to_config(dcfg)
    except Exception as e:  # validation errors from __post_init__
        msg = str(e).splitlines()[0] if str(e) else repr(e)
        if _in_multirun():  # a sweeper's drawn values (the command line's were checked up front): the others go on
            log.error("job failed: invalid config: %s", msg)
            return {"error": f"invalid config: {msg}"}
        print(f"eagle3: invalid config: {msg}", file=sys.stderr)
        raise SystemExit(2) from None
    from .interrupt import Interrupted, signals_raise

    try:
        with signals_raise():  # SIGTERM ends a stage as Ctrl-C does: recorded interrupted, cleaned up
            result = run(cfg)
        if cfg.objective != "none":
            from .sweep import objective_value

            value = objective_value(Manifest(cfg.experiment_dir), cfg.objective)
            if value is None:
                raise Eagle3Error(f"objective={cfg.objective} but the run recorded no such value "
                                  f"(stage={cfg.stage} must include train for eval_loss, export for acceptance_length)")
            return float(value)
        return result
    except KeyboardInterrupt as e:  # SIGTERM or SIGINT: the whole command stops, a sweep too
        code = e.exit_code if isinstance(e, Interrupted) else 130
        msg = str(e) or "interrupted by SIGINT"
        if "again" not in msg:
            msg += (". Run the same command again to take it up: complete stages are skipped, the interrupted "
                    "one starts again (training resumes from its last checkpoint)")
        print(f"eagle3: {msg}", file=sys.stderr)
        raise SystemExit(code) from None
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
