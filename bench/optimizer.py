"""One optimizer step of the draft: fused AdamW, torch's Muon + AdamW, and FastMuon + AdamW
(``train.optimizer=muon``, ``train.muon_impl=torch|fast``, eagle3/train/optim.py and
eagle3/kernels/muon.py), and the Newton-Schulz orthogonalisation alone per matrix shape.

    python bench/optimizer.py                 # CUDA: the 8B-shaped draft (H 4096, 32/8 heads, MLP 14336,
                                              # fc 3 x 4096 -> 4096, draft vocab 32000), bf16 and fp32 params
    python bench/optimizer.py --small         # a small shape (runs on CPU; what the CPU tests run)
    python bench/optimizer.py --train-step    # CPU: a whole train step, AdamW vs Muon (bench/results/train_h200_202611.md)
    python bench/optimizer.py --sym           # CUDA: FastMuon's symmetric products, the Triton tile triangle
                                              # (train.muon_sym=triton) against cuBLAS row panels and whole GEMMs

The parameter set is the real Eagle3Draft's at that shape, with random gradients; split as the
loop splits it (Muon on fc, q/k/v/o, gate/up/down; AdamW on lm_head and the norms). Times: CUDA
events (perf_counter on CPU) around ``opt.step()``, median of ``--steps`` after ``--warmup``.
FLOPs: the Newton-Schulz matmuls (eagle3.kernels.muon.ns_flops), standard form for torch's Muon,
the chosen form per shape for FastMuon. Also checks, per shape, the distance of FastMuon's and
torch's orthogonalisation from a float64 iteration on ill-conditioned inputs (``error`` columns).
Also FastMuon's Newton-Schulz split over W processes (``train.muon_shard``, DDP): each process's
share (eagle3.kernels.muon.shard_owners) orthogonalised alone, the shares one after another on this one
device; a step waits for the slowest share, then for the all-reduce that shares the results (the
bytes of the others' results are given; it is not timed: that needs W devices, bench/train_dist.py).
Prints a table last; writes $OUT/bench_optimizer.json when OUT is set. No hydra needed.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3.config import TrainConfig  # noqa: E402
from eagle3.kernels.muon import (  # noqa: E402
    chosen_form,
    gram_newton_schulz,
    newton_schulz,
    normalised,
    ns_cost,
    ns_flops,
    orthogonalise,
    resolve_sym,
    shard_owners,
    sym_panels,
    use_gram,
)
from eagle3.model.draft import Eagle3Draft, Eagle3DraftConfig  # noqa: E402
from eagle3.train.optim import build_optimizer, split_for_muon  # noqa: E402

COEFFS = (3.4445, -4.7750, 2.0315)
SWEEP_MIN_ROWS = 2048  # groups this tall also get the panel sweep (FastMuon panels them by default)
SHAPES = {  # name: (hidden, heads, kv heads, head dim, intermediate, draft vocab)
    "8b": (4096, 32, 8, 128, 14336, 32000),
    "small": (256, 4, 2, 64, 896, 1024),  # the 8B draft's aspect ratios (MLP 3.5, fc 3, q 2, k/v 8)
}


def torch_ns(G):
    """torch's own per-matrix orthogonalisation (torch.optim._muon), or the same iteration if private
    names moved."""
    try:
        import inspect

        from torch.optim._muon import _zeropower_via_newtonschulz as ns
        extra = (False,) if "use_addmm" in inspect.signature(ns).parameters else ()  # some versions: torch's default
        return ns(G, COEFFS, 5, 1e-7, *extra)
    except (ImportError, TypeError, ValueError):  # pragma: no cover
        X = G.bfloat16()
        X = X.T if G.shape[0] > G.shape[1] else X
        X = newton_schulz(normalised(X[None], 1e-7), COEFFS, 5)[0]
        return X.T if G.shape[0] > G.shape[1] else X


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, warmup: int, steps: int) -> float:
        """Median ms of fn()."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(steps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)


