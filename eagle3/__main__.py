"""Command line: ``python -m eagle3 stage=prepare|extract|train|export|all|status|eval|produce|plan``.

Only Hydra, OmegaConf and the config schemas are imported on the ``--help`` / ``--cfg`` path;
torch, transformers and vLLM load inside the stage that needs them. Before Hydra runs a job,
:func:`preflight` composes the config once and refuses it (eagle3/preflight.py) while nothing has
been created: Hydra makes its run directory (``${workspace}/${name}/logs/``) before the job starts.
"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from .compose import _compose, _insert, compose_config, rewrite_overrides  # noqa: F401 (compose_config: the public API)
from .config import CONF_DIR

# Hydra flags that print and exit: no job runs, no run directory is made. Help is passed on
# unchecked (it must be instant); a printed config has its keys checked
_HELP_FLAGS = {"-h", "--help", "--hydra-help", "--version", "--shell-completion", "-sc"}
_PRINT_FLAGS = {"--info", "-i", "--cfg", "-c", "--resolve", "-p", "--package"}
# stage=status only reads: its Hydra job makes no log directory (a read-only, mistyped or absent
# workspace stays as it is)
STATUS_HYDRA = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout"]


def preflight(args: list[str], keys_only: bool = False):
    """Refuse a command line (message on stderr, exit 2 for a bad config, 1 for a workspace this run
    cannot use) before Hydra creates anything for it; returns the composed Config of a single run
    (None for a multirun, or when composing failed: Hydra then reports it as it always has, before
    it creates anything). A multirun's shared config is checked as a run's is, and every one of its
    jobs' configs too (eagle3.preflight.check_sweep_jobs). ``keys_only``: only the command line's
    keys are checked (for a config Hydra prints)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .config import to_config
    from .errors import Eagle3Error
    from .preflight import (
        check_config_keys,
        check_environment,
        check_override_keys,
        check_runs_recorded,
        check_sweep_jobs,
    )

    multirun = any(a in ("-m", "--multirun") for a in args)
    overrides = [a for a in args if not a.startswith("-")]
    try:
        check_override_keys(overrides)
        if keys_only:
            return None
        shared = overrides
        if multirun:  # what every job shares: the overrides that are not swept
            from hydra.core.override_parser.overrides_parser import OverridesParser

            parser = OverridesParser.create()
            shared = [o for o in overrides if not parser.parse_override(o).is_sweep_override()]
        try:
            dcfg = _compose(shared)
        except (HydraException, OmegaConfBaseException):
            return None
        check_config_keys(dcfg)
        cfg = dcfg if multirun else to_config(dcfg)
        check_environment(cfg)
        check_runs_recorded(cfg)
        if multirun:
            check_sweep_jobs(overrides, _compose)
    except Eagle3Error as e:
        print(f"eagle3: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as e:  # UnknownKeyError, and the schema's checks (__post_init__)
        msg = str(e).splitlines()[0] if str(e) else repr(e)
        print(f"eagle3: invalid config: {msg}", file=sys.stderr)
        raise SystemExit(2) from None
    return None if multirun else cfg


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(dcfg: DictConfig):
    from .runner import run_from_hydra

    return run_from_hydra(dcfg)


def main() -> None:
    args = rewrite_overrides(sys.argv[1:])
    flags = {a.partition("=")[0] for a in args if a.startswith("-")}
    if not flags & _HELP_FLAGS:
        cfg = preflight(args, keys_only=bool(flags & _PRINT_FLAGS))
        if cfg is not None and cfg.stage == "status":
            args = _insert(args, STATUS_HYDRA)
    sys.argv = [sys.argv[0]] + args
    _hydra_main()
    if any(a in ("-m", "--multirun") for a in args):
        from .sweep import failed_jobs

        if failed_jobs():  # the table and the failed jobs are printed (eagle3.sweep.SweepSummary)
            raise SystemExit(1)


if __name__ == "__main__":
    main()
