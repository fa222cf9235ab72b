"""eagle3.kernels.muon.FastMuon against torch.optim.Muon: the orthogonalisation, many steps, the
state dict, and DDP (2 gloo ranks on CPU) against one process."""
from __future__ import annotations

import copy
import os

import pytest
import torch
from conftest import MUON_COEFFS as COEFFS
from conftest import muon64_step
from torch.optim._muon import _zeropower_via_newtonschulz

from eagle3.config import TrainConfig
from eagle3.cpu import native_bf16
from eagle3.kernels.muon import (
    FastMuon,
    gram_newton_schulz,
    momentum_stack,
    newton_schulz,
    normalised,
    ns_cost,
    ns_flops,
    orthogonalise,
    panel_edges,
    shard_owners,
    sym_baddbmm,
    sym_fraction,
    sym_panels,
    use_gram,
)


def torch_ns(G, coeffs, steps, eps):
    """torch's private per-matrix NS (some versions take use_addmm too: their default, False)."""
    import inspect

    extra = (False,) if "use_addmm" in inspect.signature(_zeropower_via_newtonschulz).parameters else ()
    return _zeropower_via_newtonschulz(G, coeffs, steps, eps, *extra)


def ns_float64(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The iteration in exact-ish arithmetic (float64, from the bf16-rounded input torch starts from)."""
    a, b, c = COEFFS
    X = G.bfloat16().double()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / X.norm()
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def spectra(m: int, n: int, gen: torch.Generator):
    """Gaussian, power-law (1/i, 1/i^2) and low-rank + noise m x n matrices: the conditioning that
    makes a naive half-precision Gram iteration diverge."""
    k = min(m, n)
    yield "gauss", torch.randn(m, n, generator=gen)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen))
    for p in (1.0, 2.0):
        yield f"pow{p:g}", (U * torch.arange(1, k + 1).float() ** -p) @ V.T
    yield "lowrank", 10 * torch.randn(m, 8, generator=gen) @ torch.randn(8, n, generator=gen) \
        + 0.1 * torch.randn(m, n, generator=gen)


def rel(x, y, ref) -> float:
    return ((x.double() - y.double()).norm() / ref.double().norm()).item()


# shapes (rows, cols): the 8B draft's aspect ratios scaled down (q 1:2, fc 1:3, MLP 1:3.5 tall and
# wide, k/v 1:8), square (o), and odd sizes
SHAPES = [(128, 256), (128, 384), (448, 128), (128, 448), (32, 256), (128, 128), (96, 200)]


def test_flop_counts_and_the_choice_of_form():
    # standard: 5 (4 m^2 n + 2 m^3); Gram with the restart at 2: 8 m^2 n + 28 m^3
    for m, n in [(4096, 14336), (4096, 12288), (4096, 8192), (1024, 8192), (4096, 4096)]:
        assert ns_flops(m, n, 5, False) == 5 * (4 * m * m * n + 2 * m ** 3)
        assert ns_flops(m, n, 5, True) == 8 * m * m * n + 28 * m ** 3
        assert ns_flops(n, m, 5, True) == ns_flops(m, n, 5, True)
    assert use_gram(4096, 14336, 5) and use_gram(14336, 4096, 5) and use_gram(4096, 8192, 5)
    assert not use_gram(4096, 4096, 5) and not use_gram(100, 140, 5)
    assert ns_flops(4096, 14336, 5, True) / ns_flops(4096, 14336, 5, False) == pytest.approx(0.70)


def test_symmetric_flop_counts():
    """Panels: the upper block-triangle's share of a whole product, and where it applies (every
    m x m product and X X^T; not Q X or B X)."""
    assert sym_fraction(4096, 1) == 1 and sym_fraction(4096, 2) == 0.75 and sym_fraction(4096, 4) == 0.625
    assert panel_edges(200, 3) == [0, 64, 128, 200] and panel_edges(4096, 4) == [0, 1024, 2048, 3072, 4096]
    assert [sym_panels(m) for m in (576, 1024, 2048, 4096, 7168, 16384)] == [1, 1, 1, 2, 3, 4]
    m, n = 4096, 14336
    for p in (2, 4, 8):
        f = (p + 1) / (2 * p)
        assert ns_flops(m, n, 5, False, panels=p) == round(5 * ((1 + f) * 2 * m * m * n + f * 2 * m ** 3))
        assert ns_flops(m, n, 5, True, panels=p) == round((2 * f + 2) * 2 * m * m * n + f * 14 * 2 * m ** 3)
    assert use_gram(4096, 14336, 5) and not use_gram(4096, 4096, 5)


@pytest.mark.parametrize("panels", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_symmetric_products_equal_the_whole_gemm(panels, dtype):
    """X X^T and products of commuting symmetric matrices (polynomials in one R), with and without
    an added symmetric C, alpha and beta: the panelled upper triangle and its mirror equal the
    whole GEMM, and what lies outside the diagonal blocks is the exact mirror of what lies above them."""
    gen = torch.Generator().manual_seed(panels)
    X = torch.randn(2, 200, 328, generator=gen) / 20
    R = X @ X.mT
    P1 = 0.5 * torch.eye(200) + R - 0.3 * R @ R
    P2 = R @ R + 2 * R
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    cases = [(None, X, X.mT, 0.0, 0.7), (None, P1, P2, 0.0, 1.0), (P2, R, R, -0.4, 2.0)]
    for C, A, B, beta, alpha in cases:
        Cd = None if C is None else C.to(dtype)
        got = sym_baddbmm(Cd, A.to(dtype), B.to(dtype), beta=beta, alpha=alpha, panels=panels).float()
        want = alpha * (A.double() @ B.double()) + (0 if C is None else beta * C.double())
        e = panel_edges(200, panels)
        for r0 in e[1:-1]:
            assert torch.equal(got[:, r0:, :r0], got[:, :r0, r0:].mT)
        assert ((got.double() - want).norm() / want.norm()).item() < tol


@pytest.mark.parametrize("gram", ["always", "never"])
@pytest.mark.parametrize("m,n", [(128, 448), (448, 128), (96, 200), (128, 128)])
def test_panelled_orthogonalisation_is_as_close_to_float64(m, n, gram):
    """Both forms with their symmetric products in panels (3: uneven panels too): as close to the
    float64 iteration as torch's bf16 iteration is, and close to the unpanelled result."""
    gen = torch.Generator().manual_seed(m + n)
    for name, G in spectra(m, n, gen):
        ref, t = ns_float64(G), torch_ns(G, COEFFS, 5, 1e-7)
        e_torch = rel(t, ref, ref)
        (whole,) = orthogonalise([G], COEFFS, 5, 1e-7, gram=gram, panels=1)
        for panels in (2, 3):
            (g,) = orthogonalise([G], COEFFS, 5, 1e-7, gram=gram, panels=panels)
            assert g.shape == G.shape and g.dtype == torch.bfloat16
            assert rel(g, ref, ref) < 1.05 * e_torch + 1e-3, (name, panels, rel(g, ref, ref), e_torch)
            assert rel(g, whole, ref) < 1.05 * e_torch + 1e-3, (name, panels)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the Gram form's on CUDA, on CPU