def make_draft(shape: str, device, dtype) -> Eagle3Draft:
    H, nh, kv, hd, inter, dv = SHAPES[shape]
    cfg = Eagle3DraftConfig(hidden_size=H, target_hidden_size=H, num_attention_heads=nh, num_key_value_heads=kv,
                            head_dim=hd, intermediate_size=inter, rms_norm_eps=1e-5, vocab_size=4 * dv,
                            draft_vocab_size=dv, aux_layer_ids=[1, 2, 3], rope_theta=500000.0)
    with torch.device(device):
        model = Eagle3Draft(cfg)
    model.to(dtype)
    if device.type == "meta":
        return model
    gen = torch.Generator(device=device).manual_seed(0)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = (torch.randn(p.shape, generator=gen, device=device) * 1e-3).to(dtype)
    return model


def muon_flops(model, impl: str, sym: str = "panels") -> int:
    muon, _ = split_for_muon(model.named_parameters())
    if impl != "fast":
        return sum(ns_flops(*p.shape, 5, False) for _, p in muon)
    return sum(ns_cost(p.shape, 5, sym=sym) for _, p in muon)


def bench_steps(a, shape, device, dtype, timer) -> list[dict]:
    rows = []
    for name, kw in (("adamw (fused)", dict(optimizer="adamw")),
                     ("adamw (compiled)", dict(optimizer="adamw", adamw_impl="compiled")),
                     ("torch Muon + AdamW", dict(optimizer="muon", muon_impl="torch")),
                     ("FastMuon + AdamW", dict(optimizer="muon", muon_impl="fast")),
                     ("FastMuon + AdamW (compiled)", dict(optimizer="muon", muon_impl="fast", adamw_impl="compiled")),
                     ("FastMuon (eager)", dict(optimizer="muon", muon_impl="fast", eager=True))):
        kw = dict(kw)
        eager = kw.pop("eager", False)
        model = make_draft(shape, device, dtype)
        opt = build_optimizer(model, TrainConfig(**kw), device)
        if eager:  # the passes before and after the iteration not compiled (the default on CUDA)
            opt.muon.compile = False
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ms = timer(opt.step, a.warmup, a.steps)
        flops = muon_flops(model, kw.get("muon_impl", ""), resolve_sym("auto", device)) if kw["optimizer"] == "muon" else 0
        rows.append({"what": "step", "variant": name, "params": str(dtype).removeprefix("torch."), "ms": ms,
                     "ns_tflop": flops / 1e12, "tflops": flops / ms / 1e9 if flops else None,
                     "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None})
        print(json.dumps(rows[-1]), flush=True)
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_shards(a, shape, device, timer, worlds=(1, 2, 4, 8)) -> list[dict]:
    """The Muon matrices' Newton-Schulz as FastMuon splits it over W processes (and runs it on this
    device: train.muon_sym=auto): each share timed."""
    model = make_draft(shape, device, torch.bfloat16)
    mats = [p.grad for _, p in split_for_muon(model.named_parameters())[0]]
    sym = resolve_sym("auto", device)
    costs = [ns_cost(m.shape, 5, sym=sym) for m in mats]
    rows = []
    for world in worlds:
        owner = shard_owners(costs, world)
        shares = [[m for m, o in zip(mats, owner) if o == r] for r in range(world)]
        ms = [timer(lambda mine=mine: orthogonalise(mine, COEFFS, 5, 1e-7, sym=sym), a.warmup, a.steps)
              for mine in shares]
        received = [sum(m.numel() * 2 for m, o in zip(mats, owner) if o != r) for r in range(world)]
        rows.append({"what": "shard", "processes": world, "slowest_ms": max(ms), "share_ms": ms,
                     "matrices": [len(x) for x in shares],
                     "slowest_tflop": max(sum(c for c, o in zip(costs, owner) if o == r) for r in range(world)) / 1e12,
                     "received_mb": max(received) / 1e6})
        print(json.dumps(rows[-1]), flush=True)
    del model
    return rows


def ill_conditioned(m, n, device, gen):
    """A gradient-like m x n matrix: columns of a random product scaled by 1/i (power-law spectrum)."""
    k = min(m, n)
    A = torch.randn(m, k, generator=gen, device=device) * torch.arange(1, k + 1, device=device).float() ** -1.0
    return A @ torch.randn(k, n, generator=gen, device=device) / n ** 0.5


def ns_float64(G):
    X = G.bfloat16().double()
    X = X.T if G.shape[0] > G.shape[1] else X
    X = X / X.norm()
    a, b, c = COEFFS
    for _ in range(5):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[0] > G.shape[1] else X


def bench_ns(a, shape, device, timer) -> list[dict]:
    """Per shape group of the draft's Muon matrices (m x n after the transpose, and how many):
    torch's per-matrix NS, the batched standard form and the batched Gram form."""
    model = make_draft(shape, torch.device("meta"), torch.bfloat16)  # shapes only
    groups = defaultdict(list)
    for n_, p in split_for_muon(model.named_parameters())[0]:
        groups[(min(p.shape), max(p.shape))].append(n_.split(".")[-2])
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for (m, n), names in groups.items():
        B = len(names)
        Gs = [torch.randn(m, n, generator=gen, device=device) for _ in range(B)]
        X = normalised(torch.stack([g.bfloat16() for g in Gs]), 1e-7)
        t_torch = timer(lambda Gs=Gs: [torch_ns(g) for g in Gs], a.warmup, a.steps)
        t_std = timer(lambda X=X: newton_schulz(X, COEFFS, 5, panels=1), a.warmup, a.steps)
        t_gram = timer(lambda X=X: gram_newton_schulz(X, COEFFS, 5, panels=1), a.warmup, a.steps)
        # the symmetric products in row panels (train.muon_sym=panels' default: sym_panels(m)), per panel count
        sweep = {}
        for pn in (2, 4, 8) if m >= SWEEP_MIN_ROWS else ():
            sweep[pn] = {"std_ms": timer(lambda X=X, pn=pn: newton_schulz(X, COEFFS, 5, panels=pn), a.warmup, a.steps),
                         "gram_ms": timer(lambda X=X, pn=pn: gram_newton_schulz(X, COEFFS, 5, panels=pn), a.warmup,
                                          a.steps),
                         "std_tflop": B * ns_flops(m, n, 5, False, panels=pn) / 1e12,
                         "gram_tflop": B * ns_flops(m, n, 5, True, panels=pn) / 1e12}
        # error against the float64 iteration on an ill-conditioned input (one matrix of the group)
        G = ill_conditioned(m, n, device, gen)
        ref = ns_float64(G)
        xg = normalised(G.bfloat16()[None], 1e-7)

        def err(Y, ref=ref):
            return ((Y.double() - ref).norm() / ref.norm()).item()

        e_torch, e_gram = err(torch_ns(G)), err(gram_newton_schulz(xg, COEFFS, 5, panels=1)[0])
        pd = sym_panels(m) if use_gram(m, n, 5) else 1  # the panels' default for its form (muon_sym=panels)
        fast = (gram_newton_schulz(xg, COEFFS, 5) if use_gram(m, n, 5) else newton_schulz(xg, COEFFS, 5))[0]
        f_std, f_gram = B * ns_flops(m, n, 5, False), B * ns_flops(m, n, 5, True)
        rows.append({"what": "ns", "shape": f"{B} x {m}x{n}", "matrices": ",".join(names),
                     "torch_ms": t_torch, "std_batched_ms": t_std, "gram_ms": t_gram,
                     "std_tflop": f_std / 1e12, "gram_tflop": f_gram / 1e12,
                     "std_tflops": f_std / t_std / 1e9, "gram_tflops": f_gram / t_gram / 1e9,
                     "fast_uses": "gram" if use_gram(m, n, 5) else "standard", "fast_panels": pd,
                     "fast_ms": (sweep[pd]["gram_ms" if use_gram(m, n, 5) else "std_ms"] if pd > 1 else
                                 t_gram if use_gram(m, n, 5) else t_std),
                     "fast_tflop": B * ns_flops(m, n, 5, use_gram(m, n, 5), panels=pd) / 1e12,
                     "panels": sweep, "err_fast_vs_f64": err(fast),
                     "err_torch_vs_f64": e_torch, "err_gram_vs_f64": e_gram,
                     "gram_vs_torch": ((gram_newton_schulz(xg, COEFFS, 5)[0].double() - torch_ns(G).double()).norm()
                                       / ref.norm()).item()})
        print(json.dumps(rows[-1]), flush=True)
        del Gs, X, G, ref
    return rows


def bench_sym(a, device, timer) -> dict:
    """FastMuon's symmetric products: (1) one product per shape and kernel configuration, the Triton
    tile triangle (eagle3.kernels.symmm) against cuBLAS whole and in row panels, each checked against a
    float64 product; (2) each shape group's whole Newton-Schulz, triton against panels (FastMuon's
    form choice for each), with FLOPs and the distance from a float64 iteration; (3) one optimizer
    step of the draft, train.muon_sym=triton against panels."""

    gen = torch.Generator(device=device).manual_seed(2)
    out = {"products": [], "groups": [], "steps": []}
    if a.sym_steps:
        out["steps"] = optimizer_steps(a, device, timer)
        return out
    # (1) products: (batch, m, k, kind) -- X X^T of the MLP / fc / q groups, an m x m product with C
    for nb, m, k, kind in ((3, 4096, 14336, "gram"), (1, 4096, 12288, "gram"), (1, 4096, 8192, "gram"),
                           (1, 4096, 4096, "gram"), (1, 4096, 4096, "square+C"), (3, 4096, 4096, "square+C")):
        X = (torch.randn(nb, m, k, generator=gen, device=device) / k ** 0.5).half()
        if kind == "gram":
            A, B, C = X, X.mT, None
        else:
            R = torch.bmm(X.float(), X.float().mT).half()
            A, B, C = R, R, R
        ref = torch.bmm(A.double(), B.double()) * 0.5 + (0.25 * C.double() if C is not None else 0)
        row = {"shape": f"{nb} x {m}x{m} (k {k}, {kind})", "whole_flop": 2 * nb * m * m * k}
        out["products"].append(time_product(a, timer, A, B, C, ref, row))
        print(json.dumps(row), flush=True)
    # (2) Newton-Schulz per shape group
    model = make_draft("8b", torch.device("meta"), torch.bfloat16)
    groups = defaultdict(list)
    for n_, p in split_for_muon(model.named_parameters())[0]:
        groups[(min(p.shape), max(p.shape))].append(n_.split(".")[-2])
    for (m, n), names in groups.items():
        nb = len(names)
        X = normalised(torch.stack([torch.randn(m, n, generator=gen, device=device).bfloat16()
                                    for _ in range(nb)]), 1e-7)
        G = ill_conditioned(m, n, device, gen)
        ref = ns_float64(G)
        xg = normalised(G.bfloat16()[None], 1e-7)
        row = {"shape": f"{nb} x {m}x{n}", "matrices": ",".join(names)}
        for sym in ("panels", "triton"):
            g, p = chosen_form(m, n, 5, sym=sym)
            run = functools.partial(gram_newton_schulz, coeffs=COEFFS, steps=5, panels=p, sym=sym) if g else \
                functools.partial(newton_schulz, coeffs=COEFFS, steps=5, panels=p, sym=sym)
            row[sym] = {"form": "gram" if g else "standard", "panels": p,
                        "ms": timer(functools.partial(run, X), a.warmup, a.steps),
                        "tflop": nb * ns_flops(m, n, 5, g, panels=p, sym=sym) / 1e12,
                        "err_vs_f64": ((run(xg)[0].double() - ref).norm() / ref.norm()).item()}
        row["err_torch_vs_f64"] = ((torch_ns(G).double() - ref).norm() / ref.norm()).item()
        out["groups"].append(row)
        print(json.dumps(row), flush=True)
        del X, G, ref
    # (3) one optimizer step
    out["steps"] = optimizer_steps(a, device, timer)
    return out


def optimizer_steps(a, device, timer, rounds: int = 2) -> list:
    """bench_sym's (3): one optimizer step of the 8B draft, FastMuon + AdamW, train.muon_sym=panels
    and =triton in turn, ``rounds`` times over (so that a drift of the GPU's clock over the run does
    not fall on one of them), each a median of ``a.steps`` steps."""
    model = make_draft("8b", device, torch.bfloat16)  # with random gradients
    opts = {sym: build_optimizer(model, TrainConfig(optimizer="muon", muon_impl="fast", muon_sym=sym), device)
            for sym in ("panels", "triton")}
    rows = []
    for r in range(rounds):
        for sym, opt in opts.items():
            torch.cuda.synchronize()
            rows.append({"round": r, "sym": sym, "ms": timer(opt.step, a.warmup, a.steps),
                         "ns_tflop": muon_flops(model, "fast", sym) / 1e12})
            print(json.dumps(rows[-1]), flush=True)
    del model, opts
    torch.cuda.empty_cache()
    return rows


def time_product(a, timer, A, B, C, ref, row: dict) -> dict:
    """bench_sym's (1) for one product: cuBLAS whole, two row panels, each Triton configuration."""
    from eagle3.kernels import symmm
    from eagle3.kernels.muon import sym_baddbmm

    nb, m = A.shape[:2]
    beta = 0.25 if C is not None else 0.0
    Cb = C if C is not None else A.new_zeros(nb, m, m)
    row["cublas_ms"] = timer(lambda: torch.baddbmm(Cb, A, B, beta=beta, alpha=0.5), a.warmup, a.steps)
    row["panels2_ms"] = timer(lambda: sym_baddbmm(C, A, B, beta=beta, alpha=0.5, panels=2), a.warmup, a.steps)
    for name in symmm.CONFIGS:
        Y = torch.full((nb, m, m), float("nan"), dtype=A.dtype, device=A.device)
        try:
            symmm.sym_mm(A, B, C, alpha=0.5, beta=beta, config=name, out=Y)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a configuration that does not build here is a row, not the end
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        err = ((Y.double() - ref).norm() / ref.norm()).item()
        ms = timer(functools.partial(symmm.sym_mm, A, B, C, alpha=0.5, beta=beta, config=name), a.warmup, a.steps)
        flop = row["whole_flop"] * symmm.tri_fraction(m)
        row[name] = {"ms": ms, "err": err, "tflops": flop / ms / 1e9, "nan": bool(Y.isnan().any())}
    row["picked"] = symmm.pick_config(m, A.shape[2])  # what sym_mm runs for this shape
    row["cublas_tflops"] = row["whole_flop"] / row["cublas_ms"] / 1e9
    row["cublas_err"] = ((torch.baddbmm(Cb, A, B, beta=beta, alpha=0.5).double() - ref).norm() / ref.norm()).item()
    return row


def print_sym(res: dict) -> None:
    from eagle3.kernels import symmm

    print("\nOne symmetric product: ms | TFLOP/s on the FLOPs each computes | error vs float64 "
          "(* the configuration sym_mm picks):")
    shapes = [r["shape"].replace(" (k ", "/").replace(", ", " ").rstrip(")") for r in res["products"]]
    print(f"{'':<22}" + "".join(f"{x:>26}" for x in shapes))
    rows = [("cuBLAS whole", [f"{r['cublas_ms']:.3f} | {r['cublas_tflops']:.0f} | {r['cublas_err']:.1e}"
                              for r in res["products"]]),
            ("cuBLAS 2 panels", [f"{r['panels2_ms']:.3f}" for r in res["products"]])]
    for n in symmm.CONFIGS:
        rows.append((n, [("*" if r["picked"] == n else "") + (
            f"{r[n]['ms']:.3f} | {r[n]['tflops']:.0f} | {r[n]['err']:.1e}{' NaN' if r[n]['nan'] else ''}"
            if "ms" in r[n] else "failed") for r in res["products"]]))
    for name, cells in rows:
        print(f"{name:<22}" + "".join(f"{c:>26}" for c in cells))
    for r in res["products"]:
        for n in symmm.CONFIGS:
            if "error" in r[n]:
                print(f"  {r['shape']} {n}: {r[n]['error']}")
    print("\nNewton-Schulz per shape group, FastMuon's form for each (ms / TFLOP / error vs float64; torch's error):")
    print(f"{'group':<18}{'panels':>34}{'triton':>34}{'torch err':>11}")
    for r in res["groups"]:
        c = [f"{r[k]['form']} {r[k]['ms']:.2f} / {r[k]['tflop']:.2f} / {r[k]['err_vs_f64']:.2e}"
             for k in ("panels", "triton")]
        print(f"{r['shape']:<18}{c[0]:>34}{c[1]:>34}{r['err_torch_vs_f64']:>11.2e}")
    tot = {k: sum(r[k]["ms"] for r in res["groups"]) for k in ("panels", "triton")}
    tf = {k: sum(r[k]["tflop"] for r in res["groups"]) for k in ("panels", "triton")}
    print(f"{'all':<18}{tot['panels']:>22.2f} ms {tf['panels']:.2f} TFLOP{tot['triton']:>18.2f} ms {tf['triton']:.2f} TFLOP")
    print_steps(res)


def print_steps(res: dict) -> None:
    print("\nOne optimizer step, FastMuon + AdamW (bf16 params; ms per round, the two in turn):")
    arms = {}
    for r in res["steps"]:
        arms.setdefault(r["sym"], []).append(r)
    for sym, rs in arms.items():
        print(f"  train.muon_sym={sym:<8}" + "".join(f"{r['ms']:>8.2f}" for r in rs)
              + f" ms  (Newton-Schulz {rs[0]['ns_tflop']:.2f} TFLOP)")


def train_step_cpu(argv) -> None:
    """The former CPU comparison: a whole train step (bench/train.py's train_step) + the step alone."""
    from bench.train import add_shape_args, describe_shape, make_batch, make_config, make_head, train_step
    from eagle3.train.ttt import TTTModel

    p = argparse.ArgumentParser()
    add_shape_args(p)
    p.set_defaults(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768, vocab=4096, draft_vocab=1024,
                   ttt=3, seq=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--train-step", action="store_true")
    a = p.parse_args(argv)
    cpu = torch.device("cpu")
    rows = []
    for optimizer, impl in (("adamw", "fast"), ("muon", "torch"), ("muon", "fast")):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        cfg = make_config(a)
        model = TTTModel(Eagle3Draft(cfg), num_steps=a.ttt, attention="sdpa")
        head, _ = make_head(cfg, cpu, torch.float32, gen)
        opt = build_optimizer(model, TrainConfig(optimizer=optimizer, muon_impl=impl), cpu)
        batches = [make_batch(cfg, a.batch, a.seq, cpu, torch.float32, gen) for _ in range(2)]
        step_s = []
        for i in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            train_step(model, head, batches[i % 2], opt, torch.float32, False, 0.5)
            if i >= a.warmup:
                step_s.append(time.perf_counter() - t0)
        train_step(model, head, batches[0], None, torch.float32, False, 0.5)
        opt_ms = Timer(cpu)(opt.step, a.warmup, a.steps)
        rows.append((optimizer if optimizer == "adamw" else f"muon/{impl}", 1e3 * statistics.median(step_s), opt_ms))
    print(f"CPU ({torch.get_num_threads()} threads), torch {torch.__version__}: {describe_shape(a)} tokens, float32")
    print(f"{'optimizer':<12}{'step ms':>10}{'optimizer ms':>14}{'step vs adamw':>15}")
    for name, s, o in rows:
        print(f"{name:<12}{s:>10.1f}{o:>14.2f}{s / rows[0][1] - 1:>+15.1%}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--train-step" in argv:
        return train_step_cpu(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="the small shape (CPU-sized) instead of the 8B draft's")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default=None, help="parameter dtypes, comma-separated (default: bfloat16,float32 "
                                                 "on CUDA -- bf16 params and the loop's fp32 master weights -- "
                                                 "float32 on CPU)")
    p.add_argument("--steps", type=int, default=None, help="timed repeats (default 10 on CUDA, 5 on CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--train-step", action="store_true", help="a whole CPU train step instead (see above)")
    p.add_argument("--sym", action="store_true", help="only the symmetric products: Triton against cuBLAS (CUDA)")
    p.add_argument("--sym-steps", action="store_true", help="with --sym: only (3), the optimizer steps")
    a = p.parse_args(argv)
    import torch._dynamo.config as dynamo_config

    # FastMuon's compiled passes get one graph per shape group and parameter dtype; this bench builds
    # the draft in two dtypes (a train run has one), more than dynamo's default limit of graphs per function
    dynamo_config.recompile_limit = max(64, dynamo_config.recompile_limit)
    device = torch.device(a.device)
    shape = "small" if a.small else "8b"
    if shape == "8b" and device.type != "cuda":
        sys.exit("the 8B-shaped step needs CUDA: run with --small on CPU")
    a.steps = a.steps or (10 if device.type == "cuda" else 5)
    dtypes = [getattr(torch, d) for d in (a.dtypes or ("bfloat16,float32" if device.type == "cuda" else "float32")).split(",")]
    timer = Timer(device)
    t0 = time.perf_counter()
    if a.sym:
        if device.type != "cuda":
            sys.exit("--sym needs CUDA (the Triton kernel)")
        res = bench_sym(a, device, timer)
        res.update(device=torch.cuda.get_device_name(), torch=torch.__version__, wall_s=time.perf_counter() - t0)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
            (Path(os.environ["OUT"]) / "bench_sym.json").write_text(json.dumps(res, indent=1))
        print(f"\n{res['device']}, torch {res['torch']}, median of {a.steps} after {a.warmup} warm-up; "
              f"{res['wall_s']:.0f} s")
        return print_sym(res) if not a.sym_steps else print_steps(res)
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
           "torch": torch.__version__, "shape": shape, "dims": SHAPES[shape], "args": vars(a)}
    if device.type == "cuda":
        out["tf32"] = torch.backends.cuda.matmul.allow_tf32
    out["steps"] = [r for d in dtypes for r in bench_steps(a, shape, device, d, timer)]
    out["ns"] = bench_ns(a, shape, device, timer)
    out["shards"] = bench_shards(a, shape, device, timer)
    out["wall_s"] = time.perf_counter() - t0
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "bench_optimizer.json").write_text(json.dumps(out, indent=1))

    print(f"\n{out['device']}, torch {torch.__version__}, draft shape {shape} {SHAPES[shape]}; "
          f"median of {a.steps} after {a.warmup} warm-up; {out['wall_s']:.0f} s")
    print("Newton-Schulz alone, per shape group (m x n after the transpose):")
    print(f"{'group':<18}{'matrices':<28}{'torch ms':>9}{'std bmm ms':>11}{'gram ms':>9}{'std TFLOP':>10}"
          f"{'gram TFLOP':>11}{'std TF/s':>9}{'gram TF/s':>10}{'fast':>9}{'err torch':>10}{'err gram':>9}{'gram-torch':>11}")
    for r in out["ns"]:
        print(f"{r['shape']:<18}{r['matrices']:<28}{r['torch_ms']:>9.2f}{r['std_batched_ms']:>11.2f}{r['gram_ms']:>9.2f}"
              f"{r['std_tflop']:>10.3f}{r['gram_tflop']:>11.3f}{r['std_tflops']:>9.0f}{r['gram_tflops']:>10.0f}"
              f"{r['fast_uses']:>9}{r['err_torch_vs_f64']:>10.2e}{r['err_gram_vs_f64']:>9.2e}{r['gram_vs_torch']:>11.2e}")
    tot = {k: sum(r[k] for r in out["ns"]) for k in ("torch_ms", "std_batched_ms", "std_tflop", "gram_tflop")}
    whole_ms = sum(r["gram_ms"] if r["fast_uses"] == "gram" else r["std_batched_ms"] for r in out["ns"])
    print(f"{'all':<46}{tot['torch_ms']:>9.2f}{tot['std_batched_ms']:>11.2f}{'':>9}{tot['std_tflop']:>10.3f}"
          f"  the chosen form, whole products: {whole_ms:.2f} ms")
    print("\nThe symmetric products in row panels (ms, TFLOP; 1 = whole GEMMs), and their default "
          "(train.muon_sym=panels; --sym times the Triton kernel, the CUDA default):")
    print(f"{'group':<18}{'form':>9}{'p=1':>16}{'p=2':>16}{'p=4':>16}{'p=8':>16}{'default':>9}{'ms':>8}{'err fast':>10}")
    for r in out["ns"]:
        g = r["fast_uses"] == "gram"
        cells = [f"{r['gram_ms' if g else 'std_batched_ms']:.2f} / {r['gram_tflop' if g else 'std_tflop']:.2f}"]
        for pn in (2, 4, 8):
            q = r["panels"].get(pn) or r["panels"].get(str(pn))
            cells.append(f"{q['gram_ms' if g else 'std_ms']:.2f} / {q['gram_tflop' if g else 'std_tflop']:.2f}" if q else "-")
        print(f"{r['shape']:<18}{r['fast_uses']:>9}" + "".join(f"{c:>16}" for c in cells)
              + f"{r['fast_panels']:>9}{r['fast_ms']:>8.2f}{r['err_fast_vs_f64']:>10.2e}")
    print(f"{'all, panels default':<43}{sum(r['fast_ms'] for r in out['ns']):>8.2f} ms, "
          f"{sum(r['fast_tflop'] for r in out['ns']):.3f} TFLOP")
    print("\nFastMuon's Newton-Schulz split over W processes (train.muon_shard; shares timed one after another "
          "here):")
    print(f"{'processes':>9}{'matrices per process':>24}{'slowest ms':>12}{'of 1 process':>14}{'slowest TFLOP':>15}"
          f"{'received MB':>13}  share ms")
    one = out["shards"][0]["slowest_ms"]
    for r in out["shards"]:
        print(f"{r['processes']:>9}{','.join(map(str, r['matrices'])):>24}{r['slowest_ms']:>12.2f}"
              f"{r['slowest_ms'] / one:>14.2f}{r['slowest_tflop']:>15.3f}{r['received_mb']:>13.0f}  "
              + " ".join(f"{x:.2f}" for x in r["share_ms"]))
    print("\nOne optimizer step (all the draft's parameters, random gradients):")
    print(f"{'variant':<29}{'params':<10}{'ms':>9}{'NS TFLOP':>10}{'NS TF/s':>9}{'peak GiB':>10}")
    for r in out["steps"]:
        tf = f"{r['tflops']:.0f}" if r["tflops"] else "-"
        pk = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        print(f"{r['variant']:<29}{r['params']:<10}{r['ms']:>9.2f}{r['ns_tflop']:>10.3f}{tf:>9}{pk:>10}")


if __name__ == "__main__":
    main()
