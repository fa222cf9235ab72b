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
            out["train"] = {k: v for k, v in rec.facts.items() if k.startswith(("eval_", "train_"))}
        if stage == "export":
            out["acceptance"] = {k: rec.facts.get(k) for k in ("acceptance_length", "acceptance_by_k",
                                                               "acceptance_per_position", "tokens_per_step_by_k",
                                                               "ngram", "k")
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
    tr = summary["train"]
    per_step = {name: tr.get(f"eval_{name}") for name in ("loss_per_step", "acc_per_step", "cond_acc_per_step",
                                                          "accept_len")}
    n_steps = max((len(v) for v in per_step.values() if v), default=0)
    if n_steps:
        t = Table(title="draft after training, held-out split, per TTT step j "
                        "(accept len: expected acceptance length of a chain of j+1 drafts)")
        t.add_column("metric")
        for j in range(n_steps):
            t.add_column(f"j={j}")
        labels = {"loss_per_step": "loss", "acc_per_step": "top-1 acc", "cond_acc_per_step": "cond. acc",
                  "accept_len": "accept len"}
        for key, values in per_step.items():
            if values:
                t.add_row(labels[key], *(f"{v:.4f}" for v in values))
        console.print(t)
    acc = summary["acceptance"]
    by_k = acc.get("acceptance_by_k") or {}
    if by_k:
        t = Table(title="served by vLLM on held-out prompts")
        for col in ("k (draft tokens)", "acceptance length", "tokens / target step"):
            t.add_column(col)
        tps = acc.get("tokens_per_step_by_k") or {}
        for k in sorted(by_k, key=int):
            t.add_row(str(k), f"{by_k[k]:.3f}", f"{tps[k]:.3f}" if k in tps else "")
        console.print(t)
        ngram = acc.get("ngram") or {}
        if ngram:
            console.print(f"prompt lookup (ngram) baseline at k={ngram.get('k')}: "
                          f"{ngram.get('tokens_per_step', float('nan')):.3f} tokens / target step")
    return summary
