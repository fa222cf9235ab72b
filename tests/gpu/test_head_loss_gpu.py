"""The fused draft head + loss (eagle3/kernels/head_loss.py) on a GPU: its Triton kernel against the op's torch implementation, and the TTT model's fused path against its unfused one."""
from __future__ import annotations

import pytest
import torch

import eagle3.kernels.head_loss as hl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or hl._kernel() is None,
                                reason="needs CUDA and Triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V", [32000, 50021, 1000])
def test_kernel_equals_torch_implementation(dtype, V):
    """CE, argmax (the first of equal maxima, as torch's), the logits' gradient and the op's outputs
    against the same op's torch implementation run on the CPU, on the same logits: one chunk, several,
    and a last chunk cut short."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    N, H, R = 301, 64, 40
    x = torch.randn(N, H, device="cuda", generator=gen).to(dtype)
    w = torch.randn(V, H, device="cuda", generator=gen).to(dtype)
    target = torch.softmax(torch.randn(R, V, device="cuda", generator=gen) * 3, -1).to(dtype)
    rows = torch.randint(0, R, (N,), device="cuda", generator=gen)
    weights = torch.rand(N, device="cuda", generator=gen)
    weights[::7] = 0
    logits = torch.mm(x, w.t())
    gpu = logits.clone()
    ce, arg = hl._soft_ce_triton(gpu, target, rows, weights)
    cpu = logits.cpu()
    ref_ce, ref_arg = hl._soft_ce_torch(cpu, target.cpu(), rows.cpu(), weights.cpu())
    assert torch.equal(arg.cpu(), ref_arg) and torch.equal(arg, logits.argmax(-1))
    assert (ce.cpu() - ref_ce).abs().max() <= 1e-4 * ref_ce.abs().max()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # the gradient rounded to dtype
    assert (gpu.cpu().float() - cpu.float()).abs().max() <= tol * cpu.float().abs().max()
    assert gpu[::7].abs().max() == 0  # weight 0: no gradient


def tiny_draft_and_batch():
    """A small draft on CUDA and a bf16 batch of two rows (two documents, then padding)."""
    from eagle3.model.draft import Eagle3Draft, Eagle3DraftConfig

    torch.manual_seed(0)
    cfg = Eagle3DraftConfig(hidden_size=256, target_hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, intermediate_size=512, rms_norm_eps=1e-5, vocab_size=4000,
                            draft_vocab_size=1000, aux_layer_ids=[1, 2, 3], rope_theta=10000.0)
    draft = Eagle3Draft(cfg).cuda()
    B, T = 2, 256
    doc = torch.tensor([[0] * 100 + [1] * 156, [0] * 200 + [-1] * 56], device="cuda")
    pos = torch.cat([torch.arange(100), torch.arange(156), torch.arange(200), torch.arange(56)]).view(B, T).cuda()
    batch = dict(aux=torch.randn(B, T, 768, device="cuda").bfloat16(),
                 embeds=torch.randn(B, T, 256, device="cuda").bfloat16(),
                 target_probs=torch.softmax(torch.randn(B, T, 1000, device="cuda") * 2, -1).bfloat16(),
                 in_vocab=torch.rand(B, T, device="cuda") < 0.9, loss_mask=(doc >= 0).long(),
                 position_ids=pos, doc_ids=doc)
    return draft, batch


def test_ttt_fused_equals_unfused_on_cuda():
    """The compiled TTT model in bf16, fused against unfused: loss, statistics, gradients."""
    from eagle3.train.ttt import TTTModel

    draft, batch = tiny_draft_and_batch()
    out = {}
    for mode in ("unfused", "fused"):
        model = TTTModel(draft, num_steps=3, compile=True, head_loss=mode)
        loss, stats = model(**batch)
        out[mode] = (loss, stats, torch.autograd.grad(loss, list(draft.parameters())))
    (l0, s0, g0), (l1, s1, g1) = out["unfused"], out["fused"]
    assert (l1 - l0).abs() <= 1e-3 * l0.abs()
    assert torch.allclose(s1[:, 1:], s0[:, 1:], rtol=0, atol=3)  # counts; argmax ties may differ by a few
    assert torch.allclose(s1[:, 0], s0[:, 0], rtol=2e-3)
    for a, r in zip(g1, g0):
        assert (a - r).abs().max() <= 3e-2 * r.abs().max()
