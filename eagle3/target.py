"""The target model: where it is, what it is (identity hash), and cheap facts about it.

Nothing here loads weights into a model. The identity hash covers config.json, the tokenizer files
and the content of every weight file (its sha256 tree, eagle3.hashing.sha256_tree_file), so a
different checkpoint, even one of the same shapes and file sizes (a fine-tune, the same weights
with noise), is a different target, while a byte-identical copy elsewhere is the same one. The
path is recorded beside the identity, not hashed into it.

Reading terabytes on every run would be too slow, so weight digests are cached in
``${workspace}/targets/.weight_digests.json`` by (path, size, mtime, ctime, inode): a file is read
again only after it changed (any write, or setting its mtime back, changes its ctime, which no user
can set). The first run reads every weight file once, on every core (:func:`weight_digests`).

A checkpoint that ships its own Python code (``auto_map`` in config.json or tokenizer_config.json,
for a model or tokenizer class transformers does not have) is refused unless
``target.trust_remote_code=true`` (:func:`check_remote_code`); every transformers and vLLM load is
passed that setting explicitly, so transformers never asks on the terminal whether to run it. The
shipped ``*.py`` files are part of the identity.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .errors import Eagle3Error
from .hashing import sha256_file, sha256_tree_files

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
DIGEST_CACHE = ".weight_digests.json"  # under ${workspace}/targets/
PROGRESS_BYTES = 1 << 30  # a progress bar when at least this much is to be hashed
log = logging.getLogger("eagle3.target")


class TargetError(Eagle3Error):
    """The target model is missing or is not a usable HF checkpoint."""


@dataclass
class TargetInfo:
    path: Path
    hash: str
    tokenizer_hash: str
    config: dict
    files: dict = field(default_factory=dict)  # what the hash covers: {name: digest} (see identity_diff)
    trust_remote_code: bool = False  # target.trust_remote_code: may the loads run the checkpoint's own code

    def identity(self) -> dict:
        """What a run records of its target: the path, the identity hash, the per-file digests it
        covers (so a mismatch can name the file that differs) and the checkpoint's quantization
        (eagle3.quantization.describe; None: not quantized), which the hash covers through
        config.json: the record says which checkpoint (INT4, FP8, ...) the states came from."""
        return {"path": str(self.path), "hash": self.hash, "tokenizer_hash": self.tokenizer_hash,
                "files": dict(self.files), "quantization": self.quantization}

    @property
    def quantization(self) -> Optional[dict]:
        """The checkpoint's quantization as eagle3 records it (eagle3.quantization.describe), or None."""
        from .quantization import describe

        return describe(self.config)

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


def _cache_key(p: Path) -> str:
    st = p.stat()
    return f"{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"


def weight_digests(files: list, cache_dir: Optional[Path] = None, progress: bool = True) -> dict:
    """{file: sha256 tree} of weight files, from the cache in ``cache_dir`` where a file has not
    changed since it was hashed, else read (all leaves of all files on :func:`eagle3.hashing.hash_threads`
    threads, with a progress bar past ``PROGRESS_BYTES``) and added to the cache. The cache is
    written under a lock: processes starting together (ranks, sweep jobs) hash a file once."""
    from contextlib import nullcontext

    from filelock import FileLock

    from .atomic import atomic_write_json

    files = [Path(f) for f in files]
    cache_file = cache_dir / DIGEST_CACHE if cache_dir is not None else None
    if cache_file is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_file) + ".lock") if cache_file is not None else nullcontext():
        try:
            cache = json.loads(cache_file.read_text()) if cache_file is not None else {}
        except (FileNotFoundError, ValueError):
            cache = {}
        keys = {f: _cache_key(f) for f in files}
        out = {f: cache[str(f)]["sha256_tree"] for f in files
               if cache.get(str(f), {}).get("key") == keys[f]}
        todo = [f for f in files if f not in out]
        if not todo:
            return out
        total = sum(f.stat().st_size for f in todo)
        bar = None
        if progress and total >= PROGRESS_BYTES:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"hashing {len(todo)} weight files of {todo[0].parent.name} (once; cached)")
        try:
            out.update(sha256_tree_files(todo, progress=bar.update if bar is not None else None))
        finally:
            if bar is not None:
                bar.close()
        if cache_file is not None:
            for f in todo:
                cache[str(f)] = {"key": keys[f], "sha256_tree": out[f]}
            atomic_write_json(cache_file, cache)
        return out


