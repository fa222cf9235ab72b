"""What is refused before a run starts, and before Hydra creates its log directory for it.

- Keys the schema (eagle3/config.py) does not know, with the closest valid name: on the command
  line, in both the plain form (``train.ttt_step=3``, which Hydra refuses with a hint to add ``+``)
  and the ``+`` form (which Hydra accepts, and which would otherwise train with the default and
  store the unused key); and in a composed config, wherever the key came from. Below a dict-typed
  field any key goes (the schema has none today).
- An experiment name that is a path; a workspace this process cannot write (under a regular
  file, or read-only); a target directory without a tokenizer; a stage that reads earlier runs
  in an experiment where nothing ran (a mistyped workspace= or experiment=).
- A sweep with a job whose config is refused (a swept value Hydra cannot merge, or one the
  schema refuses): every job's config is checked before any runs.

``eagle3/__main__.py`` runs these on the composed config before it hands the command line to
Hydra; ``eagle3.runner.run`` runs the environment checks again for callers that compose
themselves (tests, notebooks). Not done here: anything that needs the data or the target's weights
(the stages check those where they read them).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from .config import CONF_DIR, Config
from .config_keys import UnknownKeyError, check_config_keys, free_form, schema_fields
from .config_keys import unknown_key_message as _unknown_key_message
from .errors import Eagle3Error

__all__ = ["UnknownKeyError", "check_config_keys", "check_override_keys", "check_sweep_jobs", "check_environment",
           "check_writable", "unknown_key_message"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "spiece.model")


class WorkspaceError(Eagle3Error):
    """The workspace cannot hold this run's files."""


def _groups() -> set[str]:
    """The config groups of conf/ (``data`` and ``logger`` are schema fields as well)."""
    return {p.name for p in CONF_DIR.iterdir() if p.is_dir()} | {"hydra"}


def _is_known(parts: list[str], root=None) -> bool:
    """Whether the key ``parts`` names a field of the schema ``root`` (Config), or a config group."""
    node = root or Config
    for i, part in enumerate(parts):
        fields = schema_fields(node)
        if part not in fields:
            return i == 0 and len(parts) == 1 and root is None and part in _groups()
        node = fields[part]
        if free_form(node):
            return True
        if not dataclasses.is_dataclass(node):
            return i == len(parts) - 1
    return True


def unknown_key_message(key: str, value: str | None = None) -> str:
    return _unknown_key_message(key, Config, value)


