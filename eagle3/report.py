"""What a person reads about an experiment: ``stage=status`` (the manifest as a table) and the
summary printed after ``stage=all`` (per stage its time and size, the draft's held-out metrics per
TTT step, and vLLM's acceptance length per k). Reads the manifest only; rich is imported inside
the printing functions.
"""
from __future__ import annotations

import datetime as _dt
from pathlib import Path

from .contracts import STAGES
from .manifest import Manifest, StageRecord
from .units import fmt_size


def _seconds(rec: StageRecord) -> float | None:
    try:
        start = _dt.datetime.fromisoformat(rec.data["started"])
        end = _dt.datetime.fromisoformat(rec.data["ended"])
    except (KeyError, TypeError, ValueError):
        return None
    return (end - start).total_seconds()


def _stored(rec: StageRecord) -> int:
    """Bytes a run holds: its recorded outputs once complete; before that (running, interrupted,
    failed: nothing is recorded yet) what its directory holds on disk now."""
    if rec.status == "complete":
        return sum(m["size"] for m in rec.data.get("outputs", {}).values())
    out = Path(rec.out_dir)
    return sum(p.lstat().st_size for p in out.rglob("*") if p.is_file() and not p.is_symlink()) if out.is_dir() else 0


def _size_cell(rec: StageRecord) -> str:
    return fmt_size(_stored(rec)) + ("" if rec.status == "complete" else " on disk")


def _facts_line(stage: str, facts) -> str:
    """The few facts worth a glance in the status table."""
    if facts is None:
        return ""
    shown = {"prepare": ("num_train", "num_eval", "coverage"),
             "export": ("format", "acceptance_length")}.get(stage, ())
    parts = [f"{k}={getattr(facts, k)}" for k in shown if getattr(facts, k, None) is not None]
    if stage == "extract":
        layout = facts.layout
        parts += [f"layer_ids={list(layout.layer_ids)}", f"store_dtype={layout.dtype}",
                  f"bytes_per_token={layout.bytes_per_token}"]
    if stage == "extract":
        parts.append(facts.checks_line())
    if stage == "extract" and getattr(facts, "layer_probe", None):
        from .contracts import layer_probe_line

        parts.append(layer_probe_line(facts.layer_probe))
    if stage == "prepare" and getattr(facts, "coverage_curve", None):
        parts.append(f"coverage by draft vocabulary size: {facts.coverage_line()}")
    if stage == "prepare" and getattr(facts, "vocab_choice", None):
        parts.append(facts.vocab_choice_line())
    if stage == "prepare" and getattr(facts, "categories", None):
        parts.append("categories (eval split): " + ", ".join(
            f"{c} {n}" for c, n in (facts.categories.get("eval") or {}).items()))
    if stage == "export" and getattr(facts, "lookup_summary", None):
        parts.append(facts.lookup_summary)
    if stage == "train":
        parts.append(f"final_loss={facts.final.loss:.4f}" if facts.final is not None else "")
        if facts.hidden_states == "online" and facts.producer:
            pr = facts.producer
            parts.append(f"online ({pr.get('placement')} {pr.get('backend')} producer, layer_ids={pr.get('layer_ids')}, "
                         f"{pr.get('dtype')} from a {pr.get('target_dtype')} target)")
    if stage == "extract" and getattr(facts, "num_tokens", None):  # the store's size: tokens x bytes/token
        tokens = sum(facts.num_tokens.values())
        parts.append(f"tokens={tokens}, store={fmt_size(tokens * facts.layout.bytes_per_token)}")
    return ", ".join(p for p in parts if p)


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
            last = StageRecord(stage, entry["runs"][latest], manifest.exp_dir)
            note = f"latest run {latest[:12]} is {manifest.status_of(last)}: {last.data.get('error', '')}".strip(": ")
            note = "; ".join(x for x in (note, _resume_note(manifest, last)) if x)
        if rec is None:
            rows.append({"stage": stage, "status": manifest.status_of(last) if latest else "not run",
                         "config": (latest or "")[:12], "runs": len(entry.get("runs", {})), "note": note,
                         "size": _size_cell(last) if latest else ""})
            continue
        stale = manifest.stale_reason(rec) if rec.status == "complete" else None
        status = manifest.status_of(rec)
        resume = _resume_note(manifest, rec) if latest == rec.config_hash else ""
        rows.append({"stage": stage, "status": "stale" if stale else status, "config": rec.config_hash[:12],
                     "runs": len(entry.get("runs", {})), "size": _size_cell(rec),
                     "started": rec.data.get("started") or "", "ended": rec.data.get("ended") or "",
                     "facts": _facts_line(stage, rec.facts),
                     "note": "; ".join(x for x in (stale, note, resume) if x)})
    return rows


def _resume_note(manifest: Manifest, rec: StageRecord) -> str:
    """For an interrupted run: what was lost and how to take it up again."""
    if manifest.status_of(rec) != "interrupted":
        return ""
    gone = (f"its process (pid {rec.data.get('pid')} on {rec.data.get('host')}) ended without recording an end"
            if rec.status == "running" else "stopped by a signal")
    from .artifacts import CHECKPOINT_COMPLETE, CHECKPOINTS_DIR

    ckpts = sorted(p.parent.name for p in (rec.out_dir / CHECKPOINTS_DIR).glob(f"step-*/{CHECKPOINT_COMPLETE}"))
    where = f"; last checkpoint {ckpts[-1]}" if ckpts else ""
    return f"interrupted: {gone}{where}; run `python -m eagle3 stage={rec.stage}` with the same overrides to resume"


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