@pytest.mark.parametrize("m,n", SHAPES)
def test_orthogonalisation_equals_torchs_within_its_own_bf16_error(m, n, dtype):
    """The Gram form's result is as close to torch's as torch's bf16 result is to the float64
    iteration, and at least as close to float64 as torch's; the batched standard form is torch's."""
    gen = torch.Generator().manual_seed(m * 1000 + n)
    for name, G in spectra(m, n, gen):
        ref, t = ns_float64(G), torch_ns(G, COEFFS, 5, 1e-7)
        (g,) = orthogonalise([G], COEFFS, 5, 1e-7, gram="always", dtype=dtype)
        (s,) = orthogonalise([G], COEFFS, 5, 1e-7, gram="never")
        assert g.shape == G.shape and g.dtype == torch.bfloat16
        e_torch = rel(t, ref, ref)
        # the same bf16 iteration: bitwise on a CPU with native bf16; without it (AVX2) torch's bf16 GEMM
        # rounds by the operands' memory layout, and torch's Muon multiplies a tall matrix's transposed view
        # where FastMuon multiplies a contiguous copy: within torch's own bf16 error there
        assert rel(s, t, ref) < (1e-3 if native_bf16() else 1.05 * e_torch + 1e-3), (name, rel(s, t, ref), e_torch)
        assert rel(g, ref, ref) < 1.05 * e_torch + 1e-3, (name, rel(g, ref, ref), e_torch)
        assert rel(g, t, ref) < 1.05 * e_torch + 1e-3, (name, rel(g, t, ref), e_torch)


