"""The wandb dashboard as code (the ``wandb-workspaces`` package): a saved view (workspace) of an
experiment's runs and a report of it, or of a sweep, built from the config the runs used.

    python -m eagle3.dashboard [overrides of the run ...]          # after a run with logger=wandb_online
    python -m eagle3.dashboard experiment=NAME --dry-run           # print the panels, save nothing
    python -m eagle3 logger=wandb_online logger.dashboard=true     # the same, right after the run

The panels (``sections``) name only metrics the stages log (eagle3.tracking: the train loop's curve
``train/*`` and ``eval/*`` per TTT step, ``lr``, ``grad_norm``, ``tokens_per_s``; the facts each stage
logs when it completes, ``export/*`` and ``eval/*``): tests/test_dashboard.py runs the stages with
wandb offline and checks every panel's metric against the runs' logged keys.

- Training, per TTT step (``job_type=train``): ``train/loss_step_{j}``, ``eval/loss_step_{j}``,
  ``train/acc_step_{j}``, ``eval/cond_acc_step_{j}`` (one line per step j), ``eval/accept_len_k{k}``,
  ``lr``, ``grad_norm``, ``tokens_per_s``.
- Acceptance, served (``job_type=export``): ``export/acceptance_length_k{k}`` per k,
  ``export/acceptance_pos_{i}`` per draft position, ``eval/acceptance_length``.
- Acceptance by context length: ``export/context/{bucket}/acceptance_length`` per bucket of
  ``export.context_buckets`` the target can hold, and ``eval/context/...`` from ``stage=eval``.
- A sweep (the report): a parallel-coordinates panel of ``logger.dashboard_sweep_keys`` (default
  ``train.lr``, ``train.ttt_steps``) against ``eval/acceptance_length``, over the experiment's export
  runs (a sweep's jobs share the experiment, so its runs are the lines).

Saving needs a wandb.ai account (``wandb login``) and the runs uploaded (``logger=wandb_online``, or
``wandb sync`` of offline runs). Nothing here runs during an offline run.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field


@dataclass
class PanelSpec:
    """One panel: ``kind`` line | bar | parallel; ``metrics`` the logged names it plots (for
    ``parallel``: config keys, as ``config:eagle3.KEY``, then the summary metric)."""

    kind: str
    title: str
    metrics: list
    x: str = "Step"


@dataclass
class SectionSpec:
    name: str
    job_type: str
    panels: list = field(default_factory=list)


def sections(cfg) -> list[SectionSpec]:
    """The workspace's sections for ``cfg`` (its TTT steps, ks and context buckets)."""
    from .export.context_length import buckets, target_max_length

    steps = range(int(cfg.train.ttt_steps))
    k = int(cfg.export.num_speculative_tokens)
    ks = sorted({k, *(int(x) for x in cfg.export.eval_ks)})
    train = SectionSpec("Training, per TTT step", "train", [
        PanelSpec("line", "train loss per TTT step", [f"train/loss_step_{j}" for j in steps]),
        PanelSpec("line", "held-out loss per TTT step", [f"eval/loss_step_{j}" for j in steps]),
        PanelSpec("line", "train accuracy per TTT step", [f"train/acc_step_{j}" for j in steps]),
        PanelSpec("line", "held-out accuracy per TTT step, given the earlier steps right",
                  [f"eval/cond_acc_step_{j}" for j in steps]),
        PanelSpec("line", "expected acceptance length per k (held-out, teacher-forced)",
                  [f"eval/accept_len_k{j + 1}" for j in steps]),
        PanelSpec("line", "learning rate", ["lr"]),
        PanelSpec("line", "gradient norm", ["grad_norm"]),
        PanelSpec("line", "tokens per second", ["tokens_per_s"]),
    ])
    served = SectionSpec("Acceptance, served by vLLM", "export", [
        PanelSpec("bar", "acceptance length per k", [f"export/acceptance_length_k{kk}" for kk in ks]),
        PanelSpec("bar", f"acceptance rate per draft position (k={k})", [f"export/acceptance_pos_{i}"
                                                                          for i in range(1, k + 1)]),
        PanelSpec("bar", "acceptance length at k (what vLLM measured)", ["eval/acceptance_length"]),
    ])
    labels = bucket_labels(cfg, buckets, target_max_length)
    context = SectionSpec("Acceptance by prompt context length", "export", [
        PanelSpec("bar", f"vLLM acceptance length per context length (k={k})",
                  [f"export/context/{b}/acceptance_length" for b in labels]),
        PanelSpec("bar", "prompts per context length", [f"export/context/{b}/num_prompts" for b in labels]),
    ])
    offline = SectionSpec("Offline evaluator by prompt context length", "eval", [
        PanelSpec("bar", f"offline acceptance length per context length (k={k})",
                  [f"eval/context/{b}/acceptance_length" for b in labels]),
    ])
    return [train, served, context, offline]


