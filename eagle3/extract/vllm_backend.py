"""extract.backend=vllm: the real vLLM, in-process, prefill only (max_tokens=1), with the capture of
``vllm_worker.HiddenStateCapture`` reading aux states between execute_model() and sample_tokens().

Engine settings and why:
- ``VLLM_USE_V2_MODEL_RUNNER=0``: the capture reads V1 runner state (``execute_model_state``,
  ``input_batch``). vLLM >= 0.33 defaults to the V2 runner on GPU; CPU builds use V1 anyway (V2
  needs Triton). We pin V1 explicitly and log it.
- Prefix caching off: cached prefix tokens are not recomputed, so their states would be missing
  (the writer's coverage check would refuse the shard).
- Chunked prefill on (``extract.enable_chunked_prefill``): long samples are split across steps;
  every chunk is written at its position, so results do not depend on the chunking.
- ``async_scheduling=False``: chunk starts are read from the runner's bookkeeping, which async
  scheduling updates optimistically; prefill-heavy extraction gains little from it.
- One shard at a time: a shard's requests are submitted together and drained before the next
  shard starts. A shard's batches then depend only on its own samples, so a resumed run (or
  another scale-out process) computes bit-identical states for it; the cost is one partly filled
  step per shard.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..errors import Eagle3Error
from ..store import ShardPlan, StoreLayout, StoreWriteError
from .backend import Progress
from .writer import write_shards

log = logging.getLogger("eagle3.extract")

EXTENSION = "eagle3.extract.vllm_worker.HiddenStateCapture"


class ExtractError(Eagle3Error):
    pass


def pin_v1_runner() -> None:
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") not in (None, "0", "false", "False"):
        raise ExtractError("VLLM_USE_V2_MODEL_RUNNER is set to enable the V2 model runner; eagle3's vLLM capture "
                           "reads V1 runner state. Unset it (eagle3 pins VLLM_USE_V2_MODEL_RUNNER=0).")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    log.info("extract: pinned vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0): the capture reads V1 runner state")


def engine_kwargs(ecfg, layout: StoreLayout, target_dtype: str, max_model_len: int) -> dict:
    max_batched = ecfg.max_num_batched_tokens
    if not ecfg.enable_chunked_prefill and max_batched < max_model_len:
        raise ExtractError(f"extract.enable_chunked_prefill=false needs extract.max_num_batched_tokens >= the "
                           f"longest sample + 1 ({max_model_len}), got {max_batched}")
    return dict(dtype=target_dtype, max_num_batched_tokens=max_batched, max_num_seqs=ecfg.max_num_seqs,
                enable_chunked_prefill=ecfg.enable_chunked_prefill, async_scheduling=False,
                tensor_parallel_size=ecfg.tensor_parallel_size, kv_cache_gb=ecfg.kv_cache_gb,
                max_model_len=max_model_len)


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

    def __init__(self, target_path: str, layout: StoreLayout, target_dtype: str, ecfg, max_model_len: int,
                 aux_setup: str = "auto", *, work_dir=None):
        from ..vllm_engine import build_llm, import_vllm, on_cpu

        import_vllm()
        pin_v1_runner()
        cpu = on_cpu()
        if aux_setup == "auto":
            aux_setup = "runtime" if cpu else "load_time"
        if aux_setup not in ("runtime", "load_time"):
            raise ExtractError(f"aux_setup must be auto, runtime or load_time, got {aux_setup!r}")
        kwargs = engine_kwargs(ecfg, layout, target_dtype, max_model_len)
        if aux_setup == "load_time":
            kwargs["speculative_config"] = extract_hidden_states_spec(layout)
        elif not cpu:
            kwargs["enforce_eager"] = True  # runtime switch-on is only valid without compiled graphs
        log.info("extract: vLLM engine for %s (%s, aux outputs switched on at %s, chunked prefill %s, "
                 "max_num_batched_tokens %d, TP %d)", target_path, "CPU" if cpu else "GPU", aux_setup,
                 ecfg.enable_chunked_prefill, ecfg.max_num_batched_tokens, ecfg.tensor_parallel_size)
        self.layout = layout
        self.aux_setup = aux_setup
        self.llm = build_llm(target_path, worker_extension_cls=EXTENSION, work="batch", **kwargs)
        self.capture_info = None
        self.last_stats = None  # CPU seconds of the capture and the writer thread in the last run

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
    def _produce(self, plan: ShardPlan, progress: Progress):
        """Submits a shard's samples and steps the engine until they are done. The rows are written
        by the worker (between execute_model() and sample_tokens()), so nothing is yielded but
        ``None`` per step: the shard loop polls the worker's writer in between."""
        engine = self.llm.llm_engine
        for j, ids in enumerate(plan.input_ids):
            if len(ids):
                engine.add_request(f"{plan.split}-{plan.first + j}", {"prompt_token_ids": [int(x) for x in ids]},
                                   sampling_params((plan.split, plan.k, j)))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    progress.update(len(out.prompt_token_ids))
            yield None

    def run(self, plans: list[ShardPlan], store_dir: Path, progress: Progress) -> list[dict]:
        sink = _WorkerWriter(self)
        self.start_capture(store_dir)
        done = write_shards(sink, plans, lambda plan: self._produce(plan, progress))
        self.last_stats = sink.stats
        return done

    def aux_off(self) -> None:
        """Plain serving again (benchmark baseline on the same engine; runtime setup only)."""
        self._rpc("eagle3_aux_off")

    def close(self) -> None:
        from ..vllm_engine import shutdown_llm

        shutdown_llm(self.llm)
        self.llm = None


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

    def begin(self, plan: ShardPlan) -> None:
        from .vllm_worker import plan_to_payload

        self.ex._rpc("eagle3_begin_shard", plan_to_payload(plan))

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
