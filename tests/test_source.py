"""The train loop's hidden-state source (eagle3/train/source.py): a store on disk and an online source
both implement it, the loop uses it without asking what it reads, and TrainInputs refuses anything
else."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.train.source import HiddenStateSource

ROOT = Path(__file__).resolve().parents[1]
H = 8


def _store(tmp_path, n=3, length=5):
    from eagle3.extract.writer import CapturedBatch, ShardWriter
    from eagle3.store import ShardSpec, StoreLayout, finalize_store, open_hidden_states

    layout = StoreLayout(layer_ids=(1, 2), last_layer_id=3, hidden_size=H, dtype="float32")
    ids = [list(range(length)) for _ in range(n)]
    w = ShardWriter(tmp_path, layout)
    w.begin(ShardSpec("train", 0, 1, 0, ids, [[1] * length] * n))
    for j in range(n):
        s = torch.randn(length, 3, H)
        w.write(CapturedBatch([(("train", 0), j, 0, 0, length)], list(s[:, :-1].unbind(1)), s[:, -1]))
    w.end(("train", 0))
    w.close()
    finalize_store(tmp_path, layout, {"train": [length] * n}, n)
    return open_hidden_states(tmp_path, "train", fp8="raw"), layout


def test_a_store_on_disk_is_a_source(tmp_path):
    store, _ = _store(tmp_path)
    assert isinstance(store, HiddenStateSource)
    assert store.on_device is False
    store.expect([[[2, 0]], [[1]]])  # any order: nothing to do
    assert store[2]["input_ids"].tolist() == list(range(5))


class _Source:
    on_device = True

    def __init__(self):
        self.expected = None

    def attach(self, store):
        pass

    def expect(self, store, micro_batches):
        self.expected = micro_batches

    def item(self, store, i):
        return {"sample_index": i}

    def close(self, store, finished):
        pass


def test_an_online_source_is_a_source(tmp_path):
    from eagle3.extract import Samples
    from eagle3.online import OnlineHiddenStates
    from eagle3.store import StoreLayout

    layout = StoreLayout(layer_ids=(1, 2), last_layer_id=3, hidden_size=H, dtype="float32")
    producer = _Source()
    store = OnlineHiddenStates("train", Samples([[1, 2, 3], [4, 5]]), layout, producer)
    assert isinstance(store, HiddenStateSource)
    assert store.on_device is True and list(store.lengths) == [3, 2]
    store.expect([[[1, 0]]])
    assert producer.expected == [[[1, 0]]] and store[1] == {"sample_index": 1}


def test_train_inputs_refuse_what_is_not_a_source(tmp_path):
    from eagle3.train.loop import TrainInputs

    class NoExpect:  # a sequence with lengths, but no expect / on_device
        lengths = np.array([4])

        def __len__(self):
            return 1

        def __getitem__(self, i):
            return {}

    store, _ = _store(tmp_path)
    kw = dict(target={}, rms_norm_eps=1e-6, d2t=torch.zeros(1), t2d=torch.zeros(1), draft_config=None)
    TrainInputs(train_store=store, eval_store=None, **kw)
    with pytest.raises(TypeError, match=r"training split \(NoExpect\) is not an eagle3.train.source.HiddenStateSource"
                                        r": it has no on_device, expect"):
        TrainInputs(train_store=NoExpect(), eval_store=None, **kw)
    with pytest.raises(TypeError, match="held-out split"):
        TrainInputs(train_store=store, eval_store=NoExpect(), **kw)


def test_the_loop_does_not_ask_what_its_source_is():
    """No hasattr / getattr on a store in the loop or its batches: they use the declared interface."""
    for rel in ("eagle3/train/loop.py", "eagle3/train/data.py"):
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr",
                                                                                                   "getattr"):
                assert "store" not in ast.unparse(node.args[0]), f"{rel}:{node.lineno}: {ast.unparse(node)}"
