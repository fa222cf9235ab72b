"""train.fp8_matmul (eagle3/kernels/fp8_matmul.py) on CPU, where torch._scaled_mm runs too: the op against
its arithmetic written out (quantize, dequantize, multiply in float64), the refusals, and the TTT
model and a short training run against the same in bf16/float32 matmuls."""
from __future__ import annotations

import pytest
import torch
from test_head_loss import _batch, _draft

from eagle3.kernels.fp8_matmul import E4M3, Fp8Weight, check_dims, linear, quantize_rows, quantize_weight, row_scale
from eagle3.train.ttt import TTTModel, check_fp8


def dequant(q, s):
    return q.double() * s.double()


def test_rows_are_scaled_by_powers_of_two_into_e4m3s_range():
    x = torch.randn(5, 48) * torch.tensor([1e-3, 1.0, 300.0, 7e4, 0.0])[:, None]
    q, s = quantize_rows(x)
    assert q.dtype == E4M3 and q.is_contiguous() and s.shape == (5, 1) and s.dtype == torch.float32
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    amax = x.abs().amax(-1, keepdim=True)
    # the largest entry uses the top binade of e4m3 (<= 448, > 224) in every row that is not all zeros
    top = q.float().abs().amax(-1, keepdim=True)
    assert bool(((top <= 448) & (top > 224))[:4].all()) and float(top[4]) == 0.0
    # rounding to e4m3 (3 mantissa bits): within half a unit in the last place, 2^-4 relative
    err = (dequant(q, s) - x.double()).abs()
    assert bool((err <= 2.0 ** -4 * x.double().abs() + 1e-30 + 2.0 ** -9 * s.double()).all())
    assert torch.equal(row_scale(amax), s)


@pytest.mark.parametrize("recipe", ["on", "bf16_wgrad"])
@pytest.mark.parametrize("tokens", [32, 37])  # 37: padded to 48 rows inside, cut back after
def test_op_is_its_quantized_arithmetic_forward_and_both_gradients(recipe, tokens):
    """y = Q(x) Q(W)^T, dx = Q(dy) Q_cols(W), dW = Q_cols(dy)^T Q_cols(x) (or dy^T x in the
    activations' dtype with bf16_wgrad), each Q one scale per row of the contraction."""
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 64, requires_grad=True)
    w = (0.1 * torch.randn(96, 64)).requires_grad_()
    dy = torch.randn(tokens, 96)
    y = Fp8Weight(w, recipe)(x)
    dx, dw = torch.autograd.grad(y, (x, w), dy)

    def q(t):
        return dequant(*quantize_rows(t))
    xd, wd, dyd = x.detach(), w.detach(), dy
    want_y = q(xd) @ q(wd).T
    want_dx = q(dyd) @ q(wd.T).T
    want_dw = q(dyd.T) @ q(xd.T).T if recipe == "on" else dyd.double().T @ xd.double()
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        assert got.shape == want.shape and got.dtype == torch.float32
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    # a constant input (the normalised embeddings' projection): the weight's gradient alone, the same
    (dw_only,) = torch.autograd.grad(Fp8Weight(w, recipe)(x.detach()), (w,), dy)
    assert torch.equal(dw_only, dw)
    # and a float8 product is near the exact one: a few percent of the result
    exact = xd.double() @ wd.double().T
    assert 1e-3 < ((y.double() - exact).norm() / exact.norm()).item() < 0.06


def test_linear_and_quantize_weight_dispatch():
    x, w = torch.randn(16, 32), torch.randn(48, 32)
    assert quantize_weight(w, "off") is w
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    fw = quantize_weight(w, "bf16_wgrad")
    assert isinstance(fw, Fp8Weight) and fw.recipe == "bf16_wgrad"
    assert torch.equal(linear(x, fw), fw(x))
    with pytest.raises(ValueError, match="must be one of"):
        quantize_weight(w, "e5m2")


def test_refusals_say_what_and_how():
    with pytest.raises(ValueError, match=r"multiples of 16 .*\[40\].*train.fp8_matmul=off"):
        check_dims("a weight", 64, 40)
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Weight(torch.randn(40, 64))
    from eagle3.config import TrainConfig
    from eagle3.kernels.fp8_matmul import RECIPES

    for recipe in RECIPES:  # the config accepts exactly the op's recipes
        TrainConfig(fp8_matmul=recipe)
    with pytest.raises(ValueError, match="fp8_matmul"):
        TrainConfig(fp8_matmul="yes")
    check_fp8("on", torch.device("cpu"), torch.float32)  # CPUs run it, in either dtype


