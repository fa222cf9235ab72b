"""Where the draft to export comes from: the train stage's run (through the manifest) or a directory.

For a trained draft every fact that decides what the served model computes is taken from the
manifest, never retyped: the aux layer ids from the extract run (the layers the training data came
from; for a draft trained online, from the producer facts its train run recorded), the vocabulary mapping from the prepare run's ``vocab.safetensors``, and the target identity
from the runs' records. The draft's own files must agree with them, or the export stops.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..artifacts import DRAFT_CONFIG_FILE, DRAFT_FILE
from ..model.draft import Eagle3DraftConfig
from .checkpoint import MAPPING_NAMES, DraftCheckpoint
from .errors import ExportError


def _draft_config(d: dict) -> Eagle3DraftConfig:
    names = {f.name for f in dataclasses.fields(Eagle3DraftConfig)}
    return Eagle3DraftConfig(**{k: v for k, v in d.items() if k in names})


def trained_draft(train_rec, extract_rec, prepare_rec, target) -> DraftCheckpoint:
    """The train run's draft with layer ids, vocabulary mapping and sizes checked against the manifest."""
    from safetensors.torch import load_file

    from ..artifacts import VOCAB_FILE
    from ..data.vocab import load_vocab

    facts = train_rec.facts
    weights = train_rec.path(DRAFT_FILE)
    conf = train_rec.path(DRAFT_CONFIG_FILE)
    if not weights.is_file() or not conf.is_file():
        raise ExportError(f"the train run {train_rec.config_hash[:12]} has no {weights.name} + {conf.name} in "
                          f"{train_rec.out_dir}; re-run `python -m eagle3 stage=train`")
    cfg = _draft_config(json.loads(conf.read_text()))
    tensors = load_file(str(weights))
    own_d2t, own_t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    embed = tensors.pop("embed_tokens.weight", None)

    if extract_rec is not None:
        layer_ids = list(extract_rec.facts.layout.layer_ids)
        H = extract_rec.facts.layout.hidden_size
        states = f"the extract run {extract_rec.config_hash[:12]} stored"
    else:  # trained online (train.hidden_states=online): the producer's facts, recorded by the train run
        producer = facts.producer or {}
        if not producer.get("layer_ids") or not producer.get("hidden_size"):
            raise ExportError(f"the train run {train_rec.config_hash[:12]} was trained online but records no "
                              f"producer layer ids and hidden size; re-run `python -m eagle3 stage=train`")
        layer_ids = [int(i) for i in producer["layer_ids"]]
        H = int(producer["hidden_size"])
        states = f"the online producer of train run {train_rec.config_hash[:12]} computed"
    fc = tensors.get("fc.weight")
    if fc is not None and fc.shape[1] != len(layer_ids) * H:
        raise ExportError(f"the trained draft's fc takes {fc.shape[1]} inputs = {fc.shape[1] / H:g} aux states of "
                          f"width {H}, but {states} {len(layer_ids)} "
                          f"layers {layer_ids}: the draft was not trained on this experiment's hidden states. "
                          f"Re-run `python -m eagle3 stage=train`.")
    if list(cfg.aux_layer_ids) != layer_ids:
        raise ExportError(f"the trained draft's config says layer ids {list(cfg.aux_layer_ids)}, {states} "
                          f"{layer_ids}; re-run `python -m eagle3 stage=train`")
    if H != target.hidden_size or cfg.target_hidden_size != target.hidden_size:
        raise ExportError(f"the draft fuses states of width {cfg.target_hidden_size}, the target {target.path} "
                          f"has hidden size {target.hidden_size}")
    if prepare_rec.facts.tokenizer_hash not in (None, target.tokenizer_hash):
        raise ExportError(f"the prepare run {prepare_rec.config_hash[:12]} used another tokenizer than the target "
                          f"{target.path}; re-run the pipeline for this target")
    d2t, t2d = load_vocab(prepare_rec.path(VOCAB_FILE))
    if cfg.draft_vocab_size != d2t.numel() or cfg.vocab_size != t2d.numel():
        raise ExportError(f"the trained draft has vocab {cfg.draft_vocab_size}/{cfg.vocab_size} (draft/target), the "
                          f"prepare run's mapping {d2t.numel()}/{t2d.numel()}; re-run `python -m eagle3 stage=train`")
    if own_d2t is not None and not torch.equal(own_d2t.long(), d2t.long()):
        raise ExportError(f"the trained draft's d2t differs from the prepare run {prepare_rec.config_hash[:12]}'s "
                          f"vocabulary mapping; re-run `python -m eagle3 stage=train`")
    if own_t2d is not None and not torch.equal(own_t2d.bool(), t2d.bool()):
        raise ExportError("the trained draft's t2d differs from the prepare run's vocabulary mapping")
    source = {"kind": "train", "train_run": train_rec.config_hash[:12],
              "extract_run": extract_rec.config_hash[:12] if extract_rec is not None else None,
              "hidden_states": facts.hidden_states,
              "prepare_run": prepare_rec.config_hash[:12], "train_steps": facts.steps,
              # the train stage's own estimate, from its held-out TTT accuracies (k = 1, 2, ...)
              "train_expected_acceptance_length": list(facts.final.accept_len) if facts.final else None}
    for name in MAPPING_NAMES:
        tensors.pop(name, None)
    return DraftCheckpoint(cfg, tensors, d2t.long(), t2d.bool(), embed, source).validate()


