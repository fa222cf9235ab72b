"""float8 (e4m3) hidden states with one float32 scale per row: the ``fp8`` store format.

A row is one token's state of one layer ([..., H]). ``quantize`` maps it to e4m3 values and a
scale, ``dequantize`` maps them back. The arithmetic is float32 throughout and uses only
operations that IEEE 754 rounds exactly the same way on every device (a maximum of absolute
values, a product and a quotient of two float32 tensors, round-to-nearest-even into e4m3), so
the same input gives the same bits on CPU and GPU:

    amax   = max(|row|)                      (float32; exact)
    scale  = amax x float32(1/448)  (448 = e4m3's largest finite value); 1 where amax is 0
    values = e4m3(clamp(row / scale, -448, 448))    (the clamp only guards the roundings)
    row   ~= float32(values) * scale

The scale is a product with the float32 constant, not ``amax / 448``: PyTorch's CUDA kernel
divides by a Python scalar by multiplying with its reciprocal, its CPU kernel divides, and the two
differ in the last bit for about half of all inputs (seen on an H200: the GPU's and the CPU's
quantisation of the same states differed; with the product they are the same bits).

Relative error per element is at most 2^-4 of its magnitude (e4m3 keeps 3 mantissa bits) for
elements above the subnormal range (|x| >= 2^-6 * scale); smaller elements of a row have an
absolute error of at most 2^-10 * scale. A row with a non-finite element gets a non-finite scale:
the writer refuses it rather than storing garbage.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INV_FP8_MAX = 0.0022321429569274187088012695312500  # float32(1 / 448) exactly (a float64 literal that float32 holds)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (any float dtype, any device) -> (values [..., H] float8_e4m3fn, scales [...] float32)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax * INV_FP8_MAX, torch.ones_like(amax))
    scale = torch.where(torch.isnan(amax), amax, scale)  # NaN rows: a NaN scale, refused downstream
    values = (xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values, scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(values [..., H] float8, scales [...] float32) -> [..., H] in ``dtype``, computed in float32
    (one rounding of the product, relative 2^-24) and then cast."""
    out = values.float() * scales.float().unsqueeze(-1)
    return out if dtype == torch.float32 else out.to(dtype)


def bad_scales(scales: torch.Tensor) -> int:
    """How many scales are not finite and positive (what a valid fp8 store never holds)."""
    return int((~(torch.isfinite(scales) & (scales > 0))).sum())
