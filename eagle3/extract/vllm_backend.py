"""extract.backend=vllm: the real vLLM, in-process, prefill only (max_tokens=1), with the capture of
``vllm_worker.HiddenStateCapture`` reading aux states between execute_model() and sample_tokens().

Engine settings and why:
- The V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``, pinned by eagle3.vllm_compat for every
  engine): the capture reads V1 runner state (``execute_model_state``, ``input_batch``).
- Prefix caching off: cached prefix tokens are not recomputed, so their states would be missing
  (the writer's coverage check would refuse the shard).
- Chunked prefill on (``extract.enable_chunked_prefill``): long samples are split across steps;
  every chunk is written at its position, so results do not depend on the chunking.
- ``extract.aux_setup``: ``load_time`` (GPU default) keeps torch.compile and CUDA graphs, which
  then include the aux outputs; ``runtime`` needs an eager engine (``extract.enforce_eager=true``;
  on CPU vLLM is always eager) and is refused otherwise, before the model loads.
- ``extract.async_scheduling`` (off by default): prefill-heavy extraction gains little from it.
- One shard at a time: a shard's requests are submitted together and drained before the next
  shard starts. A shard's batches then depend only on its own samples, so a resumed run (or
  another scale-out process) computes bit-identical states for it; the cost is one partly filled
  step per shard.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ..errors import Eagle3Error
from ..store import ShardSpec, StoreLayout, StoreWriteError
from .backend import Progress
from .writer import write_shards

log = logging.getLogger("eagle3.extract")

EXTENSION = "eagle3.extract.vllm_worker.HiddenStateCapture"


class ExtractError(Eagle3Error):
    pass


def resolve_aux_setup(requested: str, *, cpu: bool) -> str:
    """``extract.aux_setup``'s ``auto``: runtime on CPU (vLLM is eager there), load_time on GPU."""
    if requested == "auto":
        return "runtime" if cpu else "load_time"
    if requested not in ("runtime", "load_time"):
        raise ExtractError(f"extract.aux_setup must be auto, runtime or load_time, got {requested!r}")
    return requested


def refuse_before_load(target_path, target_dtype: str, extract_cfg, aux_setup: str, *, cpu: bool) -> None:
    """Settings that would fail (or compute wrong states) only after the model loaded: refused now."""
    from ..vllm_engine import uses_mla

    if aux_setup == "runtime" and not cpu and not extract_cfg.enforce_eager:
        raise ExtractError(
            "extract.aux_setup=runtime switches the aux hidden-state outputs on after the engine started, but "
            "with extract.enforce_eager=false vLLM has already compiled the model and captured its CUDA graphs "
            "without them: the graphs would never return the aux states. Use extract.aux_setup=load_time (the GPU "
            "default: compiled, with CUDA graphs), or extract.enforce_eager=true (eager, slower).")
    mla = not cpu and uses_mla(target_path)
    if mla and extract_cfg.enforce_eager:
        from ..vllm_compat import eager_mla_verdict, installed_version

        why = eager_mla_verdict(installed_version())
        if why:
            raise ExtractError(f"the target {target_path} uses multi-head latent attention, and {why}")
    if mla and target_dtype == "float32":
        raise ExtractError(
            f"the target {target_path} uses multi-head latent attention (kv_lora_rank), and vLLM on GPU has no MLA "
            f"attention backend for float32 (\"No valid attention backend ... use_mla=True\"; FlashMLA, FlashAttention-"
            f"MLA and Triton-MLA take bf16/fp16). Set target.dtype=bfloat16: the parity check then compares the "
            f"stored states with a float32 transformers reference, its tolerance set from transformers' own "
            f"bfloat16 error.")


def engine_kwargs(extract_cfg, layout: StoreLayout, target_dtype: str, max_model_len: int) -> dict:
    max_batched = extract_cfg.max_num_batched_tokens
    if not extract_cfg.enable_chunked_prefill and max_batched < max_model_len:
        raise ExtractError(f"extract.enable_chunked_prefill=false needs extract.max_num_batched_tokens >= the "
                           f"longest sample + 1 ({max_model_len}), got {max_batched}")
    kw = dict(dtype=target_dtype, max_num_batched_tokens=max_batched, max_num_seqs=extract_cfg.max_num_seqs,
              enable_chunked_prefill=extract_cfg.enable_chunked_prefill,
              async_scheduling=bool(extract_cfg.async_scheduling),
              tensor_parallel_size=extract_cfg.tensor_parallel_size, kv_cache_gb=extract_cfg.kv_cache_gb,
              gpu_memory_utilization=extract_cfg.gpu_memory_utilization, max_model_len=max_model_len)
    if extract_cfg.enforce_eager:
        kw["enforce_eager"] = True
    return kw


def extract_hidden_states_spec(layout: StoreLayout) -> dict:
    """vLLM's extract_hidden_states method: switches the model's aux outputs on at load time."""
    ids = list(layout.layer_ids) + [layout.last_layer_id]
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}


def sampling_params(tag=None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                          extra_args={"eagle3": list(tag)} if tag is not None else None)