def sweep_panel(keys) -> PanelSpec:
    """Parallel coordinates of the swept config keys against the served acceptance length."""
    return PanelSpec("parallel", "sweep: " + ", ".join(keys) + " against acceptance length",
                     [f"config:eagle3.{key}" for key in keys] + ["eval/acceptance_length"])


def bucket_labels(cfg, buckets, target_max_length) -> list[str]:
    """The context-length buckets to plot: those with prompts in the experiment's recorded export (or
    eval) run when there is one (only they log an acceptance length), else every bucket of
    ``export.context_buckets`` the target can hold (all of them when its config is not on disk, as
    for the embedded default's converted GGUF before its first run)."""
    import json
    from pathlib import Path

    from .manifest import Manifest

    if Path(cfg.experiment_dir).is_dir():
        m = Manifest(cfg.experiment_dir)
        for stage in ("export", "eval"):
            rec = m.current(stage)
            ctx = getattr(rec.facts, "by_context_length", None) if rec is not None and rec.facts else None
            if ctx:
                return [b for b, d in sorted(ctx.items(), key=lambda kv: kv[1]["min_tokens"]) if d["num_prompts"]]
    p = Path(cfg.target.path or "").expanduser() / "config.json"
    max_len = target_max_length(json.loads(p.read_text())) if cfg.target.path and p.is_file() else None
    return [label for label, _, _ in buckets(cfg.export.context_buckets, max_len)]


def metric_names(specs) -> set:
    """Every logged name the panels plot (config keys of the parallel panel left out)."""
    out = set()
    for s in specs:
        for p in (s.panels if isinstance(s, SectionSpec) else [s]):
            out.update(m for m in p.metrics if not m.startswith("config:"))
    return out


def _panel(p: PanelSpec, wr):
    if p.kind == "line":
        return wr.LinePlot(title=p.title, x=p.x, y=list(p.metrics))
    if p.kind == "bar":
        return wr.BarPlot(title=p.title, metrics=list(p.metrics), orientation="v")
    if p.kind == "parallel":
        cols = [wr.ParallelCoordinatesPlotColumn(metric=wr.Config(m.split(":", 1)[1]) if m.startswith("config:")
                                                 else wr.SummaryMetric(m)) for m in p.metrics]
        return wr.ParallelCoordinatesPlot(title=p.title, columns=cols)
    raise ValueError(f"unknown panel kind {p.kind!r}")


