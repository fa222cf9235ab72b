"""Readers: a draft directory written by eagle3 or by another trainer -> :class:`DraftCheckpoint`.

Layouts understood:
- ``speculators``: ``config.json`` with ``speculators_config`` + ``transformer_layer_config``,
  tensors ``layers.0.*`` (vLLM's speculators format).
- ``midlayer``: an HF-style ``config.json`` (``LlamaForCausalLMEagle3`` and friends) with tensors
  ``midlayer.*`` or ``layers.0.*`` (EAGLE, SpecForge/SGLang, vLLM-style exports, eagle3's own).

Layer-id conventions differ: vLLM's id k is the stream *entering* layer k; SGLang/SpecForge write
the index of the layer whose *output* is taken (their k = our k+1). The top-level
``eagle_aux_hidden_state_layer_ids`` is vLLM's field and read as vLLM ids; ids only in
``eagle_config`` come from SpecForge/SGLang and are shifted by one unless
``export.from_layer_convention`` says otherwise. Drafts written by eagle3 say which convention
they use in ``eagle3_export.json``.

EAGLE-3.1 options (:func:`_norm_options`): the speculators layout and vLLM-style configs use vLLM's
keys and meanings (``norm_before_fc`` in ``eagle_config`` or top-level, ``fc_norm``, ``norm_output``).
A SpecForge config (midlayer layout, no eagle3 marker, no top-level ``eagle_aux_hidden_state_layer_ids``
nor ``num_aux_hidden_states``, which SpecForge never writes) shares ``fc_norm`` but its
``norm_output`` means "the final norm before lm_head" (SpecForge's default: true) while the fed-back
state is always the pre-norm one, i.e. vLLM's norm_output=false; SpecForge's norm_output=false (no
final norm at all) has no vLLM equivalent and is refused.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import torch

from ..artifacts import EXPORT_MARKER
from ..model.draft import MLA_FIELDS, Eagle3DraftConfig, is_mla_config
from ..model.rope import rope_parameters
from .checkpoint import EMBED_NAME, DraftCheckpoint
from .errors import ImportDraftError

log = logging.getLogger("eagle3.export")

MARKER = EXPORT_MARKER
CONVENTIONS = ("auto", "vllm", "sglang")


def read_weights(path: Path) -> dict:
    """All tensors of a checkpoint directory (*.safetensors, else pytorch_model*.bin)."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    tensors = {}
    if files:
        for f in files:
            tensors.update(load_file(str(f)))
        return tensors
    bins = sorted(path.glob("pytorch_model*.bin")) + sorted(path.glob("*.pt"))
    if not bins:
        raise ImportDraftError(f"{path} holds no weights (*.safetensors or pytorch_model.bin)")
    for f in bins:
        obj = torch.load(str(f), map_location="cpu", weights_only=True)
        if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
            obj = obj["state_dict"]
        tensors.update({k: v for k, v in obj.items() if isinstance(v, torch.Tensor)})
    return tensors


def canonical_names(tensors: dict) -> dict:
    """Map foreign names onto vLLM's: drop a ``model.`` prefix, ``layers.0.`` -> ``midlayer.``."""
    out = {}
    for name, t in tensors.items():
        n = name[len("model."):] if name.startswith("model.") else name
        if n.startswith("layers."):
            idx, _, rest = n[len("layers."):].partition(".")
            if idx != "0":
                raise ImportDraftError(f"tensor {name!r}: drafts with more than one decoder layer are not "
                                       f"supported (vLLM's EAGLE-3 drafts have one midlayer)")
            n = "midlayer." + rest
        if n.startswith("midlayers.0."):  # SGLang's module prefix for the first layer
            n = "midlayer." + n[len("midlayers.0."):]
        if n in out:
            raise ImportDraftError(f"tensors {name!r} and another map to the same name {n!r}")
        out[n] = t
    return out


def detect_layout(config: dict) -> str:
    return "speculators" if "speculators_config" in config else "midlayer"


