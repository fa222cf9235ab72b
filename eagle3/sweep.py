"""Multirun support: a Hydra callback that ranks the sweep's jobs when the sweep ends.

Jobs share upstream artifacts through the manifest (same config hash = same run, computed once);
each job's own outputs live under its config hash. The ranking reads the manifest, so it works
the same for the basic launcher, submitit (SLURM or local) and the Optuna sweeper.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

log = logging.getLogger("eagle3.sweep")


def objective_value(manifest, objective: str) -> float | None:
    """The number a sweeper optimises, from the runs this process completed."""
    if objective == "eval_loss":
        rec = manifest.current("train")
        facts = None if rec is None else rec.facts
        return None if facts is None or facts.eval is None else facts.eval.loss
    if objective == "acceptance_length":
        rec = manifest.current("export")
        return None if rec is None or rec.facts is None else rec.facts.acceptance_length
    return None


def _diff(configs: list[dict]) -> list[dict]:
    """For each config, only the keys whose values differ between configs (dotted)."""
    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    flats = [flat(c) for c in configs]
    keys = set().union(*flats) if flats else set()
    varying = sorted(k for k in keys if len({repr(f.get(k)) for f in flats}) > 1)
    return [{k: f.get(k) for k in varying} for f in flats]


def sweep_rows(exp_dir: Path, hashes: set[str] | None = None) -> list[dict]:
    """One row per train run of the experiment (optionally only ``hashes``), with its export."""
    from .contracts import facts_from_json
    from .manifest import Manifest

    data = Manifest(exp_dir).read()
    train_runs = data["stages"].get("train", {}).get("runs", {})
    export_runs = data["stages"].get("export", {}).get("runs", {})
    items = [(h, r) for h, r in train_runs.items() if hashes is None or h in hashes]
    diffs = _diff([r.get("config", {}) for _, r in items])
    rows = []
    for (h, r), d in zip(items, diffs):
        exports = [e for e in export_runs.values() if e.get("upstream", {}).get("train") == h]
        al = max((e["facts"].get("acceptance_length") for e in exports
                  if e.get("status") == "complete" and e["facts"].get("acceptance_length") is not None), default=None)
        facts = facts_from_json("train", r.get("facts"))
        rows.append({"train_run": h[:12], "status": r.get("status"), "params": d,
                     "eval_loss": facts.eval.loss if facts is not None and facts.eval is not None else None,
                     "acceptance_length": al,
                     "error": (r.get("error") or "")[:200]})
    rows.sort(key=lambda x: (x["status"] != "complete",
                             -(x["acceptance_length"] or 0.0),
                             x["eval_loss"] if x["eval_loss"] is not None else float("inf")))
    return rows


def print_sweep_table(rows: list[dict], failures: list[str], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in ("rank", "train run", "status", "varied config", "eval loss", "acceptance length", "error"):
        t.add_column(c, overflow="fold")
    for i, r in enumerate(rows, 1):
        t.add_row(str(i), r["train_run"], r["status"], ", ".join(f"{k}={v}" for k, v in r["params"].items()),
                  f"{r['eval_loss']:.4f}" if r["eval_loss"] is not None else "",
                  f"{r['acceptance_length']:.3f}" if r["acceptance_length"] is not None else "", r["error"])
    console = Console(width=180)
    console.print(t)
    for f in failures:
        console.print(f"[red]failed job:[/red] {f}")


class SweepSummary(Callback):
    """Collects job results (failures included) and prints the ranking table at the end."""

    def __init__(self) -> None:
        self.jobs: list[dict] = []

    def on_job_end(self, config, job_return, **kwargs: Any) -> None:
        ret = getattr(job_return, "_return_value", None)
        overrides = list(getattr(job_return, "overrides", []) or [])
        if isinstance(ret, dict):
            self.jobs.append({"overrides": overrides, **ret})
        elif isinstance(ret, float):  # an objective returned to a sweeper
            self.jobs.append({"overrides": overrides, "objective": ret,
                              **({"error": "no objective value"} if ret != ret else {})})
        else:
            self.jobs.append({"overrides": overrides, "error": "job raised (see its log)"})

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        shared = set.intersection(*(set(j["overrides"]) for j in self.jobs)) if self.jobs else set()
        failures = [f"{' '.join(o for o in j['overrides'] if o not in shared)}: {j['error']}"
                    for j in self.jobs if j.get("error")]
        exp_dirs = {j["experiment_dir"] for j in self.jobs if j.get("experiment_dir")}
        if not exp_dirs:
            exp_dirs = {str(Path(config.workspace).expanduser().resolve() / config.name)}
        for exp in sorted(exp_dirs):
            hashes = {j["records"].get("train") for j in self.jobs if j.get("records", {}).get("train")}
            rows = sweep_rows(Path(exp), {h for h in hashes if h} or None) if (Path(exp) / "manifest.json").exists() else []
            print_sweep_table(rows, failures, f"sweep over {exp}: {len(self.jobs)} jobs, {len(failures)} failed")