def build_workspace(cfg, entity: str):
    """The saved view of experiment ``cfg.name``'s runs (group = the experiment), one section each."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    return ws.Workspace(
        entity=entity, project=cfg.logger.project, name=f"eagle3: {cfg.name}",
        sections=[ws.Section(name=s.name, panels=[_panel(p, wr) for p in s.panels], is_open=True)
                  for s in sections(cfg)],
        runset_settings=ws.RunsetSettings(filters=f"Group = '{cfg.name}'"))


def check_sweep_keys(cfg) -> list[str]:
    """``logger.dashboard_sweep_keys``, each a key of the config (refused otherwise)."""
    keys = [str(k) for k in cfg.logger.dashboard_sweep_keys]
    for key in keys:
        node = cfg
        for part in key.split("."):
            if not hasattr(node, part):
                raise ValueError(f"logger.dashboard_sweep_keys: {key!r} is not a config key (e.g. train.lr, "
                                 f"train.ttt_steps; python -m eagle3 --cfg job lists them)")
            node = getattr(node, part)
    return keys


def build_report(cfg, entity: str):
    """A report of experiment ``cfg.name``: each section's panels over its job type's runs, and a
    parallel-coordinates panel of ``logger.dashboard_sweep_keys`` over the export runs."""
    import wandb_workspaces.reports.v2 as wr

    def runset(job_type):
        return wr.Runset(entity=entity, project=cfg.logger.project, name=f"{cfg.name} {job_type}",
                         filters=f"Group = '{cfg.name}' and JobType = '{job_type}'")

    blocks = [wr.H1(f"eagle3 experiment {cfg.name}"),
              wr.P(f"Target {cfg.target.path or cfg.target.gguf or 'the embedded default'}; panels from "
                   f"eagle3/dashboard.py (python -m eagle3.dashboard).")]
    for s in sections(cfg):
        blocks += [wr.H2(s.name), wr.PanelGrid(runsets=[runset(s.job_type)], panels=[_panel(p, wr) for p in s.panels])]
    keys = check_sweep_keys(cfg)
    if keys:
        blocks += [wr.H2("Sweep"), wr.PanelGrid(runsets=[runset("export")], panels=[_panel(sweep_panel(keys), wr)])]
    return wr.Report(entity=entity, project=cfg.logger.project, title=f"eagle3: {cfg.name}"[:128],
                     description="Training per TTT step, acceptance per k, position and context length.",
                     blocks=blocks)


def default_entity(cfg) -> str:
    """``logger.entity``, else the logged-in account's default entity (asks wandb.ai)."""
    if cfg.logger.entity:
        return cfg.logger.entity
    import wandb

    entity = wandb.Api().default_entity
    if not entity:
        raise RuntimeError("no wandb entity: set logger.entity=TEAM or run `wandb login`")
    return entity


def publish(cfg) -> dict:
    """Save the workspace and the report to wandb.ai; their URLs."""
    check_sweep_keys(cfg)
    entity = default_entity(cfg)
    view = build_workspace(cfg, entity).save()
    report = build_report(cfg, entity).save()
    return {"workspace": view.url, "report": report.url}


def after_run(cfg) -> None:
    """The runner's hook: with ``logger.dashboard=true`` (which needs logger=wandb_online) the
    dashboard is saved once the stages have run; a failure to save is reported, the run stands."""
    if not (cfg.logger.dashboard and cfg.logger.backend == "wandb" and cfg.logger.mode == "online"):
        return
    try:
        urls = publish(cfg)
    except Exception as e:  # the stages' results are recorded; the dashboard can be made again by command
        print(f"dashboard: not saved ({type(e).__name__}: {e}); run `python -m eagle3.dashboard` with the same "
              f"overrides to try again", file=sys.stderr)
        return
    print(f"dashboard: workspace {urls['workspace']}, report {urls['report']}")


def all_panels(cfg) -> list[SectionSpec]:
    """The sections and, with sweep keys, the report's sweep panel."""
    keys = check_sweep_keys(cfg)
    return sections(cfg) + ([SectionSpec("Sweep", "export", [sweep_panel(keys)])] if keys else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle3.dashboard", description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="the run's overrides (experiment=NAME, target.path=..., "
                                                 "logger.dashboard_sweep_keys=[train.lr,train.ttt_steps], ...)")
    ap.add_argument("--dry-run", action="store_true", help="print the panels and their metrics; save nothing")
    args = ap.parse_args(argv)
    from .compose import compose_config

    cfg = compose_config(list(args.overrides))
    if args.dry_run:
        for s in all_panels(cfg):
            print(f"{s.name} (job_type={s.job_type})")
            for p in s.panels:
                print(f"  {p.kind:8s} {p.title}: {', '.join(p.metrics)}")
        return 0
    urls = publish(cfg)
    print(f"dashboard: workspace {urls['workspace']}\ndashboard: report {urls['report']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
