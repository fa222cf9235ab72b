"""The draft layer's matmuls in float8 for training (``train.fp8_matmul``): rowwise scales, bf16 out.

Each training matmul ``y = x W^T`` and its two gradients ``dx = dy W`` and ``dW = dy^T x`` runs as
``torch._scaled_mm`` on float8 e4m3 operands, each operand scaled per row of its contraction (one
scale per token and per weight row, as torchao's rowwise recipe), the products accumulated in
float32 and written in the activations' dtype. Scales are powers of two (the division by them is
exact; only the cast to e4m3 rounds), chosen so that each row's largest magnitude maps to at most
e4m3's 448. Hopper and Blackwell GEMMs run float8 at twice bf16's rate.

The weights stay float32 parameters (the optimizer's update is unchanged); what is quantized is the
bf16 weight of one forward, once per forward (:func:`quantize_weight`), in both orientations the
forward and the input gradient read, then shared by every TTT step. ``wgrad`` bf16 keeps the weight
gradient's matmul in bf16 (the one whose contraction runs over the tokens). Which matmuls: q/k/v
(both halves), o, gate/up, down and fc; in an MLA draft (``architecture=deepseek``) its packed
q_a/kv_a projection, o and the MLP, while q_b and kv_b stay in the activations' dtype.

Quantization is plain torch code: under ``torch.compile`` it fuses into the surrounding kernels.
"""
from __future__ import annotations

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MULTIPLE = 16
"""torch._scaled_mm's float8 operands need each dimension a multiple of 16: the token count is
padded with zero rows where it is not; the model's own dimensions must be."""
RECIPES = ("off", "on", "bf16_wgrad")
"""``train.fp8_matmul``: off | on (forward and both gradients in float8) | bf16_wgrad (the weight
gradient's matmul in bf16)."""


def row_scale(amax: Tensor) -> Tensor:
    """The power-of-two dequantisation scale per row: the smallest 2^k with amax / 2^k <= 448
    (rows of zeros get a tiny scale; their quantized values are zero)."""
    return torch.exp2(torch.ceil(torch.log2(amax.float().clamp(min=1e-30) / E4M3_MAX)))


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """(q, scale): a 2-D ``x`` as contiguous e4m3 values and one float32 scale per row [M, 1],
    ``q * scale`` equal to ``x`` up to e4m3's rounding."""
    s = row_scale(x.abs().amax(dim=-1, keepdim=True))
    return (x.float() / s).to(E4M3).contiguous(), s


def quantize_cols(x: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`quantize_rows` of ``x.t()``: one scale per column of a 2-D ``x``, the values laid out
    transposed (contiguous [cols, rows]), as a float8 GEMM's column-major operand needs them."""
    return quantize_rows(x.t())


def check_dims(name: str, *dims: int) -> None:
    """The model dimensions a float8 matmul multiplies, refused where torch._scaled_mm cannot."""
    bad = [d for d in dims if d % MULTIPLE]
    if bad:
        raise ValueError(f"train.fp8_matmul cannot run {name}: its dimensions {list(dims)} must be multiples "
                         f"of {MULTIPLE} for float8 matmuls ({bad} are not); use train.fp8_matmul=off")


class Fp8Weight:
    """A weight [N, K] of one forward, quantized for :func:`linear` under ``recipe`` (on |
    bf16_wgrad); calling it on x [..., K] is ``F.linear(x, w)`` in float8 (the gradient reaches ``w``)."""

    def __init__(self, w: Tensor, recipe: str = "on"):
        check_dims("a weight", *w.shape)
        self.w = w
        self.recipe = recipe
        with torch.no_grad():
            d = w.detach()
            self.q, self.s = quantize_rows(d)  # the forward's: per output row, over K
            self.tq, self.ts = quantize_cols(d)  # the input gradient's: per input column, over N

    def __call__(self, x: Tensor) -> Tensor:
        return _Fp8Linear.apply(x, self.w, self.q, self.s, self.tq, self.ts, self.recipe == "on")


def quantize_weight(w: Tensor, recipe: str) -> Tensor | Fp8Weight:
    """``w`` as :func:`linear` multiplies it under ``recipe`` (:data:`RECIPES`)."""
    if recipe == "off":
        return w
    if recipe not in RECIPES:
        raise ValueError(f"train.fp8_matmul must be one of {RECIPES}, got {recipe!r}")
    return Fp8Weight(w, recipe)


def linear(x: Tensor, w: Tensor | Fp8Weight) -> Tensor:
    """``F.linear(x, w)``, in float8 where ``w`` is an :class:`Fp8Weight`."""
    return w(x) if isinstance(w, Fp8Weight) else torch.nn.functional.linear(x, w)


def _pad_rows(x: Tensor) -> Tensor:
    extra = -x.shape[0] % MULTIPLE
    return x if not extra else torch.cat([x, x.new_zeros(extra, x.shape[1])])


def _mm(aq: Tensor, sa: Tensor, bq_t: Tensor, sb: Tensor, dtype: torch.dtype) -> Tensor:
    """(aq * sa) @ (bq_t * sb)^T: aq [M, K] and bq_t [N, K] row-major e4m3, sa [M, 1], sb [N, 1]."""
    return torch._scaled_mm(aq, bq_t.t(), scale_a=sa, scale_b=sb.t(), out_dtype=dtype)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, q, s, tq, ts, wgrad_fp8):
        shape, M = x.shape, x.shape[:-1].numel()
        x2 = _pad_rows(x.reshape(M, shape[-1]))
        xq, sx = quantize_rows(x2)
        out = _mm(xq, sx, q, s, x.dtype)[:M]
        ctx.save_for_backward(x2, tq, ts)
        ctx.shape, ctx.wgrad_fp8, ctx.w_dtype = shape, wgrad_fp8, w.dtype
        return out.view(*shape[:-1], q.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, tq, ts = ctx.saved_tensors
        M = ctx.shape[:-1].numel()
        dy2 = _pad_rows(dy.reshape(M, dy.shape[-1]))
        dx = dw = None
        if ctx.needs_input_grad[0]:  # not for constant inputs (the normalised embeddings' projection)
            dyq, sdy = quantize_rows(dy2)
            dx = _mm(dyq, sdy, tq, ts, dy.dtype)[:M].view(ctx.shape)
        if ctx.needs_input_grad[1]:
            if ctx.wgrad_fp8:  # contraction over the tokens: per output row of dy^T, per input column of x
                gq, sg = quantize_cols(dy2)
                xq, sx = quantize_cols(x2)
                dw = _mm(gq, sg, xq, sx, dy.dtype).to(ctx.w_dtype)
            else:
                dw = (dy2.t() @ x2).to(ctx.w_dtype)
        return dx, dw, None, None, None, None, None