def identify(path: str | Path, cache_dir: Optional[Path] = None, progress: bool = True) -> TargetInfo:
    """Identity of an HF model directory, or a clear error if it is not one. ``cache_dir``: where
    the weight files' digests are cached (:func:`weight_digests`); None reads them every time."""
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise TargetError(f"target.path={str(path)!r} does not exist. Set target.path to an HF model "
                          f"directory (config.json, tokenizer, safetensors) or target.gguf to a GGUF file.")
    if not (path / "config.json").is_file():
        raise TargetError(f"target.path={str(path)!r} has no config.json: it is not an HF model directory.")
    config = json.loads((path / "config.json").read_text())
    h = hashlib.sha256()
    files = {"config.json": sha256_file(path / "config.json")}
    h.update(files["config.json"].encode())
    tok = tokenizer_hash(path)
    files["tokenizer"] = tok
    h.update(tok.encode())
    for p in sorted(path.glob("*.py")):  # the checkpoint's own code: what runs when it is trusted
        files[p.name] = sha256_file(p)
        h.update(f"{p.name}:{files[p.name]}".encode())
    weights = [p for p in sorted(path.iterdir()) if p.suffix in WEIGHT_SUFFIXES or p.name.endswith(".index.json")]
    digests = weight_digests(weights, cache_dir, progress)
    for p in weights:
        files[p.name] = digests[p]
        h.update(f"{p.name}:{p.stat().st_size}:{digests[p]}".encode())
    return TargetInfo(path=path, hash=h.hexdigest(), tokenizer_hash=tok, config=config, files=files)


def identity_diff(recorded: dict, current: dict) -> str:
    """What differs between two recorded target identities (:meth:`TargetInfo.identity`): the
    files whose digests differ, or are in one only; for a record made before per-file digests,
    what it could cover."""
    if recorded.get("hash") == current.get("hash"):
        return "nothing (the same identity)"
    a, b = recorded.get("files"), current.get("files") or {}
    if not a:
        return ("the recorded run names no per-file digests (recorded by an eagle3 whose identity covered weight "
                "file names and sizes only, not their content)")
    parts = [f"{n} ({str(a[n])[:12]} recorded, {str(b[n])[:12]} now)" for n in sorted(a) if n in b and a[n] != b[n]]
    parts += [f"{n} only in the recorded target" for n in sorted(set(a) - set(b))]
    parts += [f"{n} only in this target" for n in sorted(set(b) - set(a))]
    return "; ".join(parts) or "no file (the identities were computed differently)"


def remote_code(path: Path, config: dict) -> list[str]:
    """Why loading the checkpoint at ``path`` would run its own Python files: one line per class
    (model config, tokenizer) that transformers does not have and the checkpoint's ``auto_map``
    names. Empty when transformers' own classes load it. Reads config files only."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    reasons = []
    model_type = config.get("model_type")
    auto_map = config.get("auto_map") or {}
    if auto_map and model_type not in CONFIG_MAPPING_NAMES:
        reasons.append(f"config.json: model_type {model_type!r} is not one transformers {transformers.__version__} "
                       f"has; its auto_map names {', '.join(sorted(set(map(str, auto_map.values()))))}")
    try:
        tok_conf = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tok_conf = {}
    tok_map = (tok_conf.get("auto_map") or {}).get("AutoTokenizer")
    tok_class = str(tok_conf.get("tokenizer_class") or "")
    if tok_map and not hasattr(transformers, tok_class):
        names = tok_map if isinstance(tok_map, list) else [tok_map]
        reasons.append(f"tokenizer_config.json: tokenizer_class {tok_class!r} is not one transformers has; its "
                       f"auto_map names {', '.join(str(n) for n in names if n)}")
    return reasons


def check_remote_code(info: TargetInfo, trusted: bool) -> None:
    """Refuse a target whose loading would run its own code unless ``trusted``
    (target.trust_remote_code); say which files run when it is."""
    reasons = remote_code(info.path, info.config)
    if not reasons:
        return
    code = ", ".join(sorted(p.name for p in info.path.glob("*.py"))) or "(no *.py beside config.json)"
    if not trusted:
        raise TargetError(
            f"target.path={str(info.path)!r} loads only by running the Python code shipped with it "
            f"({'; '.join(reasons)}). eagle3 runs no code that came with a checkpoint unless asked: read "
            f"{code}, then set target.trust_remote_code=true to let transformers and vLLM import it.")
    log.warning("target.trust_remote_code=true: transformers and vLLM will run the target's own code (%s): %s",
                code, "; ".join(reasons))


def resolve(target_cfg, workspace: str | Path, progress: bool = True) -> TargetInfo:
    """The HF directory to use for ``target``: as given, or converted once from a GGUF file. Weight
    digests are cached under ``${workspace}/targets/``. A checkpoint that needs its own code is
    refused here, before anything loads it, unless ``target.trust_remote_code`` is set."""
    targets = Path(workspace).expanduser().resolve() / "targets"
    if target_cfg.path:
        info = identify(target_cfg.path, targets, progress)
    else:
        from .gguf_convert import convert_gguf, default_gguf

        gguf = Path(target_cfg.gguf).expanduser() if target_cfg.gguf else default_gguf()
        info = identify(convert_gguf(gguf, targets), targets, progress)
    check_remote_code(info, target_cfg.trust_remote_code)
    info.trust_remote_code = bool(target_cfg.trust_remote_code)
    return info


def load_tokenizer(info: TargetInfo, chat_template: str = ""):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(info.path), trust_remote_code=info.trust_remote_code)
    if chat_template:
        p = Path(chat_template).expanduser()
        tok.chat_template = p.read_text() if p.is_file() else chat_template
    return tok
