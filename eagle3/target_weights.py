"""Read a few named tensors of a target checkpoint without loading the model.

The train stage needs the target's token embedding, final norm and lm_head in floating point,
even when the served checkpoint is huge or its body is quantized (e.g. INT4 Kimi-K2). Through
``model.safetensors.index.json`` (or the single ``model.safetensors``) only the shards holding
those tensors are opened, and from them only those tensors are read (``safe_open`` maps the file;
nothing else is touched).

Names differ per family; roles are resolved in this order:
- exact names of the common layouts (Llama/Qwen/Mistral/DeepSeek-V3/Kimi: ``model.*`` and
  ``lm_head.weight``; multimodal wrappers: ``language_model.model.*``, ``model.language_model.*``,
  ``language_model.lm_head.weight``);
- else a unique name ending in the role's suffix outside decoder layers (DeepSeek's MTP layers
  carry their own ``embed_tokens``/``shared_head``) and outside vision/audio towers;
- ``lm_head`` falls back to the embedding when the config ties them (``tie_word_embeddings``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import safetensors

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

ROLE_NAMES = {
    "embed": ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
              "model.language_model.embed_tokens.weight", "transformer.wte.weight", "model.embed.weight"),
    "norm": ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight",
             "transformer.ln_f.weight"),
    "lm_head": ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight",
                "output.weight"),
}
ROLE_SUFFIXES = {"embed": ("embed_tokens.weight",), "norm": (".norm.weight",), "lm_head": ("lm_head.weight",)}
_EXCLUDE = re.compile(r"(^|\.)(layers|h|blocks)\.\d+\.|vision|visual|audio|mm_projector|multi_modal|mtp")


class TargetWeightsError(ValueError):
    pass


class CheckpointIndex:
    """Tensor name -> file of a safetensors checkpoint directory (sharded or single file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX_NAME
        if index.exists():
            self.weight_map = dict(json.loads(index.read_text())["weight_map"])
        elif (self.path / SINGLE_NAME).exists():
            with safetensors.safe_open(str(self.path / SINGLE_NAME), framework="pt") as f:
                self.weight_map = {k: SINGLE_NAME for k in f.keys()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise TargetWeightsError(f"{self.path} has no {INDEX_NAME}, no {SINGLE_NAME} and no *.safetensors: "
                                         f"the train stage reads the target's embedding, norm and lm_head from "
                                         f"safetensors files (convert .bin checkpoints first)")
            self.weight_map = {}
            for p in files:
                with safetensors.safe_open(str(p), framework="pt") as f:
                    self.weight_map.update({k: p.name for k in f.keys()})

    def resolve(self, role: str, config: Optional[dict] = None) -> str:
        names = self.weight_map
        for n in ROLE_NAMES[role]:
            if n in names:
                return n
        cands = [n for n in names if n.endswith(ROLE_SUFFIXES[role]) and not _EXCLUDE.search(n)]
        if role == "norm":  # the final norm sits directly under the model, not in a block
            cands = [n for n in cands if n.count(".") <= 3]
        if len(cands) == 1:
            return cands[0]
        if len(cands) > 1:
            raise TargetWeightsError(f"the target checkpoint {self.path} has several candidates for its {role} "
                                     f"tensor: {cands[:6]}; none of the known names {list(ROLE_NAMES[role])}")
        if role == "lm_head" and _tied(config):
            return self.resolve("embed", config)
        quantized = [n for n in names if n.startswith(tuple(x.rsplit('.', 1)[0] + "." for x in ROLE_NAMES[role]))]
        hint = f" (found quantized parts {quantized[:4]}: the train stage needs it in floating point)" if quantized else ""
        raise TargetWeightsError(f"the target checkpoint {self.path} has no {role} tensor "
                                 f"(looked for {list(ROLE_NAMES[role])}){hint}")

    def read(self, names: dict) -> dict:
        """{key: tensor} for {key: tensor name}, opening each needed file once and only those."""
        by_file: dict[str, list] = {}
        for key, name in names.items():
            if name not in self.weight_map:
                raise TargetWeightsError(f"tensor {name!r} is not in {self.path}")
            by_file.setdefault(self.weight_map[name], []).append((key, name))
        out = {}
        for fname, items in by_file.items():
            with safetensors.safe_open(str(self.path / fname), framework="pt") as f:
                for key, name in items:
                    out[key] = f.get_tensor(name)
        return out


def _tied(config: Optional[dict]) -> bool:
    if not config:
        return False
    tc = config.get("text_config", config)
    return bool(tc.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


def read_target_head(path: str | Path, config: Optional[dict] = None, roles=("embed", "norm", "lm_head")) -> dict:
    """{'embed': [V, H], 'norm': [H], 'lm_head': [V, H]} (only the requested roles) from a checkpoint
    directory, plus ``names`` ({role: tensor name}) saying where each came from."""
    index = CheckpointIndex(path)
    if config is None and (Path(path) / "config.json").exists():
        config = json.loads((Path(path) / "config.json").read_text())
    names = {role: index.resolve(role, config) for role in roles}
    tensors = index.read(names)
    for role, t in tensors.items():
        if not t.is_floating_point():
            raise TargetWeightsError(f"the target's {role} tensor {names[role]!r} is {t.dtype}, not floating point "
                                     f"(quantized?); the train stage needs it unquantized")
    tensors["names"] = names
    return tensors