def test_naive_bf16_gram_drifts_and_the_chosen_form_does_not():
    """Why float16 and the restart: without them the Gram iterate diverges on an ill-conditioned input."""
    gen = torch.Generator().manual_seed(0)
    G = dict(spectra(128, 448, gen))["pow2"]
    ref = ns_float64(G)
    X = normalised(G.bfloat16()[None], 1e-7)
    naive = gram_newton_schulz(X, COEFFS, 5, dtype=torch.bfloat16, restart=99)[0]
    assert rel(naive, ref, ref) > 1.0
    for dtype in (torch.float16, torch.float32):
        assert rel(gram_newton_schulz(X, COEFFS, 5, dtype)[0], ref, ref) < 1.05 * rel(newton_schulz(X, COEFFS, 5)[0], ref, ref)


def test_batching_groups_same_shapes_and_keeps_each_result():
    gen = torch.Generator().manual_seed(1)
    mats = [torch.randn(s, generator=gen) for s in [(64, 224), (224, 64), (64, 224), (64, 64), (224, 64)]]
    for gram in ("always", "never"):
        together = orthogonalise(mats, COEFFS, 5, 1e-7, gram=gram)
        alone = [orthogonalise([g], COEFFS, 5, 1e-7, gram=gram)[0] for g in mats]
        for x, y in zip(together, alone):
            assert x.shape == y.shape and torch.allclose(x.float(), y.float(), atol=2e-3)


def _params(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(0.05 * torch.randn(s, generator=gen)) for s in shapes]


