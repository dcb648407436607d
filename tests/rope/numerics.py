"""The one accuracy rule every comparison uses (docs/contract.md section 4).

An output element is the float32 evaluation of  x_i cos f_i + sigma x_pi(i) sin f_pi'(i),  rounded
once to t.dtype. Against the exact value (float64 on the same rounded inputs):
- float32 evaluation: sin/cos (libdevice, <= 2 ulp), two products and one sum, each a relative
  error of at most 2^-24 on a term bounded by |x_i| or |x_pi(i)|: together well under
  16 * 2^-24 * (|x_i| + |x_pi(i)|) = 2^-20 * scale;
- the final rounding to t.dtype: at most one unit of eps(dtype) * |ref| (eps: 2^-23 fp32,
  2^-10 fp16, 2^-8 bf16; twice the unit roundoff, so values near a binade edge pass too).
- underflow: a result below the smallest normal number of t.dtype is rounded to the fixed grid of
  subnormals, with an absolute error of up to half their spacing, ETA (2^-25 for fp16, whose
  normal range ends at 6.1e-5), which no relative term covers. One ETA is added to every bound
  (negligible away from that range). With N(0, 1) fp16 data about one element in 10^7 needs it,
  so the large fp16 tensors of the GPU profile hit it often.
The absolute terms matter only where the two terms cancel or underflow; channels past rot_dim are
copies and must match bitwise.
"""
from __future__ import annotations

import torch

from tests.conformance.pairing import partner_and_sign

EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-52}
F32_EVAL = 2.0**-20
# Half the spacing of the subnormals of each dtype: the absolute rounding error in the underflow range.
ETA = {torch.float32: 2.0**-150, torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134, torch.float64: 2.0**-1075}


def partner_scale(x: torch.Tensor, rot_dim: int, interleaved: bool) -> torch.Tensor:
    """|x_i| + |x_pi(i)| for the rotated channels, 0 for the pass-through ones (float64)."""
    a = x.detach().double().abs()
    partner, _ = partner_and_sign(rot_dim, interleaved)
    partner = partner.to(x.device)
    scale = torch.zeros_like(a)
    scale[..., :rot_dim] = a[..., :rot_dim] + a[..., :rot_dim][..., partner]
    return scale


def error_bound(ref64: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return EPS[dtype] * ref64.abs() + F32_EVAL * scale + ETA[dtype]


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


# ----------------------------------------------------------------------------------------------
# Bounds for the invariants, derived from the rule above.
#
# Write r = R x for the exact map (float64 on the rounded inputs) and s_i = |x_i| + |x_pi(i)|.
# The rule says |out_i - r_i| <= EPS |r_i| + F32_EVAL s_i. Since |cos|, |sin| <= 1, |r_i| <= s_i, so
# without knowing r:   |out_i - r_i| <= U s_i,   U = EPS(dtype) + F32_EVAL       (*)
# Pass-through channels are copies: exact. Sums of products are formed in float64; FSUM bounds
# their relative rounding per term (n * 2^-53 for n terms, taken with margin).
#
# Underflow: a result in the subnormal range of t.dtype is rounded to a fixed grid, with an absolute
# error of up to half its spacing, ETA (2^-25 for fp16: outputs below 6.1e-5), which no relative
# term covers. The bounds below add ETA per rounding (it changes nothing away from that range);
# with N(0, 1) fp16 data about one element in 10^7 needs it.
# ----------------------------------------------------------------------------------------------


def unit_error(dtype: torch.dtype) -> float:
    """U of (*): the largest error of one output element per unit of s_i."""
    return EPS[dtype] + F32_EVAL


def fsum_slack(n: int) -> float:
    return 4.0 * max(n, 1) * 2.0**-53


def _fail(what, bad, got, want, bound):
    idx = tuple(int(i) for i in bad.nonzero()[0])
    raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} values out of bound; first at {idx}: "
                         f"got {got[idx].item()!r}, want {want[idx].item()!r}, bound {bound[idx].item():.3g}")


