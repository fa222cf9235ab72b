"""FastMuon on a CUDA device: its compiled passes (the default there), float16 Gram form and the
clip folded in, against its eager passes, torch.optim.Muon and a float64 iteration, at the 8B draft's
matrix sizes. Skipped without a CUDA device (CI has none); needs torch only."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu

# q (Gram form, 2 panels) and its transpose, o (the standard form), k and v (one batch of two)
SHAPES = [(4096, 8192), (8192, 4096), (4096, 4096), (1024, 8192), (1024, 8192)]


def _params(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.Parameter(0.02 * torch.randn(s, generator=gen, device="cuda")) for s in SHAPES]


@torch.no_grad()
def test_compiled_fast_muon_on_cuda_takes_torchs_steps_closer_to_float64():
    """20 steps from the same parameters and gradients, a learning rate and a clip coefficient that
    change every step: FastMuon compiled (the CUDA default) equals its eager passes within a few bf16
    ulps without recompiling, and is as close to the float64 Muon as torch's own bf16 Muon is."""
    import torch._dynamo.config as dynamo_config
    from conftest import muon64_step

    from eagle3.kernels.muon import FastMuon

    kw = dict(lr=2e-2, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    comp, eager, ref = _params(0), _params(0), _params(0)
    exact = [torch.nn.Parameter(p.detach().double()) for p in _params(0)]
    bufs = [torch.zeros_like(p) for p in exact]
    o_comp, o_eager = FastMuon(comp, **kw), FastMuon(eager, compile=False, **kw)
    o_ref = torch.optim.Muon(ref, **kw)
    assert o_comp.gram_dtype is None  # the default: float16 on CUDA
    gen = torch.Generator(device="cuda").manual_seed(1)
    start = [p.detach().clone() for p in comp]
    try:
        for i in range(20):
            if i == 2:  # each shape group compiled by now: a new lr or clip must not recompile
                dynamo_config.error_on_recompile = True
            lr, scale = 2e-2 / (1 + 0.1 * i), torch.tensor(1.0 + 0.5 * i, device="cuda")
            for a, b, c, e in zip(comp, eager, ref, exact):
                g = torch.randn(a.shape, generator=gen, device="cuda") * \
                    torch.rand(1, a.shape[1], generator=gen, device="cuda") ** 4 + a
                a.grad, b.grad, c.grad, e.grad = g.clone(), g.clone(), g / scale, g.double() / scale.double()
            for o in (o_comp, o_eager, o_ref):
                o.param_groups[0]["lr"] = lr
            o_comp.grad_scale, o_eager.grad_scale = scale, scale
            for o in (o_comp, o_eager, o_ref):
                o.step()
            muon64_step(exact, bufs, lr, 0.1, 0.95, True, "match_rms_adamw")
    finally:
        dynamo_config.error_on_recompile = False
    for a, b, c, e, s in zip(comp, eager, ref, exact, start):
        moved = (b - s).abs().max().item()
        diff = (a - b).abs().max().item()
        e_comp, e_eager, e_torch = ((x.double() - e).norm().item() for x in (a, b, c))
        print(tuple(a.shape), f"moved {moved:.3e} compiled-eager {diff:.3e}  float64 distance: "
              f"compiled {e_comp:.3e} eager {e_eager:.3e} torch {e_torch:.3e}")
        assert moved > 1e-3 and diff <= 2 ** -5 * moved, (a.shape, diff, moved)
        assert e_comp < 1.1 * e_torch and e_eager < 1.1 * e_torch, (a.shape, e_comp, e_eager, e_torch)


def test_clip_folded_into_muon_with_adamw_on_cuda_is_clip_grad_norm():
    """train.optimizer=muon on CUDA (FastMuon compiled, fused AdamW): fold_clip's steps equal
    clip_grad_norm_ then step, with gradients above and below the clipping norm."""
    from eagle3.config import TrainConfig  # imports without hydra (absent on the GPU image)
    from eagle3.train.optim import MuonWithAdamW, can_fold, fold_clip

    def run(fold):
        gen = torch.Generator(device="cuda").manual_seed(3)
        mats = [torch.nn.Parameter(0.02 * torch.randn(s, generator=gen, device="cuda")) for s in SHAPES[:3]]
        norm = torch.nn.Parameter(torch.ones(4096, device="cuda"))
        opt = MuonWithAdamW([(f"m{i}", p) for i, p in enumerate(mats)], [("norm", norm)],
                            TrainConfig(optimizer="muon"), fused=True)
        assert can_fold(opt)
        ps, norms = mats + [norm], []
        for i in range(6):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen, device="cuda") * (0.1 if i % 2 else 1e-5)
            norms.append(float(fold_clip(opt, ps, 1.0) if fold else torch.nn.utils.clip_grad_norm_(ps, 1.0)))
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in ps], norms

    (folded, n1), (plain, n2) = run(True), run(False)
    assert n1 == pytest.approx(n2, rel=1e-5) and max(n1) > 1.0 > min(n1)  # both regimes occur
    for a, b in zip(folded, plain):
        # g * (1 / c) against g / c: one rounding apart before the momentum, within bf16 ulps after
        assert (a - b).abs().max() <= 2 ** -7 * a.abs().max(), (a.shape, (a - b).abs().max().item())