def pipeline_summary(manifest: Manifest) -> dict:
    """Per stage: status, seconds, bytes stored, config hash; the train and export facts (typed)."""
    out = {"stages": {}, "train": None, "export": None}
    for stage in STAGES:
        rec = manifest.current(stage)
        if rec is None:
            continue
        out["stages"][stage] = {"status": rec.status, "seconds": _seconds(rec), "bytes": _stored(rec),
                                "config": rec.config_hash[:12]}
        if stage in ("train", "export"):
            out[stage] = rec.facts
    return out


def print_pipeline_summary(manifest: Manifest) -> dict:
    from rich.console import Console
    from rich.table import Table

    summary = pipeline_summary(manifest)
    console = Console(width=160)
    t = Table(title="eagle3 pipeline")
    for col in ("stage", "status", "time", "stored", "config"):
        t.add_column(col)
    for stage, s in summary["stages"].items():
        t.add_row(stage, s["status"], f"{s['seconds']:.0f} s" if s["seconds"] is not None else "",
                  fmt_size(s["bytes"]), s["config"])
    console.print(t)
    train = summary["train"]
    if train is not None and train.eval is not None:
        ev = train.eval
        t = Table(title="draft after training, held-out split, per TTT step j "
                        "(accept len: expected acceptance length of a chain of j+1 drafts)")
        t.add_column("metric")
        for j in range(len(ev.loss_per_step)):
            t.add_column(f"j={j}")
        for label, values in (("loss", ev.loss_per_step), ("top-1 acc", ev.acc_per_step),
                              ("cond. acc", ev.cond_acc_per_step), ("accept len", ev.accept_len)):
            if values:
                t.add_row(label, *(f"{v:.4f}" for v in values))
        console.print(t)
    export = summary["export"]
    by_k = (export.acceptance_by_k if export is not None else None) or {}
    if by_k:
        t = Table(title="served by vLLM on held-out prompts")
        for col in ("k (draft tokens)", "acceptance length", "tokens / target step"):
            t.add_column(col)
        tps = export.tokens_per_step_by_k or {}
        for k in sorted(by_k, key=int):
            t.add_row(str(k), f"{by_k[k]:.3f}", f"{tps[k]:.3f}" if k in tps else "")
        console.print(t)
        ngram = export.ngram or {}
        if ngram:
            console.print(f"prompt lookup (ngram) baseline at k={ngram.get('k')}: "
                          f"{ngram.get('tokens_per_step', float('nan')):.3f} tokens / target step")
        print_acceptance_reports(export, console)
    return summary


def print_acceptance_reports(export, console) -> None:
    """Export's per-domain and per-temperature tables and its verdict against prompt lookup."""
    from rich.table import Table

    if export.by_domain:
        t = Table(title=f"served by vLLM, per domain of the held-out prompts (k={export.k})")
        for col in ("domain", "prompts", "acceptance length", "tokens / target step", "prompt lookup", "vs lookup"):
            t.add_column(col)
        for cat, d in export.by_domain.items():
            gain = d.get("lookup_gain")
            t.add_row(cat, str(d["num_prompts"]), f"{d['acceptance_length']:.3f}", f"{d['tokens_per_step']:.3f}",
                      f"{d['ngram_tokens_per_step']:.3f}", f"{gain:+.1%}" if gain is not None else "")
        console.print(t)
    if export.by_context_length:
        t = Table(title=f"served by vLLM, per prompt context length in tokens (k={export.k}, export.context_buckets)")
        for col in ("context length", "prompts", "acceptance length", "tokens / target step", "prompt lookup"):
            t.add_column(col)
        from .export.context_length import ordered

        for label, d in ordered(export.by_context_length):
            cells = [d.get(n) for n in ("acceptance_length", "tokens_per_step", "ngram_tokens_per_step")]
            t.add_row(label, str(d["num_prompts"]), *("" if v is None else f"{v:.3f}" for v in cells))
        console.print(t)
    temps = export.by_temperature or {}
    if len(temps) > 1:
        ks = sorted({int(k) for row in temps.values() for k in row.get("acceptance_by_k", {})})
        t = Table(title=f"served by vLLM at each temperature (acceptance length; sampled runs seeded "
                        f"{export.sampling_seed}+i per prompt; the offline evaluator is greedy only)")
        for col in ("temperature", *(f"k={k}" for k in ks), "prompt lookup tokens / step"):
            t.add_column(col)
        for temp, row in temps.items():
            by_k = row.get("acceptance_by_k", {})
            t.add_row(temp, *(f"{by_k[str(k)]:.3f}" if str(k) in by_k else "" for k in ks),
                      f"{row.get('ngram_tokens_per_step', float('nan')):.3f}")
        console.print(t)
    if export.lookup_summary:
        console.print(export.lookup_summary)
