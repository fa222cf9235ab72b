"""The draft head and its loss as one op (eagle3/kernels/head_loss.py), on CPU: the op's arithmetic
(its torch implementation; the Triton kernel is checked against it in tests/gpu/test_head_loss_gpu.py)
against plain autograd, and the TTT model's fused path against its unfused one, eager and compiled."""
from __future__ import annotations

import pytest
import torch

from eagle3.kernels.head_loss import resolve
from eagle3.model.draft import Eagle3Draft, Eagle3DraftConfig
from eagle3.train.loss import soft_cross_entropy_rows
from eagle3.train.ttt import TTTModel, head_rows


def _reference(x, w, target, rows, weights):
    logits = x @ w.t()
    ce = soft_cross_entropy_rows(logits, target[rows])
    return (ce * weights).sum(), ce, logits.argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_op_equals_autograd_of_the_loss(dtype):
    """Loss, per-row CE, argmax, and the gradients of x and w through an incoming gradient other than
    1, against autograd of the unfused loss computed in float64 from the same (rounded) inputs."""
    torch.manual_seed(0)
    N, H, V, R = 37, 24, 50, 12
    x = torch.randn(N, H, dtype=dtype, requires_grad=True)
    w = torch.randn(V, H, dtype=dtype, requires_grad=True)
    target = torch.softmax(torch.randn(R, V) * 2, -1).to(dtype)
    rows = torch.randint(0, R, (N,))
    weights = torch.rand(N, dtype=torch.promote_types(dtype, torch.float32))
    weights[::5] = 0  # rows without loss
    loss, ce, arg, _ = torch.ops.eagle3.head_soft_ce(x, w, target, rows, weights)
    dx, dw = torch.autograd.grad(loss * 0.37, (x, w))

    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref_loss, ref_ce, ref_arg = _reference(x64, w64, target.double(), rows, weights.double())
    ref_dx, ref_dw = torch.autograd.grad(ref_loss * 0.37, (x64, w64))
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert ce.dtype == torch.promote_types(dtype, torch.float32) and dx.dtype == dtype and dw.dtype == dtype
    assert (loss.double() - ref_loss).abs() <= tol * ref_loss.abs()
    assert (ce.double() - ref_ce).abs().max() <= tol * ref_ce.abs().max()
    for got, ref in ((dx, ref_dx), (dw, ref_dw)):
        assert (got.double() - ref).abs().max() <= tol * ref.abs().max()
    # argmax of the rounded logits: the reference's, where its two best logits are not tied in dtype
    logits = (x.detach() @ w.detach().t()).to(torch.promote_types(dtype, torch.float32))
    assert torch.equal(arg, logits.argmax(-1))
    assert arg.dtype == torch.int64


def test_op_gradient_is_weighted_per_row_and_ce_is_not_differentiable():
    """A row of weight 0 gets no gradient; the CE output carries none (it is for statistics)."""
    torch.manual_seed(1)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    target = torch.softmax(torch.randn(4, 10, dtype=torch.float64), -1)
    weights = torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=torch.float64)
    loss, ce, _, _ = torch.ops.eagle3.head_soft_ce(x, w, target, torch.arange(4), weights)
    assert not ce.requires_grad
    (dx,) = torch.autograd.grad(loss, (x,))
    assert dx[1].abs().max() == 0 and dx[3].abs().max() == 0
    assert dx[0].abs().max() > 0 and dx[2].abs().max() > 0


def test_op_refuses_shapes_that_do_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        torch.ops.eagle3.head_soft_ce(torch.randn(3, 8), torch.randn(10, 7), torch.randn(2, 10),
                                      torch.zeros(3, dtype=torch.long), torch.ones(3))


def test_resolve():
    cpu = torch.device("cpu")
    assert resolve("auto", cpu) == "unfused"
    assert resolve("fused", cpu) == "fused" and resolve("unfused", cpu) == "unfused"
    with pytest.raises(ValueError, match="not one of"):
        resolve("triton", cpu)


def _draft():
    cfg = Eagle3DraftConfig(hidden_size=64, target_hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=128, rms_norm_eps=1e-5, vocab_size=256, draft_vocab_size=64,
                            aux_layer_ids=[1, 2, 3], rope_theta=10000.0)
    return Eagle3Draft(cfg)


def _batch(B=2, T=40, prompt=0):
    doc = torch.tensor([[0] * 15 + [1] * (T - 15), [0] * (T - 6) + [-1] * 6])
    pos = torch.cat([torch.arange(n) for row in doc.tolist()
                     for n in torch.unique_consecutive(torch.tensor(row), return_counts=True)[1].tolist()])
    loss_mask = (doc >= 0).long()
    loss_mask[:, :prompt] = 0
    return dict(aux=torch.randn(B, T, 3 * 64), embeds=torch.randn(B, T, 64),
                target_probs=torch.softmax(torch.randn(B, T, 64), -1), in_vocab=torch.rand(B, T) < 0.8,
                loss_mask=loss_mask, position_ids=pos.view(B, T), doc_ids=doc)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("rows_only", [False, True])
def test_ttt_fused_head_loss_equals_unfused(compiled, rows_only):
    """The TTT model with train.head_loss=fused: the unfused path's loss, statistics and every
    parameter's gradient (float32), on every position and on the loss rows only (head_rows, with
    a prompt before the loss positions), eager and inside the compiled graph."""
    torch.manual_seed(0)
    draft = _draft()
    batch = _batch(prompt=8)
    rows = head_rows(batch["loss_mask"], batch["doc_ids"], 3) if rows_only else None
    if rows_only:
        assert rows is not None and rows.numel() < 3 * 2 * 40
    out = {}
    for mode in ("unfused", "fused"):
        model = TTTModel(draft, num_steps=3, attention="sdpa", compile=compiled and mode == "fused",
                         head_loss=mode)
        loss, stats = model(**batch, head_rows=rows)
        out[mode] = (loss, stats, torch.autograd.grad(loss, list(draft.parameters())))
    (l0, s0, g0), (l1, s1, g1) = out["unfused"], out["fused"]
    assert (l1 - l0).abs() <= 1e-5 * l0.abs()
    assert torch.allclose(s1, s0, rtol=1e-5, atol=1e-5)
    for a, r in zip(g1, g0):
        assert (a - r).abs().max() <= 1e-4 * r.abs().max()
