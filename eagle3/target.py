"""The target model: where it is, what it is (identity hash), and cheap facts about it.

Nothing here loads weights. The identity hash covers config.json, the tokenizer files and the
names and sizes of the weight files, so a different checkpoint or tokenizer changes it without
reading terabytes of weights.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import Eagle3Error
from .hashing import sha256_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


class TargetError(Eagle3Error):
    """The target model is missing or is not a usable HF checkpoint."""


@dataclass
class TargetInfo:
    path: Path
    hash: str
    tokenizer_hash: str
    config: dict

    def identity(self) -> dict:
        return {"path": str(self.path), "hash": self.hash, "tokenizer_hash": self.tokenizer_hash}

    @property
    def text_config(self) -> dict:
        """The language-model part of config.json (multimodal configs nest it)."""
        return self.config.get("text_config", self.config)

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])

    @property
    def torch_dtype(self) -> str:
        return str(self.text_config.get("torch_dtype") or self.text_config.get("dtype") or "float32")

    def run_dtype(self, requested: str = "auto") -> str:
        """The dtype the stages run this target in: ``requested`` (target.dtype), or for ``auto``
        the checkpoint's own."""
        dtype = requested if requested != "auto" else self.torch_dtype.replace("torch.", "")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise TargetError(f"the target's dtype {dtype!r} (config.json) is not float32, bfloat16 or float16; "
                              f"set target.dtype explicitly")
        return dtype


def tokenizer_hash(path: Path) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        p = path / name
        if p.exists() and name != "generation_config.json":
            h.update(name.encode())
            h.update(sha256_file(p).encode())
    return h.hexdigest()


def identify(path: str | Path) -> TargetInfo:
    """Identity of an HF model directory, or a clear error if it is not one."""
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise TargetError(f"target.path={str(path)!r} does not exist. Set target.path to an HF model "
                          f"directory (config.json, tokenizer, safetensors) or target.gguf to a GGUF file.")
    if not (path / "config.json").is_file():
        raise TargetError(f"target.path={str(path)!r} has no config.json: it is not an HF model directory.")
    config = json.loads((path / "config.json").read_text())
    h = hashlib.sha256()
    h.update(sha256_file(path / "config.json").encode())
    tok = tokenizer_hash(path)
    h.update(tok.encode())
    for p in sorted(path.iterdir()):
        if p.suffix in WEIGHT_SUFFIXES or p.name.endswith(".index.json"):
            h.update(f"{p.name}:{p.stat().st_size}".encode())
    return TargetInfo(path=path, hash=h.hexdigest(), tokenizer_hash=tok, config=config)


def resolve(target_cfg, workspace: str | Path) -> TargetInfo:
    """The HF directory to use for ``target``: as given, or converted once from a GGUF file."""
    if target_cfg.path:
        return identify(target_cfg.path)
    from .gguf_convert import convert_gguf, default_gguf

    gguf = Path(target_cfg.gguf).expanduser() if target_cfg.gguf else default_gguf()
    return identify(convert_gguf(gguf, Path(workspace) / "targets"))


def load_tokenizer(info: TargetInfo, chat_template: str = ""):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(info.path))
    if chat_template:
        p = Path(chat_template).expanduser()
        tok.chat_template = p.read_text() if p.is_file() else chat_template
    return tok