def assert_agree_within_rounding(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, rot_dim: int,
                                 interleaved: bool, what: str = "outputs"):
    """a and b are two results that must each be within one rounding of the same exact value r.

    |a - b| <= 2 EPS |r| + 2 F32_EVAL s and |r| <= (|a| + F32_EVAL s) / (1 - EPS); for EPS <= 2^-8
    this is within 2.01 (EPS max(|a|, |b|) + F32_EVAL s), plus 2 ETA. Pass-through channels must
    match bitwise.
    """
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    a64, b64 = a.detach().double(), b.detach().double()
    scale = partner_scale(x, rot_dim, interleaved)
    bound = 2.01 * (EPS[a.dtype] * torch.maximum(a64.abs(), b64.abs()) + F32_EVAL * scale) + 2 * ETA[a.dtype]
    bad = ~((a64 - b64).abs() <= bound)
    if bad.any():
        _fail(what, bad, a64, b64, bound)
    assert torch.equal(a[..., rot_dim:], b[..., rot_dim:]), f"{what}: pass-through channels differ"


def assert_adjoint(out, g, x, grad, rot_dim, interleaved, what="adjoint"):
    """<rope(x), g> = <x, rope^T g> exactly for the exact map; by (*) applied to out and to grad,
    |<out, g> - <x, grad>| <= U (sum s_i(x) |g_i| + sum s_i(g) |x_i|) + ETA (sum |g| + sum |x|),
    plus float64 summation."""
    out64, g64, x64, grad64 = (v.detach().double() for v in (out, g, x, grad))
    lhs, rhs = (out64 * g64).sum(), (x64 * grad64).sum()
    u = unit_error(out.dtype)
    bound = u * ((partner_scale(x, rot_dim, interleaved) * g64.abs()).sum()
                 + (partner_scale(g, rot_dim, interleaved) * x64.abs()).sum())
    bound += ETA[out.dtype] * (g64.abs().sum() + x64.abs().sum())
    bound += fsum_slack(out.numel()) * ((out64 * g64).abs().sum() + (x64 * grad64).abs().sum())
    assert (lhs - rhs).abs() <= bound, (
        f"{what}: <rope(x), g> = {lhs.item()!r} but <x, grad> = {rhs.item()!r}; "
        f"difference {(lhs - rhs).abs().item():.3g} > bound {bound.item():.3g}")


def assert_linear(out_z, out_x, out_y, alpha, beta, z, x, y, rot_dim, interleaved, what="linearity"):
    """z = fl(alpha x + beta y) in t's dtype; rho = z - (alpha x + beta y) exactly (float64). Then
    out_z - alpha out_x - beta out_y = (errors of the three calls) + R rho, so by (*) and |R rho|_i <=
    s_i(rho) it is at most U (s(z) + |alpha| s(x) + |beta| s(y)) + s(rho) elementwise, plus
    (1 + |alpha| + |beta|) ETA for underflow."""
    x64, y64, z64 = (v.detach().double() for v in (x, y, z))
    rho = z64 - (alpha * x64 + beta * y64)
    got = out_z.detach().double()
    want = alpha * out_x.detach().double() + beta * out_y.detach().double()
    sc = lambda v: partner_scale(v, rot_dim, interleaved)  # noqa: E731
    # channels past rot_dim are copies: there the difference is exactly rho
    u = unit_error(out_z.dtype)
    bound = u * (sc(z64) + abs(alpha) * sc(x64) + abs(beta) * sc(y64)) + sc(rho)
    bound += (1 + abs(alpha) + abs(beta)) * ETA[out_z.dtype]
    bound[..., rot_dim:] = rho[..., rot_dim:].abs()
    bound += fsum_slack(3) * (got.abs() + want.abs())
    bad = ~((got - want).abs() <= bound)
    if bad.any():
        _fail(what, bad, got, want, bound)
