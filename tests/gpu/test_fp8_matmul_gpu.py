"""train.fp8_matmul on a GPU with float8 tensor cores: the op against its arithmetic written out
(float64 from the same quantized operands), and the compiled TTT model against its bf16 self."""
from __future__ import annotations

import pytest
import torch

from eagle3.kernels.fp8_matmul import Fp8Weight, quantize_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs a GPU with rowwise-scaled float8 matmuls (compute capability 9.0+)")


def _q(t):
    q, s = quantize_rows(t)
    return q.double() * s.double()


@pytest.mark.parametrize("recipe", ["on", "bf16_wgrad"])
@pytest.mark.parametrize("tokens", [2048, 1000])
def test_op_is_its_quantized_arithmetic_on_cuda(recipe, tokens):
    """The forward and both gradients: within bf16 rounding of the float64 product of the same
    quantized operands (torch._scaled_mm's float32 accumulation, bf16 out)."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 512, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (0.05 * torch.randn(768, 512, device="cuda", generator=gen)).bfloat16().requires_grad_()
    dy = torch.randn(tokens, 768, device="cuda", generator=gen).bfloat16()
    y = Fp8Weight(w, recipe)(x)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xd, wd = x.detach(), w.detach()
    want = {"y": _q(xd) @ _q(wd).T, "dx": _q(dy) @ _q(wd.T).T,
            "dw": _q(dy.T) @ _q(xd.T).T if recipe == "on" else dy.double().T @ xd.double()}
    for name, got in (("y", y), ("dx", dx), ("dw", dw)):
        assert got.dtype == torch.bfloat16 and got.shape == want[name].shape
        err = (got.double() - want[name]).abs().max() / want[name].abs().max()
        assert err <= 8e-3, (name, float(err))


def test_compiled_ttt_model_in_fp8_is_near_bf16():
    """The compiled TTT model (bf16) with the layer and fc in float8 against the same in bf16: the
    loss within 1e-3, the positions scored the same, every matrix's gradient at cosine > 0.98."""
    from test_head_loss_gpu import tiny_draft_and_batch

    from eagle3.train.ttt import TTTModel

    draft, batch = tiny_draft_and_batch()
    out = {}
    for mode in ("off", "on", "bf16_wgrad"):
        model = TTTModel(draft, num_steps=3, compile=True, fp8_matmul=mode)
        loss, stats = model(**batch)
        out[mode] = (loss.detach(), stats, torch.autograd.grad(loss, list(draft.parameters())))
    l0, s0, g0 = out["off"]
    for mode in ("on", "bf16_wgrad"):
        loss, stats, grads = out[mode]
        assert (loss - l0).abs() <= 1e-3 * l0.abs(), mode
        assert torch.equal(stats[:, 1:3], s0[:, 1:3])
        for (name, p), g, r in zip(draft.named_parameters(), grads, g0):
            if p.dim() == 2 and r.abs().sum() > 0:
                cos = torch.nn.functional.cosine_similarity(g.flatten().double(), r.flatten().double(), 0)
                assert cos > 0.98, (mode, name, float(cos))