@pytest.mark.parametrize("adjust_lr_fn,nesterov", [("match_rms_adamw", True), ("original", True), (None, False)])
def test_fifty_steps_equal_torch_muon(adjust_lr_fn, nesterov):
    """FastMuon and torch.optim.Muon from the same parameters, fed the same gradients for 50 steps
    (weight decay, momentum, the lr adjustment, a changed lr mid-way): the parameters stay within a
    few bf16 roundings of the update; gram=never equals torch's to float32 rounding (on a CPU with native
    bf16; elsewhere within the same few roundings)."""
    shapes = SHAPES + [(128, 256)]  # two of one shape: a batch
    lr, steps = 2e-2, 50
    kw = dict(lr=lr, weight_decay=0.1, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ref, fast, same = _params(shapes, 0), _params(shapes, 0), _params(shapes, 0)
    exact = [torch.nn.Parameter(p.detach().double()) for p in _params(shapes, 0)]
    bufs = [torch.zeros_like(p) for p in exact]
    # float16: the Gram form's dtype on CUDA (float32, CPU's, is the loop tests')
    o_ref, o_fast = torch.optim.Muon(ref, **kw), FastMuon(fast, gram_dtype=torch.float16, **kw)
    o_same = FastMuon(same, gram="never", **kw)
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        for a, b, c, e in zip(ref, fast, same, exact):
            # a gradient of uneven columns plus a pull towards the parameter (its decay): ill-conditioned
            g = torch.randn(a.shape, generator=gen) * torch.rand(1, a.shape[1], generator=gen) ** 4 + a.detach()
            a.grad, b.grad, c.grad, e.grad = g.clone(), g.clone(), g.clone(), g.double()
        if i == 25:
            for o in (o_ref, o_fast, o_same):
                o.param_groups[0]["lr"] = lr / 2
        for o in (o_ref, o_fast, o_same):
            o.step()
        muon64_step(exact, bufs, lr if i < 25 else lr / 2, 0.1, 0.95, nesterov, adjust_lr_fn)
    for a, b, c, e in zip(ref, fast, same, exact):
        # closer to the float64 Muon than torch's own bf16 Muon is, up to a margin
        e_torch, e_fast = (a.double() - e).norm().item(), (b.double() - e).norm().item()
        print(tuple(a.shape), f"torch-float64 {e_torch:.3e}  fast-float64 {e_fast:.3e}  fast-torch {(a - b).norm().item():.3e}")
        assert e_fast < 1.1 * e_torch, (a.shape, e_fast, e_torch)
        alr = torch.optim._muon._adjust_lr(lr, adjust_lr_fn, a.shape)
        moved = (a.detach() - 0.05 * 0).norm()
        # each step's update has RMS ~ alr / sqrt(max dim) x O(1); the two differ by ~1% of it per step
        # (torch's bf16 rounding), not accumulating coherently: allow 3% of the whole path's size
        path = steps * alr * (min(a.shape) / a.numel()) ** 0.5 * a.numel() ** 0.5
        assert (a - b).norm() < 0.03 * path, (a.shape, (a - b).norm().item(), path, moved.item())
        if native_bf16():
            assert torch.allclose(a, c, atol=1e-6, rtol=0), a.shape
        else:  # torch's bf16 GEMM rounds by memory layout there (test_orthogonalisation_equals_torchs_...)
            assert (a - c).norm() < 0.03 * path, (a.shape, (a - c).norm().item(), path)
    assert o_fast.state_dict()["state"].keys() == o_ref.state_dict()["state"].keys()


def test_state_dict_is_torch_muons_and_round_trips():
    """The same groups and state as torch's Muon: either loads the other's state dict, and a
    FastMuon restored from its own continues exactly as the uninterrupted one."""
    shapes = [(64, 224), (64, 64)]
    a, b = _params(shapes, 0), _params(shapes, 0)
    oa, ob = FastMuon(a, lr=1e-2), torch.optim.Muon(b, lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(8)]

    def step(params, opt, i):
        for p, g in zip(params, grads[i]):
            p.grad = g.clone()
        opt.step()

    for i in range(4):
        step(a, oa, i)
        step(b, ob, i)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert [set(v) for v in sa["state"].values()] == [{"momentum_buffer"}] * 2
    # torch's Muon resumes from FastMuon's checkpoint and vice versa
    c = [p.detach().clone().requires_grad_() for p in a]
    oc = torch.optim.Muon(c, lr=1e-2)
    oc.load_state_dict(copy.deepcopy(sa))
    d = [p.detach().clone().requires_grad_() for p in b]
    od = FastMuon(d, lr=1e-2)
    od.load_state_dict(copy.deepcopy(sb))
    assert all(torch.equal(od.state[p]["momentum_buffer"], ob.state[q]["momentum_buffer"]) for p, q in zip(d, b))
    # a FastMuon restored from its own state dict continues bit for bit
    e = [p.detach().clone().requires_grad_() for p in a]
    oe = FastMuon(e, lr=1e-2)
    oe.load_state_dict(copy.deepcopy(sa))
    for i in range(4, 8):
        step(a, oa, i)
        step(e, oe, i)
        step(c, oc, i)
    assert all(torch.equal(x, y) for x, y in zip(a, e))
    assert all(torch.allclose(x, y, atol=1e-3) for x, y in zip(a, c))


def test_muon_with_adamw_uses_the_configured_implementation():
    from eagle3.model.draft import Eagle3Draft, Eagle3DraftConfig
    from eagle3.train.optim import build_optimizer

    cfg = Eagle3DraftConfig(hidden_size=64, target_hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=32, intermediate_size=128, rms_norm_eps=1e-6, vocab_size=120,
                            draft_vocab_size=60, aux_layer_ids=[1, 2, 3], rope_theta=10000.0)
    model = Eagle3Draft(cfg)
    fast = build_optimizer(model, TrainConfig(optimizer="muon"), torch.device("cpu"))
    assert type(fast.muon) is FastMuon
    plain = build_optimizer(model, TrainConfig(optimizer="muon", muon_impl="torch"), torch.device("cpu"))
    assert type(plain.muon) is torch.optim.Muon
    with pytest.raises(ValueError, match="train.muon_impl"):
        TrainConfig(optimizer="muon", muon_impl="nope")
    # the key is speed only: not in the train hash
    from eagle3.hashing import semantic_dict

    assert "muon_impl" not in semantic_dict(TrainConfig(optimizer="muon", muon_impl="torch"))
    assert semantic_dict(TrainConfig(optimizer="muon", muon_impl="torch")) == semantic_dict(TrainConfig(optimizer="muon"))
    # train.muon_shard reaches FastMuon, and is speed only too
    assert fast.muon.shard is True
    assert build_optimizer(model, TrainConfig(optimizer="muon", muon_shard=False), torch.device("cpu")).muon.shard is False
    assert semantic_dict(TrainConfig(optimizer="muon", muon_shard=False)) == semantic_dict(TrainConfig(optimizer="muon"))
    # train.muon_sym reaches FastMuon, is refused when misspelt, and is speed only
    assert fast.muon.sym == "auto"
    assert build_optimizer(model, TrainConfig(optimizer="muon", muon_sym="panels"), torch.device("cpu")).muon.sym == "panels"
    with pytest.raises(ValueError, match="train.muon_sym"):
        TrainConfig(optimizer="muon", muon_sym="cublas")
    assert semantic_dict(TrainConfig(optimizer="muon", muon_sym="panels")) == semantic_dict(TrainConfig(optimizer="muon"))


# -- the symmetric products: the Triton tile triangle (GPU tests: tests/gpu/test_symmm_gpu.py) --------

def test_tile_pairs_cover_the_upper_triangle_once_in_row_groups():
    from eagle3.kernels.symmm import tile_pairs

    for tiles, group in ((1, 8), (5, 2), (32, 8), (9, 8)):
        pairs = tile_pairs(tiles, group)
        assert sorted(pairs) == [(i, j) for i in range(tiles) for j in range(i, tiles)], (tiles, group)
        # the launch order: every pair of a row group before the next group's
        groups = [i // group for i, _ in pairs]
        assert groups == sorted(groups)


def test_muon_sym_resolves_per_device_and_triton_is_refused_where_it_cannot_run():
    from eagle3.kernels.muon import resolve_sym

    cpu = torch.device("cpu")
    assert resolve_sym("auto", cpu) == "panels" and resolve_sym("panels", cpu) == "panels"
    with pytest.raises(ValueError, match="not on a CUDA device.*train.muon_sym=auto or panels"):
        resolve_sym("triton", cpu)
    with pytest.raises(ValueError, match="sym must be one of"):
        FastMuon([torch.nn.Parameter(torch.zeros(4, 4))], sym="cublas")
    # asked for on the CPU: refused at the first step, not silently run as panels
    p = torch.nn.Parameter(torch.randn(8, 16))
    p.grad = torch.randn(8, 16)
    with pytest.raises(ValueError, match="train.muon_sym=triton cannot run here"):
        FastMuon([p], sym="triton").step()


def test_ns_flops_count_the_tile_triangle_and_pick_the_form_with_it():
    from eagle3.kernels.muon import chosen_form, sym_kind
    from eagle3.kernels.symmm import tri_fraction

    assert tri_fraction(4096) == 32 * 33 / 2 / 32 ** 2 and tri_fraction(128) == 1.0
    assert sym_kind(4096, "triton") == "triton" and sym_kind(4000, "triton") == "panels"
    assert sym_kind(2048, "triton") == "triton" and sym_kind(1024, "triton") == "panels"  # too few tiles
    assert sym_kind(4096, "panels") == "panels"
    for m, n in ((4096, 14336), (4096, 12288), (4096, 8192), (2048, 8192), (4096, 4096)):
        for gram in (True, False):
            tri, pan = ns_flops(m, n, 5, gram, sym="triton"), ns_flops(m, n, 5, gram, panels=2)
            assert tri < pan, (m, n, gram)
    # the 8B draft's Newton-Schulz: 16.93 TFLOP in 2 panels, 13.01 with the tile triangle (k/v's
    # 1024-row Gram products stay whole cuBLAS GEMMs)
    groups = {(4096, 12288): 1, (4096, 8192): 1, (1024, 8192): 2, (4096, 4096): 1, (4096, 14336): 3}
    assert abs(sum(c * ns_cost((m, n), 5) for (m, n), c in groups.items()) / 1e12 - 16.93) < 0.01
    assert abs(sum(c * ns_cost((m, n), 5, sym="triton") for (m, n), c in groups.items()) / 1e12 - 13.01) < 0.01
    # o_proj's square shape: the standard form either way; the Gram form keeps its panels for a
    # product the kernel cannot take (a float32 gram_dtype)
    assert chosen_form(4096, 4096, 5, sym="triton") == (False, 1)
    assert chosen_form(4096, 14336, 5, sym="triton") == (True, 2)


def test_sym_product_on_the_panels_adds_the_diagonal():
    from eagle3.kernels.muon import sym_product

    g = torch.Generator().manual_seed(0)
    X = torch.randn(2, 64, 96, generator=g, dtype=torch.float64)
    R = X @ X.mT
    got = sym_product(R, R, R, beta=-0.5, alpha=0.25, panels=2, diag=3.0)
    want = -0.5 * R + 0.25 * R @ R + 3.0 * torch.eye(64, dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-10)


# -- DDP: two gloo ranks, each half the batch, against one process on the whole batch -----------------

D_IN, D_HID, D_OUT, BATCH, STEPS = 48, 160, 40, 16, 6


def _ddp_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, D_HID, bias=False), torch.nn.SiLU(),
                               torch.nn.Linear(D_HID, D_HID), torch.nn.SiLU(),
                               torch.nn.Linear(D_HID, D_OUT, bias=False))


