"""The store's layout, derived once: which layers, which dtypes, which splits, how long a sample.

The extract stage, online training (``eagle3.online.run.OnlineRun``, the trainer and ``stage=produce``)
and ``stage=plan`` all call :func:`derive_store_layout`, so for one config they write, stream or size
the same store and refuse the same inputs with the same message. What it does NOT do: load a
dataset or a model, or refuse an engine/target combination (``checks.refuse_known_bad``, which the
stages that start an engine call).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from ..manifest import ManifestError
from ..store import StoreLayout
from .layers import LayerIdError, resolve_layer_ids, resolve_store_dtype


@dataclass(frozen=True)
class ExtractLayout:
    """What extraction writes (``layout``), from a target run in ``target_dtype``, over ``splits``
    of the prepared dataset; ``max_model_len`` sizes an engine for their longest sample (0 when
    their lengths were not given)."""

    layout: StoreLayout
    target_dtype: str
    splits: tuple = ()
    max_model_len: int = 0


def max_model_len(lengths) -> int:
    """Room for the longest of ``lengths`` (arrays of sample lengths) and the one sampled token,
    rounded up to 16."""
    longest = max((int(n.max()) for n in lengths if len(n)), default=1)
    return -(-(longest + 1) // 16) * 16


def check_tokenizer(prep, target) -> None:
    """The prepare run ``prep`` tokenized with ``target``'s tokenizer (else its ids mean other tokens)."""
    if prep.facts.tokenizer_hash != target.tokenizer_hash:
        raise ManifestError(
            f"the prepare run {prep.config_hash[:12]} tokenized with tokenizer {str(prep.facts.tokenizer_hash)[:12]}, "
            f"but the target {target.path} has tokenizer {target.tokenizer_hash[:12]}: its token ids would be read "
            f"by another vocabulary. Re-run `python -m eagle3 stage=prepare`.")


def derive_store_layout(extract_cfg, target, target_dtype: str = "auto",
                        split_lengths: Optional[Mapping[str, np.ndarray]] = None,
                        also: Sequence[str] = (), layer_ids: Optional[Sequence[int]] = None) -> ExtractLayout:
    """The layout ``extract_cfg`` (``extract.*``) gives for ``target`` (eagle3.target.TargetInfo) run in
    ``target_dtype`` (``target.dtype``; ``auto`` = the checkpoint's).

    ``split_lengths``: {split: sample lengths} of the prepared dataset. Given, the splits read
    (``extract.splits``, then ``also``: what the caller reads beyond them) must all be there and
    their samples must fit the target's context (``max_position_embeddings``); ``max_model_len`` is
    sized for them. Not given (a plan from estimated data), neither is checked.

    ``layer_ids``: the aux ids ``extract.layer_ids=auto`` resolved to (the extract stage's layer
    probe, eagle3.extract.layer_probe); ``auto`` itself names no layers and is refused here."""
    L, H = target.num_hidden_layers, target.hidden_size
    requested = extract_cfg.layer_ids if layer_ids is None else list(layer_ids)
    if requested == "auto":
        raise LayerIdError("extract.layer_ids=auto names no layers until the extract stage's layer probe chose them "
                           "(eagle3.extract.layer_probe); only `stage=extract` (and stage=all) runs it. Give the ids "
                           "explicitly here (extract.layer_ids=[a,b,c]) or [] for the default (2, L//2, L-3)")
    layer_ids = resolve_layer_ids(requested, L)
    run_dtype = target.run_dtype(target_dtype)
    layout = StoreLayout(layer_ids=layer_ids, last_layer_id=L, hidden_size=H,
                         dtype=resolve_store_dtype(extract_cfg.store_dtype, run_dtype, H), target_hash=target.hash)
    if split_lengths is None:
        return ExtractLayout(layout, run_dtype)
    splits = tuple(dict.fromkeys([*extract_cfg.splits, *also]))
    missing = [s for s in splits if s not in split_lengths]
    if missing:
        raise ManifestError(f"extract.splits={list(extract_cfg.splits)}: the prepared dataset has no split {missing} "
                            f"(it has {list(split_lengths)})")
    lengths = [np.asarray(split_lengths[s]) for s in splits]
    longest = max((int(n.max()) for n in lengths if len(n)), default=0)
    context = target.text_config.get("max_position_embeddings")
    if context and longest + 1 > int(context):
        raise ManifestError(f"the longest prepared sample has {longest} tokens but the target's context is "
                            f"{context} (max_position_embeddings): re-run prepare with prepare.max_length < {context}")
    return ExtractLayout(layout, run_dtype, splits, max_model_len(lengths))
