"""The train loop's ahead path on a CUDA device (eagle3/train/ahead.py: the next step's batch copied
and its target head computed on a side stream while this step's clip and optimizer step run).
Skipped without a CUDA device (CI has none: tests/test_train.py runs the same order in line on a CPU).
Needs torch, transformers and accelerate, no vLLM."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from test_train import _losses, make_inputs, store_dir, target_dir  # noqa: E402,F401  (fixtures)

from eagle3.config import TrainConfig  # noqa: E402

pytestmark = pytest.mark.gpu


def test_side_stream_targets_train_the_same_model(store_dir, target_dir, tmp_path):  # noqa: F811
    """train.overlap_targets on a GPU (the side stream) against in line: the same losses, evals and
    weights, with gradient accumulation and evals between steps, in float32 (Accelerate fixes a
    process's mixed precision at its first Accelerator: one setting per process). Equal up to the
    reordering of atomic sums some CUDA kernels do (a wrong or stale batch moves the loss by far more)."""
    mixed_precision = "no"
    from safetensors.torch import load_file

    from eagle3.train import loop

    made = []
    real = loop.TargetsAhead

    class Counting(real):
        def prepare(self, host_batches, after):
            assert self.stream is not None, "no side stream on a CUDA device"
            made.append(after is not None)
            return super().prepare(host_batches, after)

    loop.TargetsAhead = Counting
    try:
        kw = dict(ttt_steps=3, max_steps=10, lr=1e-3, warmup_steps=2, batch_size=1, grad_accum=2, max_seq_len=128,
                  log_every=1, eval_every=4, save_every=100, attention="sdpa", compile="false",
                  mixed_precision=mixed_precision)
        for name, overlap in (("inline", False), ("ahead", True)):
            loop.train(TrainConfig(**kw, overlap_targets=overlap), make_inputs(store_dir, target_dir, eval_split="eval"),
                       tmp_path / name, progress=False)
    finally:
        loop.TargetsAhead = real
    assert made == [True] * 9
    a, b = _losses(tmp_path / "inline"), _losses(tmp_path / "ahead")
    assert [r[0] for r in a] == [r[0] for r in b]
    assert [r[1] for r in b] == pytest.approx([r[1] for r in a], rel=1e-5)
    wa, wb = load_file(tmp_path / "inline" / "draft.safetensors"), load_file(tmp_path / "ahead" / "draft.safetensors")
    assert wa.keys() == wb.keys()
    exact = all(torch.equal(wa[k], wb[k]) for k in wa)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6)
    print(f"overlap_targets on {torch.cuda.get_device_name()} ({mixed_precision}): losses "
          f"{'equal' if a == b else 'within 1e-5'}, weights {'equal' if exact else 'within 1e-4'}")
