"""Runs inside vLLM's workers (``worker_extension_cls``): reads the aux hidden states between
``execute_model()`` and ``sample_tokens()`` and hands them to a shard writer on rank 0.

How the capture works (V1 model runner, vLLM >= 0.11.1):
- The target model's own EAGLE-3 support (``SupportsEagle3``) is switched on for the layer ids
  ``aux ids + [L]``: the model then returns ``(hidden_states, [aux...])`` and the runner keeps the
  list in ``execute_model_state.aux_hidden_states`` until ``sample_tokens()`` consumes it. Id L
  (after the last decoder layer, before the final norm) is captured by the same mechanism: Llama,
  Qwen2/3 and Qwen3-MoE add ``hidden + residual`` after every layer idx as id idx + 1, DeepSeek-V2/V3
  checks ``end_layer`` explicitly; so no family-specific code is needed here.
- ``model_runner.execute_model`` is wrapped on the instance (a worker extension cannot override the
  worker's own methods). After the real call returns None, the state holds this step's aux states;
  the wrapper maps rows to requests (``input_batch.req_ids`` order, ``num_scheduled_tokens`` each,
  chunk start = tokens computed before this step) and queues them. ``sample_tokens()`` then runs as
  usual: the two-phase protocol is untouched, the wrapper only reads between the phases.
- Nothing runs inside the model's forward, so CUDA graphs and torch.compile stay valid, provided
  the aux outputs were switched on before graphs were captured / the model was compiled. Two ways:
  ``runtime`` (CPU, or any eager engine): switched on here, after the engine started;
  ``load_time`` (GPU default): vLLM's ``extract_hidden_states`` speculative method switches them on
  while loading the model, before compilation; its proposer also copies the states into its own
  KV-cache slots each step (small cost next to the forward on a GPU), which we do not read.
- Requests carry ``SamplingParams.extra_args["eagle3"] = [split, shard, j]``; internal request ids
  are not used (vLLM appends a random suffix to them).
- Tensor parallel: every rank holds the full (all-reduced) hidden states; only TP rank 0 writes.
"""
from __future__ import annotations

import json
import time
import traceback

from ..store import ShardSpec, StoreLayout
from .writer import CapturedBatch, HostStager, ShardWriter

TAG = "eagle3"


def spec_from_payload(p: dict) -> ShardSpec:
    import numpy as np

    lengths = np.frombuffer(p["lengths"], dtype=np.int64)
    ids = np.frombuffer(p["input_ids"], dtype=np.int32)
    mask = np.frombuffer(p["loss_mask"], dtype=np.uint8)
    cuts = np.cumsum(lengths)[:-1]
    return ShardSpec(split=p["split"], k=p["k"], num=p["num"], first=p["first"],
                     input_ids=np.split(ids, cuts) if len(lengths) else [],
                     loss_mask=np.split(mask, cuts) if len(lengths) else [])


def spec_to_payload(spec: ShardSpec) -> dict:
    """A ShardSpec as msgspec-friendly data (vLLM's RPC carries bytes, not arrays)."""
    import numpy as np

    ids = [np.asarray(x, dtype=np.int32) for x in spec.input_ids]
    mask = [np.asarray(x, dtype=np.uint8) for x in spec.loss_mask]
    return {"split": spec.split, "k": spec.k, "num": spec.num, "first": spec.first,
            "lengths": spec.lengths.astype(np.int64).tobytes(),
            "input_ids": (np.concatenate(ids) if ids else np.zeros(0, np.int32)).tobytes(),
            "loss_mask": (np.concatenate(mask) if mask else np.zeros(0, np.uint8)).tobytes()}


