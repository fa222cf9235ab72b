"""The one interface every extraction backend implements, the progress they report, and the registry.

A backend is a producer of hidden states with the target loaded. What it is built from is one
value, an :class:`EngineSpec` (the target, the store layout, the target's dtype, ``extract.*`` (whose
``backend`` names the class: the one place it is said), the engine's ``max_model_len`` and the
backend's own options), made once by its caller (the extract stage and online training from the
derived :class:`~eagle3.extract.layout.ExtractLayout`) and handed on whole to :func:`make_extractor`
and :func:`eagle3.extract.extract_store`. ``make_extractor`` builds

    cls(target_path, layout, target_dtype, extract_cfg, max_model_len=..., work_dir=..., **options)

(``work_dir``: scratch space on the store's filesystem; a backend ignores what it does not need),
and then ``run(specs, store_dir, progress)`` writes every shard of ``specs`` and returns their
records. The shard loop itself (begin / write / end / poll / close / abort) is
:func:`eagle3.extract.writer.write_shards`: a backend supplies what one shard's samples produce,
the writer does the rest. A new producer (SGLang, online training, ...) is one module with one
class, and one line in :data:`BACKENDS`.

Nothing here imports torch or vLLM: backends are resolved by name when they are made, so the heavy
imports stay in the backend that needs them.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Protocol, runtime_checkable

from ..store import ShardSpec, StoreLayout
from .layout import ExtractLayout
from .layout import max_model_len as _max_model_len


class Progress:
    """Token-level progress bar; backends call ``update(tokens)`` as samples complete."""

    def __init__(self, total_tokens: int, desc: str, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_tokens, desc=desc, unit="tok", unit_scale=True, disable=not enabled)
        self.t0 = time.perf_counter()
        self.tokens = 0

    def update(self, n: int) -> None:
        self.tokens += n
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


@runtime_checkable
class Extractor(Protocol):
    """What ``extract_store`` needs from a backend."""

    name: str
    # The last run's accounting (CPU / wait seconds of capture and writer), or None.
    last_stats: Optional[dict]

    def run(self, specs: Iterable[ShardSpec], store_dir: Path, progress: Progress) -> list[dict]:
        """Write every shard of ``specs`` (in order) into ``store_dir``; return the shards' records
        (sidecar content plus ``split`` and ``k``). On failure no incomplete shard is left behind."""
        ...

    def close(self) -> None:
        """Release the target and engine; the extractor is unusable afterwards."""
        ...


# name -> "module:Class", imported when that backend is made.
BACKENDS: dict[str, str] = {
    "vllm": "eagle3.extract.vllm_backend:VLLMExtractor",
    "vllm_connector": "eagle3.extract.vllm_connector_backend:VLLMConnectorExtractor",
    "hf": "eagle3.extract.hf_backend:HFExtractor",
}


def backend_class(name: str) -> type:
    """The class registered as ``name``; a ValueError names the valid ones."""
    try:
        spec = BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"extract.backend={name!r} is not one of {', '.join(repr(n) for n in BACKENDS)}") from None
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class EngineSpec:
    """What an extraction backend is built from, as one value (see the module's docstring)."""

    target_path: Optional[str]
    layout: StoreLayout
    target_dtype: str
    extract_cfg: Any
    """``extract.*`` (eagle3.config.ExtractConfig); ``extract_cfg.backend`` names the backend."""
    max_model_len: int
    """Longest sample + 1, rounded up to 16, for engines that size their caches."""
    options: Mapping = field(default_factory=dict)
    """Backend keywords (``trust_remote_code``; the vllm backend's ``aux_setup``, a benchmark's
    ``load_format``)."""

    @property
    def backend(self) -> str:
        return self.extract_cfg.backend

    @classmethod
    def of(cls, target, derived: ExtractLayout, extract_cfg, **options) -> "EngineSpec":
        """The stage's and online training's: ``target`` (eagle3.target.TargetInfo) run as ``derived``
        (eagle3.extract.layout.derive_store_layout) says."""
        return cls(str(target.path), derived.layout, derived.target_dtype, extract_cfg, derived.max_model_len,
                   {"trust_remote_code": bool(target.trust_remote_code), **options})

    @classmethod
    def for_splits(cls, target_path, layout: StoreLayout, target_dtype: str, extract_cfg, splits: Mapping,
                   **options) -> "EngineSpec":
        """Without a derived layout (tests, benchmarks): the engine sized for ``splits``' longest sample
        ({name: Samples or anything with ``lengths``})."""
        return cls(None if target_path is None else str(target_path), layout, target_dtype, extract_cfg,
                   _max_model_len(s.lengths for s in splits.values()), dict(options))


def make_extractor(engine: EngineSpec, work_dir) -> Extractor:
    """The backend ``engine`` describes, with the target loaded; ``extractor.run(specs, store_dir,
    progress)`` writes shards. ``work_dir``: scratch space on the store's filesystem (the connector's
    per-request files)."""
    cls = backend_class(engine.backend)
    return cls(engine.target_path, engine.layout, engine.target_dtype, engine.extract_cfg,
               max_model_len=engine.max_model_len, work_dir=work_dir, **engine.options)
