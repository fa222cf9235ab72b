"""Reading an experiment back for inspection (the notebooks use this; so can users).

Everything is found through the experiment's manifest, never by guessing paths.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from .artifacts import DATASET_DIR, METRICS_FILE, STATS_FILE, TOKEN_FREQ_FILE
from .manifest import Manifest, StageRecord


class Experiment:
    def __init__(self, exp_dir: str | Path):
        self.dir = Path(exp_dir).expanduser().resolve()
        if not (self.dir / "manifest.json").exists():
            raise FileNotFoundError(f"{self.dir} has no manifest.json: run a stage there first "
                                    f"(python -m eagle3 workspace=... experiment=...)")
        self.manifest = Manifest(self.dir)

    def record(self, stage: str) -> StageRecord:
        rec = self.manifest.current(stage)
        if rec is None or rec.status != "complete":
            raise LookupError(f"stage {stage} has no complete run in {self.dir}")
        return rec

    def has(self, stage: str) -> bool:
        rec = self.manifest.current(stage)
        return rec is not None and rec.status == "complete"

    # -- prepare --------------------------------------------------------------------------
    def dataset(self, split: str = "train"):
        import datasets

        return datasets.load_from_disk(str(self.record("prepare").path(DATASET_DIR)))[split]

    def tokenizer(self, trust_remote_code: bool = False):
        """The target's tokenizer; ``trust_remote_code``: run a tokenizer's own code (as the run's
        target.trust_remote_code=true did), which transformers refuses otherwise."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.record("prepare").data["target"]["path"],
                                             trust_remote_code=trust_remote_code)

    def prepare_stats(self) -> dict:
        return json.loads(self.record("prepare").path(STATS_FILE).read_text())

    def token_freq(self):
        from safetensors.torch import load_file

        return load_file(str(self.record("prepare").path(TOKEN_FREQ_FILE)))["freq"].numpy()

    # -- train ----------------------------------------------------------------------------
    def train_metrics(self) -> list[dict]:
        """Rows of the train stage's JSONL metrics file (one per logged step)."""
        rec = self.record("train")
        files = sorted(rec.out_dir.rglob(METRICS_FILE))
        if not files:
            raise FileNotFoundError(f"no {METRICS_FILE} under {rec.out_dir}")
        rows = []
        for line in files[0].read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
        return rows

    def ttt_steps(self) -> int:
        return int(self.record("train").data["config"]["train"]["ttt_steps"])

    # -- export ---------------------------------------------------------------------------
    def acceptance(self) -> dict:
        """The export stage's facts as a plain dict (eagle3.contracts.ExportFacts' fields)."""
        return self.record("export").facts.to_json()


def mask_html(tokenizer, input_ids, loss_mask, max_tokens: int = 400) -> str:
    """The conversation with trained (assistant) tokens highlighted, as HTML."""
    parts = []
    for tid, m in list(zip(input_ids, loss_mask))[:max_tokens]:
        text = html.escape(tokenizer.decode([tid]))
        text = text.replace("\n", "\u21b5<br>")
        style = "background:#c6f6c6" if m else "color:#888"
        parts.append(f'<span style="{style}">{text}</span>')
    return '<div style="font-family:monospace;white-space:pre-wrap">' + "".join(parts) + "</div>"