def check_override_keys(overrides: list[str]) -> None:
    """Refuse a command-line key the schema does not know (``key=v``, ``+key=v``, ``++key=v``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for arg in overrides:
        if arg.startswith("-") or "=" not in arg:
            continue  # a Hydra flag, or `~key` (which Hydra checks)
        try:
            override = OverridesParser.create().parse_override(arg)
        except Exception:
            continue  # malformed: Hydra says why
        if override.is_delete():
            continue
        key = override.key_or_group
        if key.split(".")[0].split("/")[0] == "hydra" or "/" in key or override.package is not None:
            continue  # Hydra's own config, and config groups: Hydra checks those
        if not _is_known(key.split(".")):
            raise UnknownKeyError(unknown_key_message(key, arg.partition("=")[2]))


class SweepError(ValueError):
    """A job of a sweep whose config is refused (the CLI prints it as an invalid config, before any job runs)."""


def check_sweep_jobs(overrides: list[str], compose) -> None:
    """Every job of a sweep over command-line values (Hydra's basic sweeper: every combination)
    composed and validated as the job will be when it starts (``compose(overrides)``, then the
    schema's keys and ``__post_init__`` checks), before any job runs:
    a value Hydra cannot merge (``train.lr=bad``) or one the schema refuses (``train.grad_clip=-1``)
    is a :class:`SweepError` naming the job's swept values and the reason. Hydra composes every job
    before it launches any as well, so a sweep runs all its jobs or none. Not enumerated: another
    sweeper's (Optuna draws its values as it goes; each is checked when its trial starts)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from .config import to_config

    if any(o.partition("=")[0].lstrip("+") == "hydra/sweeper" for o in overrides):
        return
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

        parsed = OverridesParser.create().parse_overrides(overrides)
        swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch] if swept else []
    except HydraException:
        return  # a sweep the basic sweeper cannot run: Hydra says why
    refused = []
    for num, job in enumerate(jobs):
        try:
            to_config(compose(job))
        except Exception as e:
            cause = e.__cause__ if isinstance(e, HydraException) and e.__cause__ is not None else e
            why = (str(cause) or repr(cause)).splitlines()[0]
            refused.append(f"{' '.join(o for o in job if o.partition('=')[0] in swept)} (job #{num}): {why}")
    if refused:
        shown = "; ".join(refused[:5]) + (f"; and {len(refused) - 5} more" if len(refused) > 5 else "")
        raise SweepError(f"{shown}. {len(refused)} of the sweep's {len(jobs)} jobs refused; every job of a "
                         f"sweep is checked before any runs, and none ran")


def _nearest_existing(path: Path) -> Path:
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_writable(path: Path, what: str) -> None:
    """``path`` is, or can be created as, a directory this process may write."""
    existing = _nearest_existing(path)
    if not existing.is_dir():
        where = "" if existing == path else f": {existing}"
        raise WorkspaceError(f"{what} {path}{where} is a file, not a directory; set workspace= (and experiment=) "
                             f"to a directory, or move the file")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" ({existing} is not writable)"
        raise WorkspaceError(f"{what} {path} is read-only for this user{where}; set workspace=DIR to a "
                             f"writable directory (`stage=status` reads a read-only one)")


def check_no_dotdot_past_missing(raw: str, key: str = "workspace") -> None:
    """A ``..`` after a directory that does not exist (``/a/missing/../ws``): the stages would take
    it lexically (``/a/ws``) while Hydra's log directory, made by ``mkdir -p`` of the path as
    written, would create ``/a/missing`` too. The shell refuses such a path (``cd`` fails): so do we."""
    path = Path(raw).expanduser()
    prefix = Path(path.anchor)  # "" (this directory) for a relative path
    for part in path.parts[1:] if path.anchor else path.parts:
        if part == ".." and not os.path.isdir(prefix):
            fixed = os.path.normpath(path if path.is_absolute() else Path.cwd() / path)
            raise WorkspaceError(f"{key}={raw}: {prefix} does not exist, so '..' cannot be taken from it (running "
                                 f"would create it); write the path without it: {key}={fixed}")
        prefix = prefix / part


def check_target_tokenizer(target_cfg) -> None:
    """A target directory must hold a tokenizer (every stage that reads text loads it)."""
    if not target_cfg.path:
        return  # the GGUF conversion writes the tokenizer
    path = Path(target_cfg.path).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        return  # eagle3.target says what is wrong with it
    if not any((path / n).is_file() for n in TOKENIZER_FILES) and not any(path.glob("*.tiktoken")):
        raise WorkspaceError(f"target.path={path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy "
                             f"the tokenizer files of the model these weights come from into it")


def check_environment(cfg) -> None:
    """What a run of ``cfg`` (a Config, or a composed DictConfig) needs of this machine before it
    starts; ``stage=status`` only reads."""
    from .config import check_experiment_name

    check_experiment_name(cfg.name)  # (a multirun's shared config arrives here unvalidated)
    if cfg.stage == "status":
        return
    check_no_dotdot_past_missing(cfg.workspace)
    workspace = Path(cfg.workspace).expanduser().resolve()
    # beside the experiments: wandb's files, the converted GGUF target, plan's probe cache
    wandb = cfg.logger.backend == "wandb" and cfg.logger.mode != "disabled" and not cfg.logger.dir
    if wandb or not cfg.target.path or cfg.stage == "plan":
        check_writable(workspace, "workspace")
    check_writable(workspace / cfg.name, "experiment directory")
    check_target_tokenizer(cfg.target)


def check_runs_recorded(cfg) -> None:
    """A stage that reads earlier runs needs the experiment's manifest: without one, the workspace=
    or experiment= is most likely mistyped. (The command line checks it before Hydra makes its log
    directory there; a caller of ``eagle3.runner.run`` gets the manifest's own refusal.)"""
    reads_runs = cfg.stage in ("extract", "train", "produce") or (cfg.stage in ("export", "eval")
                                                                  and not cfg.export.from_)
    workspace = Path(cfg.workspace).expanduser().resolve()
    manifest = workspace / cfg.name / "manifest.json"
    if reads_runs and not manifest.is_file():
        raise WorkspaceError(f"stage={cfg.stage} reads the runs recorded in {manifest}, which does not exist: "
                             f"nothing has run in experiment {cfg.name} of workspace {workspace}. Check workspace= "
                             f"and experiment= (`stage=status` shows what ran), or run stage=prepare first")
