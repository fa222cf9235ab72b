"""Multirun support: a Hydra callback that ranks the sweep's jobs when the sweep ends, and says
which failed (``python -m eagle3 -m ...`` then exits 1).

Jobs share upstream artifacts through the manifest (same config hash = same run, computed once);
each job's own outputs live under its config hash. The ranking reads the manifest, so it works
the same for the basic launcher, submitit (SLURM or local) and the Optuna sweeper. Each job's
result is also written to the sweep directory (``.eagle3-jobs/``): a submitit job ends in another
process (another host, on SLURM), where the launching process's callback never sees it.
"""
from __future__ import annotations

import json
import logging
import sys
import uuid
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

log = logging.getLogger("eagle3.sweep")

JOBS_DIR = ".eagle3-jobs"  # in the sweep directory: one file per finished job
_failed: list[str] = []  # the last sweep's failed jobs in this process (read by eagle3.__main__)


def failed_jobs() -> list[str]:
    """The failed jobs of the sweep that ended last in this process (their swept overrides)."""
    return list(_failed)


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
        self.jobs: dict[int, dict] = {}
        self.sweep_id = ""
        self.sweep_dir = ""

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        # set before the launcher sends this callback to the jobs (submitit pickles it): the jobs
        # write where the launching process reads, under this sweep's id
        self.sweep_id, self.sweep_dir = uuid.uuid4().hex, str(config.hydra.sweep.dir)
        self.jobs = {}
        _failed.clear()

    def on_job_end(self, config, job_return, **kwargs: Any) -> None:
        ret = getattr(job_return, "_return_value", None)
        overrides = list(getattr(job_return, "overrides", []) or [])
        if isinstance(ret, dict):
            job = {"overrides": overrides, **ret}
        elif isinstance(ret, float):  # an objective returned to a sweeper
            job = {"overrides": overrides, "objective": ret, **({"error": "no objective value"} if ret != ret else {})}
        else:
            job = {"overrides": overrides, "error": "job raised (see its log)"}
        num = int(config.hydra.job.num) if config.hydra.job.get("num") is not None else len(self.jobs)
        self.jobs[num] = job
        if self.sweep_dir:
            try:
                d = Path(self.sweep_dir) / JOBS_DIR
                d.mkdir(parents=True, exist_ok=True)
                (d / f"{self.sweep_id}-{num}.json").write_text(json.dumps(job, default=str))
            except OSError as e:
                log.warning("sweep: the result of job #%d not written to %s: %s", num, self.sweep_dir, e)

    def _collected(self) -> list[dict]:
        """This sweep's jobs, in job order: those that ended in this process and those whose result
        another process wrote (submitit)."""
        jobs = dict(self.jobs)
        if self.sweep_dir:
            for f in (Path(self.sweep_dir) / JOBS_DIR).glob(f"{self.sweep_id}-*.json"):
                num = int(f.stem.rsplit("-", 1)[1])
                if num not in jobs:
                    try:
                        jobs[num] = json.loads(f.read_text())
                    except (OSError, json.JSONDecodeError):
                        continue
        return [jobs[n] for n in sorted(jobs)]

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        jobs = self._collected()
        shared = set.intersection(*(set(j["overrides"]) for j in jobs)) if jobs else set()
        varied = [" ".join(o for o in j["overrides"] if o not in shared) for j in jobs]
        failures = [f"{v}: {j['error']}" for v, j in zip(varied, jobs) if j.get("error")]
        exp_dirs = {j["experiment_dir"] for j in jobs if j.get("experiment_dir")}
        if not exp_dirs:
            exp_dirs = {str(Path(config.workspace).expanduser().resolve() / config.name)}
        for exp in sorted(exp_dirs):
            hashes = {j["records"].get("train") for j in jobs if j.get("records", {}).get("train")}
            rows = sweep_rows(Path(exp), {h for h in hashes if h} or None) if (Path(exp) / "manifest.json").exists() else []
            print_sweep_table(rows, failures, f"sweep over {exp}: {len(jobs)} jobs, {len(failures)} failed")
        _failed[:] = [v or "(no swept value)" for v, j in zip(varied, jobs) if j.get("error")]
        if _failed:
            print(f"eagle3: {len(_failed)} of {len(jobs)} jobs of the sweep failed: {'; '.join(_failed)}",
                  file=sys.stderr, flush=True)