class HiddenStateCapture:
    """Worker extension; every method is called through ``LLM.collective_rpc`` on all ranks.
    Method names carry an ``eagle3_`` prefix (vLLM refuses names the worker already has)."""

    def eagle3_capture_start(self, cfg_json: str) -> str:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.interfaces import supports_eagle3

        cfg = json.loads(cfg_json)
        runner = self.model_runner
        if not hasattr(runner, "execute_model_state") or not hasattr(runner, "input_batch"):
            raise RuntimeError(f"eagle3 capture needs vLLM's V1 model runner (execute_model_state, input_batch); "
                               f"this worker runs {type(runner).__name__}. Set VLLM_USE_V2_MODEL_RUNNER=0.")
        model = runner.get_model()
        ids = tuple(cfg["capture_ids"])
        if cfg["aux_setup"] == "runtime":
            if not supports_eagle3(model):
                raise RuntimeError(f"{type(model).__name__} has no EAGLE-3 aux hidden-state support in this vLLM "
                                   f"(SupportsEagle3); use extract.backend=hf for this target")
            if not runner.model_config.enforce_eager:
                raise RuntimeError("aux_setup=runtime needs enforce_eager=True (compiled graphs were built "
                                   "without aux outputs); use aux_setup=load_time")
            model.set_aux_hidden_state_layers(ids)
            runner.use_aux_hidden_state_outputs = True
        elif not runner.use_aux_hidden_state_outputs:
            raise RuntimeError("aux_setup=load_time but the runner has no aux outputs: the engine was not started "
                               "with the extract_hidden_states speculative method")
        layout = StoreLayout.from_json(cfg["layout"])
        self._eagle3_async = bool(getattr(runner.scheduler_config, "async_scheduling", False))
        self._eagle3_rank = get_tensor_model_parallel_rank()
        self._eagle3_error = None
        self._eagle3_steps = 0
        self._eagle3_max_reqs = 0  # the most samples one step held
        self._eagle3_chunks = 0  # segments that continue a sample begun in an earlier step (chunked prefill)
        self._eagle3_capture_cpu = 0.0
        self._eagle3_writer = ShardWriter(cfg["store_dir"], layout) if self._eagle3_rank == 0 else None
        # one stager for the engine's life: its pinned buffers (sized for the largest step) are
        # reused by every later capture instead of being pinned again
        step_bytes = int(runner.scheduler_config.max_num_batched_tokens) * (layout.bytes_per_token + 64)
        if getattr(self, "_eagle3_stager", None) is None or self._eagle3_stager.min_bytes < step_bytes:
            self._eagle3_stager = HostStager(min_bytes=step_bytes)
        self._eagle3_n_capture = len(ids)
        if not hasattr(self, "_eagle3_orig_execute"):
            self._eagle3_orig_execute = runner.execute_model
            runner.execute_model = self._eagle3_execute_model
        holder = getattr(model, "model", model)
        return json.dumps({"runner": type(runner).__name__, "rank": self._eagle3_rank,
                           "aux_layers": list(getattr(holder, "aux_hidden_state_layers", ()))})

    def _eagle3_execute_model(self, scheduler_output, *args, **kwargs):
        out = self._eagle3_orig_execute(scheduler_output, *args, **kwargs)
        state = self.model_runner.execute_model_state
        if state is not None and self._eagle3_writer is not None and self._eagle3_error is None:
            t0 = time.thread_time()
            try:
                self._eagle3_capture(state, scheduler_output)
                self._eagle3_capture_cpu += time.thread_time() - t0
            except BaseException as e:  # noqa: BLE001 - reported by eagle3_poll; the engine keeps running
                self._eagle3_error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        return out

    def _eagle3_capture(self, state, so) -> None:
        import torch

        runner = self.model_runner
        aux = state.aux_hidden_states
        if aux is None or len(aux) != self._eagle3_n_capture:
            raise RuntimeError(f"expected {self._eagle3_n_capture} aux hidden states from the model, got "
                               f"{None if aux is None else len(aux)}")
        # Chunk starts as the scheduler sent them, to cross-check the runner's view.
        sched_start = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        sched_start.update(zip(cached.req_ids, cached.num_computed_tokens))
        batch = runner.input_batch
        segments, row = [], 0
        for i, rid in enumerate(batch.req_ids[: batch.num_reqs]):
            count = so.num_scheduled_tokens.get(rid, 0)
            params = runner.requests[rid].sampling_params
            tag = (params.extra_args or {}).get(TAG) if params is not None else None
            if tag is not None and count:
                start = int(batch.num_computed_tokens_cpu[i])
                if sched_start.get(rid, start) != start:
                    if not self._eagle3_async:
                        raise RuntimeError(f"request {rid}: runner says chunk starts at {start}, scheduler says "
                                           f"{sched_start[rid]}")
                    # async scheduling: the runner's count may run ahead of the step; the scheduler
                    # sent the chunk start of this very step
                    start = int(sched_start[rid])
                segments.append(((tag[0], tag[1]), tag[2], start, row, row + count))
            row += count
        if row != so.total_num_scheduled_tokens:
            raise RuntimeError(f"rows of this step ({row}) != scheduled tokens ({so.total_num_scheduled_tokens})")
        self._eagle3_steps += 1
        if not segments:
            return
        self._eagle3_max_reqs = max(self._eagle3_max_reqs, len(segments))
        self._eagle3_chunks += sum(1 for seg in segments if seg[2] > 0)
        n = row
        if aux[0].is_cuda:
            # converted (bf16) or quantised (fp8) on the GPU, then copied to the host off the compute stream
            stacked = torch.stack([a[:n] for a in aux[:-1]], dim=1)
            self._eagle3_writer.write(self._eagle3_stager.capture(segments, stacked, aux[-1][:n],
                                                                  self._eagle3_writer.layout))
        else:
            # CPU: this step's tensors are fresh (the adds that produced them are out of place), so
            # the writer thread stacks/converts them itself while the next step computes.
            self._eagle3_writer.write(CapturedBatch(segments, [a[:n] for a in aux[:-1]], aux[-1][:n]))

    def eagle3_engine_info(self) -> str:
        """What this engine runs with (JSON): runner, compile mode, CUDA-graph mode, attention
        backends, and the KV cache: blocks, tokens, bytes per token (the sum over its layers), and
        the layers of each KV group, so a reader sees which layers hold KV (a hidden-state KV layer
        of the extract_hidden_states method among them). Every field is read defensively: the names
        are vLLM's internals (0.25-0.32 checked)."""
        runner = self.model_runner
        info: dict = {"runner": type(runner).__name__}

        def get(name, fn):
            try:
                info[name] = fn()
            except Exception as e:  # noqa: BLE001 - informational
                info[name] = f"unavailable ({type(e).__name__})"

        cc = runner.vllm_config.compilation_config
        get("enforce_eager", lambda: bool(runner.model_config.enforce_eager))
        get("compile_mode", lambda: str(getattr(cc, "mode", getattr(cc, "level", None))))
        get("cudagraph_mode", lambda: str(getattr(cc, "cudagraph_mode", None)))
        get("cudagraph_sizes", lambda: len(getattr(cc, "cudagraph_capture_sizes", None) or []))
        get("attention_backends", lambda: sorted({g.backend.get_name() for groups in runner.attn_groups
                                                  for g in groups}))
        get("async_scheduling", lambda: bool(getattr(runner.scheduler_config, "async_scheduling", False)))
        get("dtype", lambda: str(runner.model_config.dtype).replace("torch.", ""))

        def kv():
            kvc = runner.kv_cache_config
            groups = []
            for g in kvc.kv_cache_groups:
                spec = g.kv_cache_spec
                groups.append({"spec": type(spec).__name__, "layers": len(g.layer_names), "block_size": spec.block_size,
                               "page_bytes": spec.page_size_bytes, "last_layers": list(g.layer_names[-2:])})
            block = kvc.kv_cache_groups[0].kv_cache_spec.block_size if kvc.kv_cache_groups else 0
            tokens, size = kvc.num_blocks * block, sum(t.size for t in kvc.kv_cache_tensors)
            return {"num_blocks": kvc.num_blocks, "tokens": tokens, "bytes": size,
                    "bytes_per_token": round(size / tokens, 1) if tokens else None, "groups": groups}

        get("kv_cache", kv)
        return json.dumps(info)

    def eagle3_begin_shard(self, payload: dict) -> None:
        if getattr(self, "_eagle3_writer", None) is not None:
            self._eagle3_writer.begin(spec_from_payload(payload))

    def eagle3_end_shard(self, split: str, k: int) -> None:
        if getattr(self, "_eagle3_writer", None) is not None:
            self._eagle3_writer.end((split, k))

    def eagle3_poll(self) -> str:
        """Finished shard records (JSON); an error message if capture or writing failed."""
        if getattr(self, "_eagle3_writer", None) is None:
            return json.dumps({"done": [], "error": None, "steps": 0})
        if self._eagle3_error is not None:
            return json.dumps({"done": [], "error": self._eagle3_error})
        try:
            done = self._eagle3_writer.poll()
        except Exception as e:  # StoreWriteError and friends: message for the driver
            return json.dumps({"done": [], "error": str(e), "kind": type(e).__name__})
        return json.dumps({"done": done, "error": None, "steps": self._eagle3_steps})

    def eagle3_capture_stop(self) -> str:
        """Wait for the writer to finish every queued shard; the capture stays installed but idle."""
        writer = getattr(self, "_eagle3_writer", None)
        if writer is None:
            return json.dumps({"done": [], "error": None})
        self._eagle3_writer = None
        if self._eagle3_error is not None:
            writer.abort()
            return json.dumps({"done": [], "error": self._eagle3_error})
        try:
            done = writer.close()
            stats = {"capture_cpu_s": self._eagle3_capture_cpu, "writer_cpu_s": writer.cpu_seconds,
                     "pin_s": self._eagle3_stager.alloc_seconds, "stager_wait_s": self._eagle3_stager.wait_seconds,
                     "steps": self._eagle3_steps, "max_samples_per_step": self._eagle3_max_reqs,
                     "continued_chunks": self._eagle3_chunks}
            return json.dumps({"done": done, "error": None, "stats": stats})
        except Exception as e:
            return json.dumps({"done": [], "error": str(e), "kind": type(e).__name__})

    def eagle3_aux_off(self) -> None:
        """Back to plain serving (runtime setup only): the model stops returning aux states. Lets
        the benchmark time plain prefill and extraction alternately on one engine."""
        runner = self.model_runner
        if not runner.model_config.enforce_eager:
            raise RuntimeError("eagle3_aux_off is only valid for an eager engine (runtime aux setup)")
        runner.get_model().set_aux_hidden_state_layers(())
        runner.use_aux_hidden_state_outputs = False

    def eagle3_capture_abort(self) -> None:
        writer = getattr(self, "_eagle3_writer", None)
        self._eagle3_writer = None
        if writer is not None:
            writer.abort()