def directory_identity(path) -> str:
    from ..hashing import hash_files

    p = Path(path).expanduser().resolve()
    if not p.is_dir():
        raise ExportError(f"export.from={str(p)!r} is not a directory")
    return hash_files([f for f in p.rglob("*") if f.is_file()], p)


def load_source(cfg, manifest, target, needs_prompts: bool, stage: str = "export"):
    """(DraftCheckpoint, inputs for the manifest, prepare record or None, identity of export.from),
    for ``stage`` (export or eval: both consume what export does)."""
    from ..manifest import ManifestError
    from .importers import import_draft

    export_cfg = cfg.export
    if export_cfg.from_:
        from_id = directory_identity(export_cfg.from_)
        ckpt = import_draft(export_cfg.from_, target.config, export_cfg.from_layer_convention)
        needs_prompts = needs_prompts and not export_cfg.prompts
        inputs = manifest.consume_upstream(stage, target.identity(), only=("prepare",) if needs_prompts else ())
        return ckpt, inputs, inputs.get("prepare"), from_id
    inputs = manifest.consume_upstream(stage, target.identity(), only=("prepare", "train"), cfg=cfg)
    if inputs["train"].facts.hidden_states != "online":  # trained on a store: its extract run too
        inputs = manifest.consume_upstream(stage, target.identity(), cfg=cfg)
        used = inputs["train"].data.get("upstream", {}).get("extract")
        if used != inputs["extract"].config_hash:
            raise ManifestError(f"the train run {inputs['train'].config_hash[:12]} was trained on extract run "
                                f"{str(used)[:12]}, but this config's extract run is {inputs['extract'].config_hash[:12]}: "
                                f"give the extract.* overrides the draft was trained with (or re-run stage=train).")
    ckpt = trained_draft(inputs["train"], inputs.get("extract"), inputs["prepare"], target)
    return ckpt, inputs, inputs["prepare"], None


def check_embedding(ckpt, target, include: bool) -> None:
    """Settle which embedding the export carries.

    include=true: the draft's own, else the target's (the one it was trained with), read alone from
    the checkpoint. include=false: none, so vLLM shares the target's; a draft whose own embedding
    differs from the target's would then compute something else, so that is refused.
    """
    from ..target_weights import read_target_head

    if ckpt.embed is None and not include:
        return
    theirs = read_target_head(target.path, target.config, roles=("embed",))["embed"]
    if include:
        if ckpt.embed is None:
            ckpt.embed = theirs
        return
    if theirs.shape != ckpt.embed.shape or not torch.allclose(theirs.float(), ckpt.embed.float(), rtol=1e-2, atol=1e-3):
        raise ExportError("the draft carries its own embed_tokens, which differs from the target's embedding; an "
                          "export without it would make vLLM use the target's. Pass export.include_embedding=true.")
    ckpt.embed = None  # identical to the target's: vLLM shares the target's at load time
