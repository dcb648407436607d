"""Tests of the oracle itself: `rope.reference` in float64 against docs/contract.md section 3 written out
independently (a loop over tokens applying an explicit 2x2 matrix per channel pair, and complex
multiplication for rotation angles), and its backward against `torch.autograd.gradcheck`.

If the reference were wrong, every comparison against it would be meaningless; these tests share
no code with it (positions, partners and signs are recomputed here from the text of the spec).
"""
from __future__ import annotations

import torch
from hypothesis import given

from rope import reference

from .cases import reference64
from .numerics import EPS, assert_within_rounding, partner_scale
from .strategies import LIMITS, build, make_spec, rope_specs, scaled_examples

# The explicit oracle loops over tokens and pairs in Python: CPU-sized shapes in every profile.
SMALL = LIMITS["cpu-interp"]


def _tokens(spec):
    """(index into t, sequence q, index j in its sequence, local length L) for every token."""
    if spec.tensor_format == "thd":
        local = [n // spec.cp_size for n in spec.seqlens]
        offset = 0
        for q, length in enumerate(local):
            for j in range(length):
                yield (offset + j,), q, j, length
            offset += length
    else:
        for si in range(spec.s):
            for bi in range(spec.b):
                yield ((si, bi) if spec.tensor_format == "sbhd" else (bi, si)), bi, si, spec.s


def _position(spec, case, q, j, length):
    """docs/contract.md section 3, word for word."""
    p = j
    if spec.cp_size > 1:
        c = length // 2
        if j < c:
            p = j + spec.cp_rank * c
        else:
            p = (j - c) + (2 * spec.cp_size - 1 - spec.cp_rank) * c
    if case.start_positions is not None:
        p += int(case.start_positions[q])
    return p


def _pairs(d2, interleaved):
    """(first, second) channel of every pair: the first has sigma = -1, its partner sigma = +1."""
    if interleaved:
        return [(2 * k, 2 * k + 1) for k in range(d2 // 2)]
    return [(k, k + d2 // 2) for k in range(d2 // 2)]


def explicit_2x2(case, backward=False):
    """out_p = M x_p per pair with M = [[cos fa, -sin fa], [sin fb, cos fb]]; the backward is M^T g."""
    spec = case.spec
    x = (case.g if backward else case.t).detach().double().cpu()
    freqs = case.freqs.detach().double().cpu()
    out = x.clone()
    for idx, q, j, length in _tokens(spec):
        f = freqs[_position(spec, case, q, j, length), 0, 0]
        for a, b in _pairs(case.rot_dim, spec.interleaved):
            ca, sa, cb, sb = torch.cos(f[a]), torch.sin(f[a]), torch.cos(f[b]), torch.sin(f[b])
            m = torch.stack([torch.stack([ca, -sa]), torch.stack([sb, cb])])
            if backward:
                m = m.T
            xa, xb = x[idx][..., a], x[idx][..., b]  # over heads
            out[idx + (slice(None), a)] = m[0, 0] * xa + m[0, 1] * xb
            out[idx + (slice(None), b)] = m[1, 0] * xa + m[1, 1] * xb
    return out


def explicit_complex(case):
    """Rotation angles: each pair (x_a, x_b) is the complex number x_a + i x_b times e^{i theta}."""
    spec = case.spec
    x = case.t.detach().double().cpu()
    freqs = case.freqs.detach().double().cpu()
    out = x.clone()
    pairs = _pairs(case.rot_dim, spec.interleaved)
    first = [a for a, _ in pairs]
    second = [b for _, b in pairs]
    for idx, q, j, length in _tokens(spec):
        theta = freqs[_position(spec, case, q, j, length), 0, 0, first]
        z = torch.complex(x[idx][..., first], x[idx][..., second]) * torch.polar(torch.ones_like(theta), theta)
        out[idx + (slice(None), first)] = z.real
        out[idx + (slice(None), second)] = z.imag
    return out


def _assert_close64(got, want, x, rot_dim, interleaved, what):
    """float64 evaluations of the same formula: a few units of 2^-52 of the pair's magnitude."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    bound = 64 * EPS[torch.float64] * partner_scale(x.detach().cpu(), rot_dim, interleaved)
    err = (got - want).abs()
    assert (err <= bound).all(), f"{what}: max error {err.max().item():.3g}"
    assert torch.equal(got[..., rot_dim:], want[..., rot_dim:]), f"{what}: pass-through channels differ"


# The reference is pure PyTorch and fast; the explicit loops are Python, so shapes stay small.
@scaled_examples(2)
@given(spec=rope_specs(lim=SMALL))
def test_reference_matches_explicit_2x2_rotation(spec):
    case = build(spec)
    ref, ref_grad = reference64(case.t, case.freqs, case.g, **case.kwargs())
    _assert_close64(ref, explicit_2x2(case), case.t, case.rot_dim, spec.interleaved, "forward")
    _assert_close64(ref_grad, explicit_2x2(case, backward=True), case.g, case.rot_dim, spec.interleaved,
                    "backward")


@scaled_examples(2)
@given(spec=rope_specs(rotation=True, lim=SMALL))
def test_reference_matches_complex_multiplication(spec):
    case = build(spec)
    ref, _ = reference64(case.t, case.freqs, case.g, **case.kwargs())
    _assert_close64(ref, explicit_complex(case), case.t, case.rot_dim, spec.interleaved, "forward")


@scaled_examples(0.5)
@given(spec=rope_specs(layouts=("contiguous", "transposed"), values=("normal",), lim=SMALL))
def test_reference_gradcheck(spec):
    """Finite differences agree with the reference's backward (it is linear in t, so exactly)."""
    case = build(spec)
    t64 = case.t.detach().double().requires_grad_()
    kw = case.kwargs()
    assert torch.autograd.gradcheck(lambda x: reference.apply_rotary_pos_emb(x, case.freqs, **kw), (t64,),
                                    eps=1e-6, atol=1e-7, rtol=1e-6, fast_mode=t64.numel() > 512)


def test_explicit_oracle_is_sensitive():
    """The explicit oracle is not vacuous: swapping the pairing changes its result."""
    spec = make_spec("sbhd", torch.float32, s=3, b=2, h=2, d=8, seed=3)
    a = explicit_2x2(build(spec))
    b = explicit_2x2(build(make_spec("sbhd", torch.float32, s=3, b=2, h=2, d=8, seed=3, interleaved=True)))
    assert not torch.allclose(a, b)


@scaled_examples(2)
@given(spec=rope_specs(values=("normal",), lim=SMALL))
def test_accuracy_rule_accepts_one_rounding_and_rejects_more(spec):
    """The rule in tests/rope/numerics.py is neither vacuous nor loose: the float64 result rounded once
    to the dtype passes, and a larger error fails where a term does not cancel (|ref| >= 1/4 of
    the pair's magnitude s): two units in the last place for bf16 (its eps, 2^-8, is one unit of
    roundoff), three for fp16 (its eps, 2^-10, is two units of roundoff, so two ulps may pass at
    the top of a binade), and for fp32, whose bound is dominated by the float32-evaluation term
    2^-20 s, an error of 2^-18 s."""
    case = build(spec)
    ref, _ = reference64(case.t, case.freqs, case.g, **case.kwargs())
    rounded = ref.to(spec.dtype)
    assert_within_rounding(rounded, ref, case.t, case.rot_dim, spec.interleaved, "float64 rounded once")
    scale = partner_scale(case.t, case.rot_dim, spec.interleaved)
    candidates = ((ref.abs() >= scale / 4) & (scale > 0)).nonzero()
    if len(candidates) == 0:
        return
    idx = tuple(candidates[0].tolist())
    bad = rounded.clone()
    v = bad[idx]
    if spec.dtype == torch.float32:
        v = (v.double() + torch.sign(v.double()) * 2.0**-18 * scale[idx]).to(spec.dtype)
    else:
        for _ in range(3 if spec.dtype == torch.float16 else 2):
            v = torch.nextafter(v, v * 2)
    bad[idx] = v
    try:
        assert_within_rounding(bad, ref, case.t, case.rot_dim, spec.interleaved, "too far off")
    except AssertionError:
        return
    raise AssertionError(f"an error of {(bad[idx].double() - ref[idx]).item():.3g} at {idx} passed the rule")