def _ddp_data():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, D_IN, generator=gen), torch.randn(BATCH, D_OUT, generator=gen)) for _ in range(STEPS)]


def _muon_adamw(model, impl: str):
    from eagle3.train.optim import MuonWithAdamW, split_for_muon

    muon, rest = split_for_muon(model.named_parameters())
    tcfg = TrainConfig(optimizer="muon", muon_lr=2e-2, lr=1e-3, muon_impl=impl)
    return MuonWithAdamW(muon, rest, tcfg, fused=False)


def _train(model, opt, data, rows=slice(None)):
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _ddp_worker(rank: int, world: int, port: int, impl: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = DDP(_ddp_model())
        opt = _muon_adamw(model.module, impl)
        half = BATCH // world
        _train(model, opt, _ddp_data(), slice(rank * half, (rank + 1) * half))
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, f"{out}.{rank}")
        # teardown in order: both ranks done with every collective, DDP's reducer (which holds the group)
        # released, then the group destroyed (once, a rank aborted in gloo's teardown without this)
        dist.barrier()
        del model, opt
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("impl", ["fast", "torch"])
def test_muon_under_ddp_gives_the_one_process_update(impl, tmp_path):
    """DDP all-reduces (averages) the gradients, so every rank orthogonalises the whole gradient of
    every matrix: both ranks end identical, and equal to one process on the whole batch up to the
    bf16 rounding of gradients that differ in float32 summation order."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "ddp")
    mp.spawn(_ddp_worker, args=(2, port, impl, out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    one = _ddp_model()
    _train(one, _muon_adamw(one, impl), _ddp_data())
    init = _ddp_model().state_dict()
    for k, v in one.state_dict().items():
        assert torch.equal(ranks[0][k], ranks[1][k]), k  # the ranks agree exactly
        moved = (v - init[k]).norm()
        assert moved > 0, k
        # bf16 rounding flips after a different float32 summation: ~1% of a step's update, compounding
        # over the steps through the gradients (torch's Muon itself: 0.4-4.4% of the distance moved)
        assert (ranks[0][k] - v).norm() < 0.08 * moved, (k, (ranks[0][k] - v).norm().item(), moved.item())


def test_muon_is_still_refused_under_fsdp():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from eagle3.train.optim import check_optimizer_distribution

    with pytest.raises(ValueError, match="not supported with FSDP"):
        check_optimizer_distribution(SimpleNamespace(distributed_type=DistributedType.FSDP),
                                     TrainConfig(optimizer="muon", muon_impl="fast"))


if os.environ.get("EAGLE3_MUON_TEST_CUDA") and torch.cuda.is_available():  # pragma: no cover - GPU only
    def test_cuda_gram_equals_torch():
        gen = torch.Generator().manual_seed(0)
        for m, n in [(1024, 3584), (512, 4096)]:
            for name, G in spectra(m, n, gen):
                G = G.cuda()
                ref, t = ns_float64(G), torch_ns(G, COEFFS, 5, 1e-7)
                (g,) = orthogonalise([G], COEFFS, 5, 1e-7, gram="always")
                assert rel(g, ref, ref) < 1.05 * rel(t, ref, ref) + 1e-3, name


SHARD_RUNNER = """
import json, sys
import torch
import torch.distributed as dist
from eagle3.kernels.muon import FastMuon, ns_cost, shard_owners

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
shapes = [(96, 256), (256, 96), (96, 256), (64, 192), (192, 64), (128, 128), (32, 256), (48, 48)]
g = torch.Generator().manual_seed(0)
init = [torch.randn(s, generator=g) for s in shapes]
grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]