def test_gpus_without_rowwise_float8_are_refused(monkeypatch):
    """No GPU here: torch.cuda's answers are stood in for. An Ada (8.9) or Ampere GPU is refused
    with its name and what to set; a Hopper one passes in bf16 and is refused in float32."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA L40S")
    cuda = torch.device("cuda")
    for cap in ((8, 9), (8, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, cap=cap: cap)
        with pytest.raises(ValueError, match=rf"9\.0 or later .*NVIDIA L40S .*{cap[0]}\.{cap[1]}.*fp8_matmul=off"):
            check_fp8("on", cuda, torch.bfloat16)
        check_fp8("off", cuda, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    check_fp8("bf16_wgrad", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="needs bf16 activations"):
        check_fp8("on", cuda, torch.float32)


@pytest.mark.parametrize("compiled", [False, True])
def test_ttt_model_in_fp8_is_near_its_float32_self(compiled):
    """The TTT model's loss and every parameter's gradient with the layer and fc in float8: near the
    float32 model's (loss to 1e-4, gradients' cosine > 0.99), eager and compiled alike."""
    torch.manual_seed(0)
    draft = _draft()
    batch = _batch()
    out = {}
    for mode in ("off", "on", "bf16_wgrad"):
        model = TTTModel(draft, num_steps=3, attention="sdpa", compile=compiled and mode == "on", fp8_matmul=mode)
        loss, stats = model(**batch)
        out[mode] = (loss.detach(), stats, torch.autograd.grad(loss, list(draft.parameters())))
    l0, s0, g0 = out["off"]
    for mode in ("on", "bf16_wgrad"):
        loss, stats, grads = out[mode]
        assert (loss - l0).abs() <= 1e-4 * l0.abs(), mode
        assert torch.equal(stats[:, 1:3], s0[:, 1:3])  # the same positions scored and counted
        for (name, _), g, r in zip(draft.named_parameters(), grads, g0):
            if r.abs().sum() == 0:
                continue
            cos = torch.nn.functional.cosine_similarity(g.flatten().double(), r.flatten().double(), 0)
            assert cos > 0.99, (mode, name, float(cos))
            assert not torch.equal(g, r) or "norm" in name or "lm_head" in name  # float8 did run


def test_evaluation_multiplies_in_the_served_precision():
    """Without gradients (the loop's held-out evaluation) the model with train.fp8_matmul=on computes
    what the served draft computes: the same loss and statistics as with it off, bit for bit."""
    torch.manual_seed(0)
    draft = _draft()
    batch = _batch()
    with torch.no_grad():
        l0, s0 = TTTModel(draft, num_steps=3, attention="sdpa", fp8_matmul="off")(**batch)
        l1, s1 = TTTModel(draft, num_steps=3, attention="sdpa", fp8_matmul="on")(**batch)
    assert torch.equal(l0, l1) and torch.equal(s0, s1)
    loss, _ = TTTModel(draft, num_steps=3, attention="sdpa", fp8_matmul="on")(**batch)
    assert not torch.equal(loss.detach(), l0)  # with gradients the float8 matmuls run


def test_short_training_in_fp8_follows_the_float32_run():
    """60 AdamW steps on a learnable task (each target a fixed function of the token embedding the
    draft is given with it): the float8 run's loss falls as the float32 run's, within 2% at every
    tenth step."""
    torch.manual_seed(0)
    base = _draft()
    gen = torch.Generator().manual_seed(3)
    proj = torch.randn(64, 64, generator=gen)
    batches = []
    for _ in range(4):
        b = _batch()
        b["embeds"] = torch.randn(b["embeds"].shape, generator=gen)
        # p_t from x_t's embedding: step j at t is handed x_{t+j+1} and scored against p_{t+j+1}
        b["target_probs"] = torch.softmax(b["embeds"] @ proj, -1)
        b["in_vocab"] = torch.ones_like(b["in_vocab"])
        batches.append(b)
    curves = {}
    for mode in ("off", "on"):
        draft = _draft()
        draft.load_state_dict(base.state_dict())
        model = TTTModel(draft, num_steps=3, attention="sdpa", fp8_matmul=mode)
        opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
        losses = []
        for i in range(60):
            loss, _ = model(**batches[i % 4])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        curves[mode] = losses
    off, on = curves["off"], curves["on"]
    assert off[-1] < 0.5 * off[0], off  # the task is learnt
    for i in range(9, 60, 10):
        assert abs(on[i] - off[i]) <= 0.02 * off[i], (i, on[i], off[i])


def test_mla_draft_in_fp8_is_near_its_float32_self():
    """A DeepSeek-V3-style draft (MLA attention, as for Kimi-K2.5): its packed q_a/kv_a projection,
    o and MLP in float8 (q_b and kv_b stay in the activations' dtype), near the float32 model."""
    from test_draft import _mla_cfg

    from eagle3.model.draft import Eagle3Draft

    torch.manual_seed(0)
    cfg = _mla_cfg()
    draft = Eagle3Draft(cfg)
    B, T, H = 2, 32, cfg.hidden_size
    batch = dict(aux=torch.randn(B, T, 3 * cfg.target_hidden_size), embeds=torch.randn(B, T, H),
                 target_probs=torch.softmax(torch.randn(B, T, cfg.draft_vocab_size), -1),
                 in_vocab=torch.ones(B, T, dtype=torch.bool), loss_mask=torch.ones(B, T, dtype=torch.long),
                 position_ids=torch.arange(T).expand(B, T), doc_ids=torch.zeros(B, T, dtype=torch.long))
    params = [p for p in draft.parameters() if p.requires_grad]
    out = {}
    for mode in ("off", "on"):
        loss, _ = TTTModel(draft, num_steps=2, attention="sdpa", fp8_matmul=mode)(**batch)
        out[mode] = (loss.detach(), torch.autograd.grad(loss, params, allow_unused=True))
    (l0, g0), (l1, g1) = out["off"], out["on"]
    assert (l1 - l0).abs() <= 1e-3 * l0.abs()
    for p, a, r in zip(params, g1, g0):
        if p.dim() == 2 and r is not None and r.abs().sum() > 0:
            assert torch.nn.functional.cosine_similarity(a.flatten().double(), r.flatten().double(), 0) > 0.98
