"""The one interface every extraction backend implements, the progress they report, and the registry.

A backend is a producer of hidden states with the target loaded. It is built as

    cls(target_path, layout, target_dtype, extract_cfg, max_model_len=..., work_dir=..., **options)

(``max_model_len``: longest sample + 1, rounded up, for engines that size their caches;
``work_dir``: scratch space on the store's filesystem; a backend ignores what it does not need),
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
from pathlib import Path
from typing import Iterable, Optional, Protocol, runtime_checkable

from ..store import ShardSpec, StoreLayout


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


def make_extractor(backend: str, target_path, layout: StoreLayout, target_dtype: str, extract_cfg, max_model_len: int,
                   work_dir, **options) -> Extractor:
    """A backend with the target loaded; ``extractor.run(specs, store_dir, progress)`` writes shards.
    ``work_dir``: scratch space on the store's filesystem (the connector's per-request files);
    ``options``: backend-specific keywords (e.g. the vllm backend's ``aux_setup``)."""
    cls = backend_class(backend)
    return cls(None if target_path is None else str(target_path), layout, target_dtype, extract_cfg,
               max_model_len=max_model_len, work_dir=work_dir, **options)
