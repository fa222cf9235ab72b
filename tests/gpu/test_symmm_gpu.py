"""The Triton symmetric product (eagle3/kernels/symmm.py) and FastMuon with it (train.muon_sym=triton),
on a CUDA device: against float64 products, cuBLAS, the row panels and a float64 Muon. Skipped
without a CUDA device (CI has none) or without Triton."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from eagle3.kernels.symmm import CONFIGS  # noqa: E402

pytestmark = pytest.mark.gpu


def _rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["gram", "square"])
def test_sym_mm_is_the_whole_product_on_every_element(dtype, kind):
    """alpha A B + beta C + diag I, every element written (the output starts as NaN), exactly
    symmetric, within the inputs' rounding of a float64 product and as close as cuBLAS's."""
    from eagle3.kernels import symmm

    gen = torch.Generator(device="cuda").manual_seed(0)
    for nb, m, k in ((1, 2048, 512), (3, 2048, 1024), (2, 4096, 4096), (1, 2048, 8192)):
        X = (torch.randn(nb, m, k, generator=gen, device="cuda") / k ** 0.5).to(dtype)
        if kind == "gram":
            A, B, C, beta = X, X.mT, None, 0.0
        else:
            R = torch.bmm(X.float(), X.float().mT).to(dtype)
            A, B, C, beta = R, R, R, -0.75
        alpha, diag = 1.5, 0.625
        out = torch.full((nb, m, m), float("nan"), dtype=dtype, device="cuda")
        symmm.sym_mm(A, B, C, alpha=alpha, beta=beta, diag=diag, out=out)
        torch.cuda.synchronize()
        eye = torch.eye(m, dtype=torch.float64, device="cuda")
        ref = alpha * torch.bmm(A.double(), B.double()) + diag * eye + (beta * C.double() if C is not None else 0)
        blas = torch.baddbmm(C if C is not None else torch.zeros_like(out), A, B, beta=beta, alpha=alpha) + diag * eye.to(dtype)
        assert not out.isnan().any(), (nb, m, k)
        assert torch.equal(out, out.mT), "the mirrored tiles must equal the computed ones exactly"
        tol = 2e-3 if dtype == torch.float16 else 1.5e-2
        err, err_blas = _rel(out, ref), _rel(blas, ref)
        print(dtype, kind, (nb, m, k), f"sym_mm {err:.2e} cuBLAS {err_blas:.2e}")
        assert err < tol and err < 1.5 * err_blas + 1e-6, (nb, m, k, err, err_blas)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_kernel_configuration_computes_the_same_product(config):
    from eagle3.kernels import symmm

    gen = torch.Generator(device="cuda").manual_seed(1)
    X = (torch.randn(2, 2048, 1024, generator=gen, device="cuda") / 32).half()
    ref = torch.bmm(X.double(), X.double().mT)
    out = torch.full((2, 2048, 2048), float("nan"), dtype=torch.float16, device="cuda")
    symmm.sym_mm(X, X.mT, config=config, out=out)
    assert not out.isnan().any() and torch.equal(out, out.mT) and _rel(out, ref) < 2e-3, config


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_configuration_computes_bit_identical_results(dtype):
    """CONFIGS differ in loads, warps, stages and warp specialisation only, so they agree bit for bit,
    on a Gram product and on an m x m product with C and the diagonal term."""
    from eagle3.kernels import symmm

    gen = torch.Generator(device="cuda").manual_seed(4)
    X = (torch.randn(2, 2048, 4096, generator=gen, device="cuda") / 64).to(dtype)
    R = torch.bmm(X.float(), X.float().mT).to(dtype)
    for A, B, C in ((X, X.mT, None), (R, R, R)):
        outs = {n: symmm.sym_mm(A, B, C, alpha=0.75, beta=-1.25 if C is not None else 0.0, diag=0.5, config=n)
                for n in symmm.CONFIGS}
        first = next(iter(outs.values()))
        for n, o in outs.items():
            assert torch.equal(o, first), (n, (o.float() - first.float()).abs().max().item())
        assert torch.equal(symmm.sym_mm(A, B, C, alpha=0.75, beta=-1.25 if C is not None else 0.0, diag=0.5), first)


def test_inputs_the_kernel_cannot_take_are_refused():
    from eagle3.kernels import symmm

    X = torch.randn(1, 1024, 512, device="cuda").half()
    assert not symmm.supported(X, X.mT)  # too few tiles (MIN_ROWS)
    Y = torch.randn(1, 2048, 512, device="cuda").half()
    assert symmm.supported(Y, Y.mT) and not symmm.supported(Y.float(), Y.float().mT)
    assert not symmm.supported(Y[:, :, :448], Y[:, :, :448].mT)  # not contiguous
    with pytest.raises(ValueError, match="unsupported inputs"):
        symmm.sym_mm(X, X.mT)


@torch.no_grad()
def test_gram_newton_schulz_with_the_triton_triangle_matches_the_panels():
    """The Gram form and the standard form, tile triangle against row panels: the same iterate
    within float16/bf16 rounding, as close to a float64 iteration as the panels are."""
    from eagle3.kernels.muon import gram_newton_schulz, newton_schulz, normalised

    coeffs = (3.4445, -4.7750, 2.0315)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for m, n in ((1024, 4096), (4096, 4096)):
        G = torch.randn(m, m, generator=gen, device="cuda") * torch.arange(1, m + 1, device="cuda") ** -1.0
        G = G @ torch.randn(m, n, generator=gen, device="cuda") / n ** 0.5
        X = normalised(G.bfloat16()[None], 1e-7)
        ref = X.double()[0]
        for _ in range(5):
            A = ref @ ref.T
            ref = coeffs[0] * ref + (coeffs[1] * A + coeffs[2] * A @ A) @ ref
        for fn in (gram_newton_schulz, newton_schulz):
            tri, pan = fn(X, coeffs, 5, sym="triton")[0], fn(X, coeffs, 5, panels=2)[0]
            e_tri, e_pan = _rel(tri, ref), _rel(pan, ref)
            print(fn.__name__, (m, n), f"float64 distance: triton {e_tri:.3e} panels {e_pan:.3e}")
            assert e_tri < 1.1 * e_pan + 1e-3, (fn.__name__, m, n, e_tri, e_pan)


@torch.no_grad()
def test_fast_muon_with_the_triton_triangle_takes_the_panels_steps():
    """20 FastMuon steps at the 8B draft's q, o and k/v sizes with train.muon_sym=triton and =panels
    from the same parameters and gradients: within a few bf16 ulps of each other, each as close to a
    float64 Muon as torch's own bf16 Muon."""
    from conftest import muon64_step

    from eagle3.kernels.muon import FastMuon

    shapes = [(4096, 8192), (4096, 4096), (1024, 8192), (1024, 8192)]
    kw = dict(lr=2e-2, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")

    def params():
        g = torch.Generator(device="cuda").manual_seed(0)
        return [torch.nn.Parameter(0.02 * torch.randn(s, generator=g, device="cuda")) for s in shapes]

    tri, pan, ref = params(), params(), params()
    exact = [torch.nn.Parameter(p.detach().double()) for p in params()]
    bufs = [torch.zeros_like(p) for p in exact]
    opts = FastMuon(tri, sym="triton", **kw), FastMuon(pan, sym="panels", **kw), torch.optim.Muon(ref, **kw)
    start = [p.detach().clone() for p in tri]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(20):
        for a, b, c, e in zip(tri, pan, ref, exact):
            g = torch.randn(a.shape, generator=gen, device="cuda") * \
                torch.rand(1, a.shape[1], generator=gen, device="cuda") ** 4 + a
            a.grad, b.grad, c.grad, e.grad = g.clone(), g.clone(), g.clone(), g.double()
        for o in opts:
            o.step()
        muon64_step(exact, bufs, 2e-2, 0.1, 0.95, True, "match_rms_adamw")
    for a, b, c, e, s in zip(tri, pan, ref, exact, start):
        moved = (b - s).abs().max().item()
        diff = (a - b).abs().max().item()
        e_tri, e_pan, e_torch = ((x.double() - e).norm().item() for x in (a, b, c))
        print(tuple(a.shape), f"moved {moved:.3e} triton-panels {diff:.3e}  float64 distance: triton {e_tri:.3e} "
              f"panels {e_pan:.3e} torch {e_torch:.3e}")
        assert moved > 1e-3 and diff <= 2 ** -5 * moved, (a.shape, diff, moved)
        assert e_tri < 1.1 * e_torch, (a.shape, e_tri, e_torch)
