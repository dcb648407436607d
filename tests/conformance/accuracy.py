"""Accuracy models: how far an implementation's output may be from the float64 value of its definition.

Every output element is a rotation term  x_i c_i + sigma x_p s_p  (p the partner of i), evaluated on the
inputs as given (tables already rounded to their dtype, positions as passed). With u_D = EPS[D] / 2 the unit
roundoff of the output dtype D and s_i = |x_i| + |x_p| (the pair's scale; |c|, |s| <= 1):

- "float32" (one rounding): float32 math, rounded once to D. sin/cos of float32 angles (<= 2 ulp), two
  products and a sum, each a relative 2^-24 on a term bounded by s_i: well under 2^-20 s_i (F32_EVAL); then
  one rounding to D, at most EPS[D] |ref| (two units, so values near a binade edge pass).
- "dtype": the math in D itself, as transformers' own expression evaluates in the activations' dtype: each
  product rounded (u_D s_i together), the sum rounded (u_D |ref|): within EPS[D] (|ref| + s_i).
Both add ETA[D], half the spacing of D's subnormals: a result in the underflow range is rounded to a fixed
grid, an absolute error no relative term covers (fp16 below 6.1e-5).

Channels outside the rotary width are copies, compared bitwise.
"""
from __future__ import annotations

import torch

EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-52}
ETA = {torch.float32: 2.0**-150, torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134, torch.float64: 2.0**-1075}
F32_EVAL = 2.0**-20
MODELS = ("float32", "dtype")


def bound(ref64: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, model: str = "float32") -> torch.Tensor:
    """The allowed absolute error per element (see the module docstring)."""
    if model == "float32":
        return EPS[dtype] * ref64.abs() + F32_EVAL * scale + ETA[dtype]
    if model == "dtype":
        return EPS[dtype] * (ref64.abs() + scale) + ETA[dtype]
    raise ValueError(f"accuracy model: expected one of {MODELS}, got {model!r}")


def check(what: str, got: torch.Tensor, ref64: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
          model: str = "float32", copied: torch.Tensor = None):
    """`got` within the model's bound of `ref64` everywhere; where `copied` is True (channels past the rotary
    width), bitwise equal to the float64 value (the input as given there) rounded to `dtype`."""
    assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
    assert tuple(got.shape) == tuple(ref64.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(ref64.shape)}"
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    g = got.detach().double().cpu()
    ref64, scale = ref64.detach().double().cpu(), scale.detach().double().cpu()
    err = (g - ref64).abs()
    bad = ~(err <= bound(ref64, scale, dtype, model))  # NaN fails
    if copied is not None:
        copied = copied.cpu().expand_as(g)
        want = ref64.to(dtype).double()  # a copy, rounded once where the output dtype is narrower
        bad |= copied & ~((g == want) | (g.isnan() & want.isnan()))
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements outside the {model} accuracy model "
            f"(dtype {str(dtype).replace('torch.', '')}); first at {idx}: got {g[idx].item()!r}, want "
            f"{ref64[idx].item()!r}, bound {bound(ref64[idx], scale[idx], dtype, model).item():.3g}"
            f"{' (a copied channel: bitwise)' if copied is not None and bool(copied[idx]) else ''}")
