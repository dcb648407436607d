"""The one accuracy rule every comparison uses (SPEC.md section 4).

An output element is the float32 evaluation of  x_i cos f_i + sigma x_pi(i) sin f_pi'(i),  rounded
once to t.dtype. Against the exact value (float64 on the same rounded inputs):
- float32 evaluation: sin/cos (libdevice, <= 2 ulp), two products and one sum, each a relative
  error of at most 2^-24 on a term bounded by |x_i| or |x_pi(i)|: together well under
  16 * 2^-24 * (|x_i| + |x_pi(i)|) = 2^-20 * scale;
- the final rounding to t.dtype: at most one unit of eps(dtype) * |ref| (eps: 2^-23 fp32,
  2^-10 fp16, 2^-8 bf16; twice the unit roundoff, so values near a binade edge pass too).
The absolute term matters only where the two terms cancel; channels past rot_dim are copies and
must match bitwise.
"""
from __future__ import annotations

import torch

EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-52}
F32_EVAL = 2.0**-20


def partner_scale(x: torch.Tensor, rot_dim: int, interleaved: bool) -> torch.Tensor:
    """|x_i| + |x_pi(i)| for the rotated channels, 0 for the pass-through ones (float64)."""
    from rope.reference import partner_and_sign

    a = x.detach().double().abs()
    partner, _ = partner_and_sign(rot_dim, interleaved, x.device)
    scale = torch.zeros_like(a)
    scale[..., :rot_dim] = a[..., :rot_dim] + a[..., :rot_dim][..., partner]
    return scale


def error_bound(ref64: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return EPS[dtype] * ref64.abs() + F32_EVAL * scale


def assert_within_rounding(out: torch.Tensor, ref64: torch.Tensor, x: torch.Tensor, rot_dim: int,
                           interleaved: bool, what: str = "output"):
    """Every element of `out` within one rounding of `ref64`; the pass-through channels bitwise."""
    assert out.shape == ref64.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    got = out.detach().double()
    bound = error_bound(ref64, partner_scale(x, rot_dim, interleaved), out.dtype)
    err = (got - ref64).abs()
    bad = ~(err <= bound)  # NaN fails
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements outside one rounding of the float64 "
            f"reference; first at {idx}: got {got[idx].item()!r}, want {ref64[idx].item()!r}, "
            f"bound {bound[idx].item():.3g}; max error {err.max().item():.3g}")
    tail_out, tail_x = out[..., rot_dim:], x[..., rot_dim:]
    assert torch.equal(tail_out, tail_x.to(tail_out.dtype)), f"{what}: channels past rot_dim changed"