class VLLMExtractor:
    """Drives an in-process vLLM engine shard by shard; the rank-0 worker writes the shards."""

    name = "vllm"

    def __init__(self, target_path: str, layout: StoreLayout, target_dtype: str, extract_cfg, max_model_len: int,
                 aux_setup: str | None = None, *, work_dir=None, trust_remote_code: bool = False, **engine_extra):
        """``aux_setup``: overrides ``extract_cfg.aux_setup`` (the benchmark's); ``engine_extra``: more
        ``vllm.LLM`` arguments (the benchmark's ``load_format=dummy``)."""
        from ..vllm_engine import build_llm, import_vllm, on_cpu

        import_vllm()
        cpu = on_cpu()
        aux_setup = resolve_aux_setup(aux_setup or extract_cfg.aux_setup, cpu=cpu)
        refuse_before_load(target_path, target_dtype, extract_cfg, aux_setup, cpu=cpu)
        kwargs = engine_kwargs(extract_cfg, layout, target_dtype, max_model_len)
        if aux_setup == "load_time":
            kwargs["speculative_config"] = extract_hidden_states_spec(layout)
        kwargs.update(engine_extra)
        log.info("extract: vLLM engine for %s (%s, aux outputs switched on at %s, chunked prefill %s, "
                 "max_num_batched_tokens %d, TP %d%s)", target_path, "CPU" if cpu else "GPU", aux_setup,
                 extract_cfg.enable_chunked_prefill, extract_cfg.max_num_batched_tokens,
                 extract_cfg.tensor_parallel_size, ", eager" if kwargs.get("enforce_eager") else "")
        self.layout = layout
        self.aux_setup = aux_setup
        self.llm = build_llm(target_path, worker_extension_cls=EXTENSION, work="batch",
                             trust_remote_code=trust_remote_code, **kwargs)
        self.capture_info = None
        self.last_stats = None  # CPU seconds of the capture and the writer thread in the last run
        self.engine_info = engine_info(self.llm)
        log.info("extract: engine %s", self.engine_info)

    # -- RPC helpers ----------------------------------------------------------------------------
    def _rpc(self, method: str, *args):
        return self.llm.collective_rpc(method, args=args)[0]

    def start_capture(self, store_dir: Path) -> None:
        cfg = {"store_dir": str(store_dir), "layout": self.layout.to_json(), "aux_setup": self.aux_setup,
               "capture_ids": list(self.layout.layer_ids) + [self.layout.last_layer_id]}
        self.capture_info = json.loads(self._rpc("eagle3_capture_start", json.dumps(cfg)))
        log.info("extract: capture installed in %s (aux layers %s)", self.capture_info["runner"],
                 self.capture_info["aux_layers"])

    # -- extraction ------------------------------------------------------------------------------
    def _produce(self, spec: ShardSpec, progress: Progress):
        """Submits a shard's samples and steps the engine until they are done. The rows are written
        by the worker (between execute_model() and sample_tokens()), so nothing is yielded but
        ``None`` per step: the shard loop polls the worker's writer in between."""
        engine = self.llm.llm_engine
        for j, ids in enumerate(spec.input_ids):
            if len(ids):
                engine.add_request(f"{spec.split}-{spec.first + j}", {"prompt_token_ids": [int(x) for x in ids]},
                                   sampling_params((spec.split, spec.k, j)))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    progress.update(len(out.prompt_token_ids))
            yield None

    def run(self, specs: list[ShardSpec], store_dir: Path, progress: Progress) -> list[dict]:
        sink = _WorkerWriter(self)
        self.start_capture(store_dir)
        done = write_shards(sink, specs, lambda spec: self._produce(spec, progress))
        self.last_stats = sink.stats
        return done

    def aux_off(self) -> None:
        """Plain serving again (benchmark baseline on the same engine; runtime setup only)."""
        self._rpc("eagle3_aux_off")

    def close(self) -> None:
        from ..vllm_engine import shutdown_llm

        shutdown_llm(self.llm)
        self.llm = None


def engine_info(llm) -> dict:
    """What the engine runs with, read in its rank-0 worker (eagle3_engine_info): runner, compile
    mode, CUDA-graph mode, attention backends, KV-cache blocks and bytes per token."""
    try:
        return json.loads(llm.collective_rpc("eagle3_engine_info")[0])
    except Exception as e:  # noqa: BLE001 - informational only
        return {"error": f"{type(e).__name__}: {e}"}


class _WorkerWriter:
    """The shard writer in vLLM's rank-0 worker, seen from the driver (a :class:`~.writer.ShardSink`).
    Rows never pass through here: the worker's capture writes them; begin/end/poll/close/abort
    travel as RPCs, whose replies are JSON."""

    def __init__(self, ex: VLLMExtractor):
        self.ex = ex
        self.stats = None

    def _check(self, reply: str) -> list:
        r = json.loads(reply)
        if r.get("error"):
            if r.get("kind") == "StoreWriteError" or "disk full" in r["error"]:
                raise StoreWriteError(r["error"])
            raise ExtractError(f"hidden-state capture failed in the vLLM worker: {r['error']}")
        return r.get("done", [])

    def begin(self, spec: ShardSpec) -> None:
        from .vllm_worker import spec_to_payload

        self.ex._rpc("eagle3_begin_shard", spec_to_payload(spec))

    def write(self, batch) -> None:
        raise TypeError("the vllm backend's rows are written inside the worker, not sent from the driver")

    def end(self, key) -> None:
        self.ex._rpc("eagle3_end_shard", key[0], key[1])

    def poll(self) -> list:
        return self._check(self.ex._rpc("eagle3_poll"))

    def close(self) -> list:
        reply = self.ex._rpc("eagle3_capture_stop")
        done = self._check(reply)
        self.stats = json.loads(reply).get("stats")
        return done

    def abort(self) -> None:
        try:
            self.ex._rpc("eagle3_capture_abort")
        except Exception:  # the engine may be dead; the original error matters
            pass
