"""The table printed after ``stage=all``: per stage its time and sizes, the final losses and
accuracies per TTT step, and the acceptance length vLLM measured per k."""
from __future__ import annotations

import datetime as _dt

from .config import STAGES
from .manifest import Manifest


def _seconds(rec) -> float | None:
    try:
        start = _dt.datetime.fromisoformat(rec.data["started"])
        end = _dt.datetime.fromisoformat(rec.data["ended"])
    except (KeyError, TypeError, ValueError):
        return None
    return (end - start).total_seconds()


def pipeline_summary(manifest: Manifest) -> dict:
    out = {"stages": {}, "train": {}, "acceptance": {}}
    for stage in STAGES:
        rec = manifest.current(stage)
        if rec is None:
            continue
        size = sum(m["size"] for m in rec.data.get("outputs", {}).values())
        out["stages"][stage] = {"status": rec.status, "seconds": _seconds(rec), "bytes": size,
                                "config": rec.config_hash[:12]}
        if stage == "train":
            out["train"] = {k: rec.facts.get(k) for k in ("final_metrics", "expected_acceptance_length")
                            if rec.facts.get(k) is not None}
        if stage == "export":
            out["acceptance"] = {k: rec.facts.get(k) for k in ("acceptance_length", "acceptance_by_k",
                                                               "acceptance_per_position", "ngram_baseline")
                                 if rec.facts.get(k) is not None}
    return out


def print_pipeline_summary(manifest: Manifest) -> dict:
    from rich.console import Console
    from rich.table import Table

    from .cli import _fmt_size

    summary = pipeline_summary(manifest)
    console = Console(width=160)
    t = Table(title="eagle3 pipeline")
    for col in ("stage", "status", "time", "stored", "config"):
        t.add_column(col)
    for stage, s in summary["stages"].items():
        t.add_row(stage, s["status"], f"{s['seconds']:.0f} s" if s["seconds"] is not None else "",
                  _fmt_size(s["bytes"]), s["config"])
    console.print(t)
    final = summary["train"].get("final_metrics") or {}
    steps = sorted({int(k.rsplit("_", 1)[1]) for k in final if k.startswith(("loss_step_", "acc_step_"))})
    if steps:
        t = Table(title="draft after training (eval split), per TTT step")
        t.add_column("metric")
        for j in steps:
            t.add_column(f"step {j}")
        for name in ("loss", "acc", "cond_acc"):
            if any(f"{name}_step_{j}" in final for j in steps):
                t.add_row(name, *(f"{final[f'{name}_step_{j}']:.4f}" if f"{name}_step_{j}" in final else ""
                                  for j in steps))
        console.print(t)
    by_k = summary["acceptance"].get("acceptance_by_k") or {}
    if by_k:
        t = Table(title="acceptance length measured by vLLM on held-out prompts")
        t.add_column("k (draft tokens)")
        t.add_column("acceptance length")
        base = summary["acceptance"].get("ngram_baseline") or {}
        if base:
            t.add_column("ngram lookup (tokens / target step)")
        for k in sorted(by_k, key=int):
            row = [str(k), f"{by_k[k]:.3f}"]
            if base:
                row.append(f"{base[str(k)]:.3f}" if str(k) in base else "")
            t.add_row(*row)
        console.print(t)
    return summary
