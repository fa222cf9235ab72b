"""One speculative vLLM engine measured at several numbers of draft tokens, each a real run at that k.

vLLM's dynamic speculative decoding (``speculative_config.num_speculative_tokens_per_batch_size``,
vLLM >= 0.25) builds an engine for at most ``num_speculative_tokens`` draft tokens and lets its
scheduler choose, at every step, how many the proposer drafts next (``SchedulerOutput.
num_spec_tokens_to_schedule``): the EAGLE proposer then runs exactly that many chain steps and the
target verifies exactly that many tokens; at 0 it drafts nothing and the target decodes one token a
step, as without speculation. vLLM picks the count from the batch size; the scheduler here picks it
from the requests instead: each request names its k in ``SamplingParams.extra_args[K_ARG]``, and every
request in the engine at one time must name the same k. So the export's verification runs k = 1..5
of the draft in one engine, and plain decoding with prompt lookup in another, instead of one engine
start per k (eagle3.export.verify; tests/test_export.py compares the figures with one engine per k).

vLLM builds the scheduler in its engine-core process (``scheduler_config.scheduler_cls``, which it
calls with the engine's config): ``make_scheduler`` picks the base class vLLM itself would have
used (async scheduling or not). This module imports vLLM at import time: only vLLM imports it.
"""
from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

# the SamplingParams.extra_args key that carries a request's number of draft tokens
K_ARG = "eagle3_num_speculative_tokens"
SCHEDULER = f"{__name__}.make_scheduler"


def request_k(request):
    extra = getattr(request.sampling_params, "extra_args", None) or {}
    return extra.get(K_ARG)


class _RequestedLength:
    """The number of draft tokens of the requests in the engine, for every batch size."""

    def _init_requested_length(self) -> None:
        if self.dynamic_sd_lookup is None:
            raise ValueError(f"{SCHEDULER} needs speculative_config.num_speculative_tokens_per_batch_size (vLLM's "
                             "dynamic speculative decoding), which sets the engine's scheduling up for a draft "
                             "length that changes")
        self._lookup_len = len(self.dynamic_sd_lookup)
        self._requested_k = None

    def add_request(self, request) -> None:
        k = request_k(request)
        if k is not None:
            k = int(k)
            if not 0 <= k <= self.num_spec_tokens:
                raise ValueError(f"request {request.request_id}: {K_ARG}={k}, the engine drafts at most "
                                 f"{self.num_spec_tokens} tokens (speculative_config.num_speculative_tokens)")
            others = {int(request_k(r)) for r in self.requests.values()
                      if not r.is_finished() and request_k(r) is not None}
            if others - {k}:
                raise ValueError(f"request {request.request_id} asks for {k} draft tokens while the engine runs "
                                 f"requests at {sorted(others)}: run one k at a time")
            self._requested_k = k
            self.dynamic_sd_lookup = [k] * self._lookup_len
        super().add_request(request)


class RequestedLengthScheduler(_RequestedLength, Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_requested_length()


class AsyncRequestedLengthScheduler(_RequestedLength, AsyncScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_requested_length()


def make_scheduler(*args, **kwargs):
    """``scheduler_config.scheduler_cls``: vLLM calls it as it would call its scheduler class."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    cls = AsyncRequestedLengthScheduler if vllm_config.scheduler_config.async_scheduling else RequestedLengthScheduler
    return cls(*args, **kwargs)
