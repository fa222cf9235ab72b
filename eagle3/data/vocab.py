"""The draft vocabulary: the most frequent target tokens among trainable tokens."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class VocabMapping:
    """``d2t[i]`` is an offset: target id = i + d2t[i]; ``t2d`` marks target ids in the draft vocab."""

    d2t: np.ndarray  # int64 [draft_vocab]
    t2d: np.ndarray  # bool [target_vocab]
    coverage: float  # share of trainable tokens inside the draft vocabulary
    num_seen: int  # distinct target tokens seen among trainable tokens
    identity: bool

    @property
    def draft_vocab_size(self) -> int:
        return len(self.d2t)

    @property
    def kept_ids(self) -> np.ndarray:
        return np.arange(len(self.d2t), dtype=np.int64) + self.d2t


def draft_vocab_size_for(requested: int, target_vocab: int) -> int:
    """The size of the draft vocabulary prepare builds for ``prepare.draft_vocab_size=requested``:
    at most the target's whole vocabulary (then the mapping is the identity)."""
    return min(int(requested), int(target_vocab))


def build_vocab_mapping(freq: np.ndarray, draft_vocab_size: int) -> VocabMapping:
    """Top-``draft_vocab_size`` ids by frequency (ties to the lower id), sorted by id.

    When fewer distinct tokens were seen, the rest is padded with unseen ids (lowest first) so the
    draft vocabulary always has exactly ``draft_vocab_size`` entries; when the draft vocabulary is
    not smaller than the target's, the mapping is the identity.
    """
    vocab = len(freq)
    total = int(freq.sum())
    seen = int((freq > 0).sum())
    if draft_vocab_size_for(draft_vocab_size, vocab) == vocab:
        return VocabMapping(np.zeros(vocab, np.int64), np.ones(vocab, bool), 1.0 if total else 0.0, seen, True)
    # Stable sort on -freq keeps lower ids first among equal counts; unseen ids follow in id order.
    order = np.argsort(-freq, kind="stable")
    kept = np.sort(order[:draft_vocab_size]).astype(np.int64)
    t2d = np.zeros(vocab, bool)
    t2d[kept] = True
    coverage = float(freq[kept].sum() / total) if total else 0.0
    return VocabMapping(kept - np.arange(draft_vocab_size, dtype=np.int64), t2d, coverage, seen, False)


# Draft vocabulary sizes the coverage curve is reported at (prepare's facts, stage=plan, stage=status),
# beside the chosen prepare.draft_vocab_size.
COVERAGE_SIZES = (4096, 8192, 16384, 32768, 65536)


def coverage_curve(freq: np.ndarray, sizes=COVERAGE_SIZES, chosen: int | None = None) -> dict:
    """Share of trainable tokens covered by the ``n`` most frequent target tokens, for each size ``n``
    (and the chosen one): ``{str(n): share}``, sizes in increasing order. A size at or above the
    target's vocabulary covers everything (the identity mapping). Ties do not matter: the top-n sum
    is the same whichever of the equally frequent ids are kept."""
    freq = np.asarray(freq, dtype=np.int64)
    total = int(freq.sum())
    ordered = np.sort(freq)[::-1]
    cum = np.cumsum(ordered)
    wanted = sorted({int(n) for n in sizes} | ({int(chosen)} if chosen else set()))
    out = {}
    for n in wanted:
        if n <= 0:
            raise ValueError(f"coverage_curve: sizes must be positive, got {n}")
        covered = int(cum[min(n, len(freq)) - 1]) if len(freq) else 0
        out[str(n)] = round(covered / total, 6) if total else 0.0
    return out


def save_vocab(mapping: VocabMapping, path) -> None:
    import torch

    from ..atomic import save_safetensors

    save_safetensors({"d2t": torch.from_numpy(mapping.d2t), "t2d": torch.from_numpy(mapping.t2d)}, path,
                     metadata={"coverage": repr(mapping.coverage), "identity": str(mapping.identity)})


def load_vocab(path) -> tuple:
    """(d2t int64 tensor, t2d bool tensor) from a prepare stage's vocab.safetensors."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    return t["d2t"], t["t2d"]