def _layer_ids(config: dict, layer: dict, layout: str, marker: Optional[dict], convention: str,
               num_target_layers: int) -> tuple[list[int], str]:
    """(aux ids in vLLM's convention, how they were read)."""
    top = config.get("eagle_aux_hidden_state_layer_ids") or layer.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or layer.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = top or nested
    if not ids:
        L = num_target_layers
        return [2, L // 2, L - 3], "default (2, L//2, L-3), the same in vLLM and SGLang"
    ids = [int(i) for i in ids]
    if convention == "auto":
        if marker is not None:
            convention = marker.get("layer_id_convention", "vllm")
        elif layout == "speculators" or top:
            convention = "vllm"
        else:
            convention = "sglang"
            log.warning("export.from: layer ids %s only in eagle_config: read as SpecForge/SGLang ids (output of "
                        "layer i) = vLLM ids %s. Set export.from_layer_convention=vllm if they already are vLLM's.",
                        ids, [i + 1 for i in ids])
    if convention == "sglang":
        return [i + 1 for i in ids], f"SGLang convention {ids}, shifted by one"
    return ids, "vLLM convention"


def specforge_style(config: dict, layout: str, marker: Optional[dict]) -> bool:
    """A SpecForge-written config: midlayer layout, not eagle3's, none of the keys only vLLM-style
    writers put there (top-level aux ids, num_aux_hidden_states)."""
    return (layout == "midlayer" and marker is None and not config.get("eagle_aux_hidden_state_layer_ids")
            and "num_aux_hidden_states" not in config)


def _norm_options(path: Path, config: dict, layer: dict, layout: str, marker: Optional[dict]) -> dict:
    """The EAGLE-3.1 options as vLLM's meanings (see the module docstring)."""
    def flag(name):
        for where in ((config.get("eagle_config") or {}), config, layer):
            if name in where:
                value = where[name]
                if not isinstance(value, bool):
                    raise ImportDraftError(f"{path}: {name}={value!r} in its config.json is not a boolean")
                return value
        return None

    options = {name: bool(flag(name)) for name in ("norm_before_fc", "fc_norm")}
    norm_output = flag("norm_output")
    if specforge_style(config, layout, marker) and norm_output is not None:
        if norm_output is False:
            raise ImportDraftError(f"{path}: a SpecForge config with norm_output=false: SpecForge's draft then applies "
                                   f"no final norm before lm_head, which neither vLLM nor eagle3's draft computes")
        log.warning("export.from: %s is a SpecForge config: its norm_output=true means the final norm before "
                    "lm_head with the pre-norm state fed back, i.e. vLLM's norm_output=false (the export writes "
                    "that)", path)
        norm_output = False
    options["norm_output"] = bool(norm_output)
    return options


def import_draft(path, target_config: dict, convention: str = "auto", marker: Optional[dict] = None) -> DraftCheckpoint:
    """Read a draft directory; ``target_config`` is the target's config.json (sizes are checked);
    ``marker``: its eagle3 export marker when the file is not written yet (export's own check)."""
    path = Path(path).expanduser().resolve()
    if convention not in CONVENTIONS:
        raise ImportDraftError(f"layer id convention {convention!r} is not one of {CONVENTIONS}")
    if not (path / "config.json").is_file():
        from ..artifacts import DRAFT_CONFIG_FILE

        if (path / DRAFT_CONFIG_FILE).is_file():  # an eagle3 train run's own directory
            raise ImportDraftError(
                f"export.from={str(path)!r} is an eagle3 train run's directory (its {DRAFT_CONFIG_FILE}, no config.json): "
                f"export it in its own experiment with the overrides it was trained with (`python -m eagle3 "
                f"stage=export` + that run's extract.*/train.* overrides; `stage=status` lists the runs), or pass an "
                f"exported draft (an export run's model/ directory) or a speculators / SGLang checkpoint")
        raise ImportDraftError(f"export.from={str(path)!r} has no config.json: not a draft checkpoint directory")
    config = json.loads((path / "config.json").read_text())
    if marker is None:
        marker = json.loads((path / MARKER).read_text()) if (path / MARKER).is_file() else None
    layout = detect_layout(config)
    layer = dict(config.get("transformer_layer_config") or {}) if layout == "speculators" else dict(config)
    if not layer.get("hidden_size"):
        raise ImportDraftError(f"{path}/config.json has no hidden_size{' in transformer_layer_config' if layout == 'speculators' else ''}")
    options = _norm_options(path, config, layer, layout, marker)
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ImportDraftError(f"{path}: num_hidden_layers={layer.get('num_hidden_layers')}; only one-layer "
                               f"EAGLE-3 drafts are supported")

    tc = target_config.get("text_config", target_config)
    L, Ht, V = int(tc["num_hidden_layers"]), int(tc["hidden_size"]), int(tc["vocab_size"])
    ids, how = _layer_ids(config, layer, layout, marker, convention, L)
    bad = [i for i in ids if not 0 <= i <= L]
    if bad:
        raise ImportDraftError(f"{path}: aux layer ids {ids} ({how}) are out of range for a {L}-layer target")

    tensors = canonical_names(read_weights(path))
    d2t = tensors.pop("d2t", None)
    t2d = tensors.pop("t2d", None)
    embed = tensors.pop(EMBED_NAME, None)
    for junk in [k for k in tensors if k.startswith(("verifier_", "mask_hidden"))]:
        tensors.pop(junk)
    if "fc.weight" not in tensors or "lm_head.weight" not in tensors:
        raise ImportDraftError(f"{path}: no fc.weight / lm_head.weight among its tensors "
                               f"({sorted(tensors)[:6]} ...); not an EAGLE-3 draft")
    H = int(layer["hidden_size"])
    target_hidden = int(config.get("target_hidden_size") or layer.get("target_hidden_size") or H)
    if target_hidden != Ht:
        raise ImportDraftError(f"{path}: the draft fuses target states of width {target_hidden}, the target's "
                               f"hidden size is {Ht}: it was trained for another target")
    vocab = int(layer.get("vocab_size") or V)
    if vocab != V:
        raise ImportDraftError(f"{path}: vocab_size {vocab} differs from the target's {V}: another tokenizer")
    fc_in = tensors["fc.weight"].shape[1]
    if fc_in != len(ids) * Ht:
        raise ImportDraftError(f"{path}: fc takes {fc_in} inputs = {fc_in / Ht:g} aux states of width {Ht}, but "
                               f"the layer ids {ids} ({how}) name {len(ids)}; fix the ids in its config.json")
    draft_vocab = int(config.get("draft_vocab_size") or layer.get("draft_vocab_size") or tensors["lm_head.weight"].shape[0])
    if d2t is None:
        if draft_vocab != V:
            raise ImportDraftError(f"{path}: draft vocabulary {draft_vocab} < target vocabulary {V} but no d2t "
                                   f"tensor: the draft ids cannot be mapped to target ids")
        d2t = torch.zeros(V, dtype=torch.long)
    d2t = d2t.long()
    if t2d is None:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[torch.arange(d2t.numel()) + d2t] = True
    heads = int(layer["num_attention_heads"])
    model_type = str(layer.get("model_type", "llama"))
    archs = " ".join(config.get("architectures") or []) + " " + " ".join(layer.get("architectures") or [])
    mla = {}
    if "deepseek" in model_type or "Deepseek" in archs or "kv_lora_rank" in layer:
        # an MLA draft (vLLM's deepseek_eagle3.py): read in vLLM's HF-style layout (what eagle3 writes)
        missing = [k for k in MLA_FIELDS if k not in layer]
        if layout == "speculators" or missing:
            raise ImportDraftError(f"{path}: an MLA draft (vLLM's deepseek_eagle3.py, {archs.strip() or model_type}) "
                                   f"{'in the speculators layout' if layout == 'speculators' else f'without {missing}'}"
                                   f": export.from reads MLA drafts in vLLM's layout with their MLA sizes only")
        mla = {k: (int(layer[k]) if layer[k] is not None else None) for k in MLA_FIELDS}
        if not is_mla_config(target_config):
            raise ImportDraftError(f"{path}: an MLA draft, but the target has no MLA (no kv_lora_rank)")
    arch = "deepseek" if mla else "qwen3" if model_type == "qwen3" or "Qwen3" in archs else "llama"
    theta, scaling = rope_parameters(layer)
    norm_before_residual = config.get("norm_before_residual", layer.get("norm_before_residual"))
    if norm_before_residual is None:  # vLLM's defaults for each config style
        norm_before_residual = layout == "speculators"
    cfg = Eagle3DraftConfig(
        hidden_size=H, target_hidden_size=target_hidden, num_attention_heads=heads,
        num_key_value_heads=heads if mla else int(layer.get("num_key_value_heads") or heads),
        head_dim=(mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]) if mla else int(layer.get("head_dim") or H // heads),
        intermediate_size=int(layer["intermediate_size"]),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), vocab_size=V, draft_vocab_size=draft_vocab,
        aux_layer_ids=ids, rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(layer.get("max_position_embeddings", 8192)),
        norm_before_residual=bool(norm_before_residual), architecture=arch, **options, **mla)
    source = {"kind": "import", "path": str(path), "layout": layout, "layer_ids_read_as": how,
              "written_by_eagle3": marker is not None}
    ckpt = DraftCheckpoint(cfg, tensors, d2t, t2d.bool(), embed, source)
    try:
        return ckpt.validate()
    except Exception as e:
        raise ImportDraftError(f"{path}: {e}") from None
