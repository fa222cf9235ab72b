"""The train loop on a GPU: its batches copied on a side stream (eagle3.train.data.DeviceCopies) and
its logged windows written without waiting for the GPU train the model that copying in the compute
stream and waiting at every log do (bench/train.py's in-memory store: no hydra, no datasets)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class InlineCopies:
    """What the loop did before DeviceCopies: batches as they come (copied in _optimizer_step)."""

    def __init__(self, batches, device):
        self._it = iter(batches)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def ahead(self, n):
        pass


def _train(tmp_path, name, monkeypatch, inline=False, sync_logs=False, grad_accum=1):
    import eagle3.train.loop as L
    from bench.train import loop_config, loop_inputs

    a = SimpleNamespace(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=4000, draft_vocab=1000,
                        n_aux=3, ttt=3, seq=256, batch=1, loop_steps=12, loop_samples=6, loop_trainable=0.75)
    with monkeypatch.context() as m:
        m.setattr(L, "SYNC_LOGS", sync_logs)
        if inline:
            m.setattr(L, "DeviceCopies", InlineCopies)
        tcfg = loop_config(a, "false", log_every=2, num_workers=0, grad_accum=grad_accum,
                           max_steps=12 // grad_accum)
        out = tmp_path / name
        out.mkdir()
        result = L.train(tcfg, loop_inputs(a), out, progress=False)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return result, recs


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_side_stream_copies_and_deferred_logs_train_the_same_model(tmp_path, monkeypatch, grad_accum):
    ref, ref_recs = _train(tmp_path, "inline", monkeypatch, inline=True, sync_logs=True, grad_accum=grad_accum)
    got, recs = _train(tmp_path, "default", monkeypatch, grad_accum=grad_accum)
    assert [r["step"] for r in recs] == [r["step"] for r in ref_recs] and len(recs) == 6 // grad_accum
    for r, q in zip(recs, ref_recs):
        assert r["train/loss"] == pytest.approx(q["train/loss"], rel=1e-4)
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=1e-3)
        assert r["tokens"] == q["tokens"] and r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0
    assert got.train.loss == pytest.approx(recs[-1]["train/loss"])
    assert got.train.loss == pytest.approx(ref.train.loss, rel=1e-4)