def run(shard):
    ps = [torch.nn.Parameter(x.clone()) for x in init]
    opt = FastMuon(ps, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw", shard=shard)
    for gs in grads:
        for p, x in zip(ps, gs):
            p.grad = x.clone()
        opt.step()
    return [p.detach() for p in ps], opt.shared

sharded, counts = run(True)
whole, whole_counts = run(False)
gathered = [None] * world
dist.all_gather_object(gathered, [p.tolist() for p in sharded])
owner = shard_owners([ns_cost(s, 5) for s in shapes], world)
if rank == 0:
    json.dump({"same_on_every_rank": all(x == gathered[0] for x in gathered),
               "max_diff": max((a - b).abs().max().item() for a, b in zip(sharded, whole)),
               "max_update": max((a - x).abs().max().item() for a, x in zip(whole, init)),
               "counts": counts, "whole_counts": whole_counts, "mine": owner.count(0)}, open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


def test_fast_muon_sharded_over_processes_is_the_one_process_update(tmp_path):
    """FastMuon in a group of 2 gloo processes holding the same gradients (as DDP leaves them): each
    process orthogonalises its share of the matrices (:func:`shard_owners`) and receives the others;
    the weights come out identical on both processes and equal to every process computing every
    matrix (up to the float32 rounding of batching matrices in other groups)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    script = tmp_path / "shard.py"
    script.write_text(SHARD_RUNNER)
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29583",
                    str(script), str(out)], check=True, env=env, timeout=300)
    r = json.loads(out.read_text())
    assert r["same_on_every_rank"]
    assert r["max_update"] > 1e-2 and r["max_diff"] <= 1e-6 * r["max_update"], r  # bitwise on the CPUs seen
    steps, n = 4, 8
    assert r["whole_counts"] == {"computed": steps * n, "received": 0}
    assert 0 < r["mine"] < n and r["counts"] == {"computed": steps * r["mine"], "received": steps * (n - r["mine"])}


def test_shard_owners_balance_the_newton_schulz_flops():
    """The 8B draft's 8 Muon matrices over 1, 2, 4 and 8 processes: every process gets a share, no
    process carries more than the largest matrix above an even split, and 8 processes get one each."""
    # fc, q, k, v (over the embedding and hidden halves), o, gate, up, down
    shapes = [(4096, 12288), (4096, 8192), (1024, 8192), (1024, 8192), (4096, 4096), (14336, 4096),
              (14336, 4096), (4096, 14336)]
    costs = [ns_cost(s, 5) for s in shapes]
    assert shard_owners(costs, 1) == [0] * 8
    for world in (2, 4, 8):
        owner = shard_owners(costs, world)
        load = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(world)]
        assert sorted(set(owner)) == list(range(min(world, 8)))
        assert max(load) <= sum(costs) / world + max(costs)
    assert len(set(shard_owners(costs, 8))) == 8  # one matrix each on 8 processes
    # the form and panels orthogonalise uses: the Gram form's (2 panels) for the MLP's 4096 x 14336
    assert ns_cost((14336, 4096), 5) == ns_flops(4096, 14336, 5, True, panels=2)
    assert ns_cost((4096, 4096), 5) == ns_flops(4096, 4096, 5, False)


def _muon_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(48, 128), (128, 48), (48, 128), (64, 64), (16, 128)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes], g


def test_fast_muon_grad_scale_divides_the_gradients():
    """FastMuon's ``grad_scale`` (the clip folded in): the same steps as gradients divided by it first."""
    def run(fold):
        ps, g = _muon_params()
        opt = FastMuon(ps, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
        for i in range(4):
            scale = torch.tensor(1.0 + 2.5 * i)
            grads = [torch.randn(p.shape, generator=g) for p in ps]
            for p, x in zip(ps, grads):
                p.grad = x.clone() if fold else x / scale
            opt.grad_scale = scale if fold else None
            opt.step()
        return torch.cat([p.detach().flatten() for p in ps])

    folded, plain = run(True), run(False)
    assert torch.allclose(folded, plain, rtol=0, atol=1e-6), (folded - plain).abs().max()


def test_clip_folded_into_muon_with_adamw_is_clip_grad_norm():
    """train.optimizer=muon: fold_clip hands the clip coefficient to FastMuon and fused AdamW; the steps
    equal clip_grad_norm_ then step, for gradients above and below the clipping norm."""
    from conftest import fold_against_clip

    from eagle3.train.optim import MuonWithAdamW, can_fold

    tcfg = TrainConfig(optimizer="muon")

    def make():
        mats, g = _muon_params(1)
        rest = [torch.nn.Parameter(torch.randn(40, generator=g))]
        opt = MuonWithAdamW([(f"m{i}", p) for i, p in enumerate(mats)], [("norm", rest[0])], tcfg, fused=True)
        return opt, mats + rest, g

    (folded, n1), (plain, n2) = fold_against_clip(make)
    assert n1 == pytest.approx(n2, rel=1e-6) and max(n1) > 0.5 > min(n1)  # both regimes occur
    assert torch.allclose(folded, plain, rtol=0, atol=1e-5), (folded - plain).abs().max()
    assert not can_fold(MuonWithAdamW([("m", torch.nn.Parameter(torch.ones(4, 4)))], [("n", torch.nn.Parameter(torch.ones(4)))],
                                      TrainConfig(optimizer="muon", muon_impl="torch"), fused=True))


def test_fast_muon_compiled_passes_take_the_eager_steps():
    """FastMuon's passes before and after the iteration, compiled (as on CUDA; here inductor's CPU
    code), take the steps of the same passes run eagerly, with the clip folded in and a changing
    learning rate (which must not recompile them into other numbers)."""
    def run(compile_):
        ps, g = _muon_params(2)
        ps = ps[:2]  # one shape group (48 x 128 and its transpose): a small compile
        init = torch.cat([p.detach().flatten() for p in ps])
        opt = FastMuon(ps, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="original", compile=compile_)
        for i in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.grad_scale = torch.tensor(1.0 + i)
            opt.param_groups[0]["lr"] = 0.02 / (1 + i)
            opt.step()
        return torch.cat([p.detach().flatten() for p in ps]) - init

    compiled, eager = run(True), run(False)
    # the compiled pass rounds the bf16 update once where eager rounds each op: a few bf16 ulps
    diff, size = (compiled - eager).abs().max().item(), eager.abs().max().item()
    assert size > 1e-2 and diff <= 2 ** -5 * size, (diff, size)


@pytest.mark.parametrize("mode,expect", [("auto", None), ("true", True), ("false", False)])
def test_train_compile_decides_whether_fast_muons_passes_are_compiled(mode, expect):
    """train.compile reaches FastMuon: auto leaves it to the device (compiled on CUDA), true and false
    force it; an unset FastMuon(compile=None) compiles on CUDA only."""
    from eagle3.train.optim import MuonWithAdamW

    opt = MuonWithAdamW([("m", torch.nn.Parameter(torch.ones(4, 8)))], [("n", torch.nn.Parameter(torch.ones(4)))],
                        TrainConfig(optimizer="muon", compile=mode), fused=True)
    assert opt.muon.compile is expect
    prep, _ = opt.muon._get_passes(torch.device("cpu"))
    assert (prep is not momentum_stack) == bool(expect)
