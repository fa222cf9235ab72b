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


def test_device_copies_raise_a_read_error_at_next_not_ahead():
    """ahead() runs inside a step: an error reading the next batch waits for the next() that would
    return it, after the batches read before it."""
    from eagle3.train.data import DeviceCopies
    from eagle3.train.source import SourceStalled

    def batches():
        for k in range(2):
            yield {"x": torch.full((4,), float(k)).pin_memory()}
        raise SourceStalled("the producer went silent")

    copies = DeviceCopies(batches(), torch.device("cuda"))
    copies.ahead(5)  # reads both batches and meets the error: not raised here
    assert [float(next(copies)["x"][0]) for _ in range(2)] == [0.0, 1.0]
    with pytest.raises(SourceStalled, match="went silent"):
        next(copies)


def test_a_stalled_source_stops_the_gpu_loop_between_steps_with_a_checkpoint(tmp_path):
    """On a GPU the batches are read ahead (Prefetcher) and copied ahead (DeviceCopies.ahead, inside
    a step): a source that gives up reading step 6's sample stops the loop after step 5 with a
    checkpoint of it, and the loop started again resumes from there."""
    import dataclasses

    import eagle3.train.loop as L
    from bench.train import loop_config, loop_inputs
    from eagle3.train.checkpoint import complete_checkpoints
    from eagle3.train.source import HiddenStateSource, SourceStalled

    a = SimpleNamespace(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=4000, draft_vocab=1000,
                        n_aux=3, ttt=3, seq=256, batch=1, loop_steps=8, loop_samples=8, loop_trainable=0.75)
    tcfg = loop_config(a, "false", log_every=1, num_workers=0)
    inputs = loop_inputs(a)
    store, reads = inputs.train_store, []

    class Stalling(HiddenStateSource):  # one sample per row and step: read k is step k's
        lengths = store.lengths
        layer_ids = store.layer_ids

        def __len__(self):
            return len(store)

        def __getitem__(self, i):
            reads.append(i)
            if len(reads) == 6:
                raise SourceStalled("the producer went silent")
            return store[i]

    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(SourceStalled) as e:
        L.train(tcfg, dataclasses.replace(inputs, train_store=Stalling()), out, progress=False)
    assert "Checkpoint of step 5 of 8 saved" in str(e.value), str(e.value)
    assert [p.name for p in complete_checkpoints(out)] == ["step-00000005"]
    assert L.train(tcfg, inputs, out, progress=False).steps == 8
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9)), steps
