"""rope's TransformerEngine-convention call against the float64 reference, on drawn structure, with every output
element poisoned first.

Every drawn call (format, sizes, rotary width, dtype, mode, start positions or context
parallelism, packed sequences with empty and one-token ones, longer-than-needed angles, memory
layouts of the input and of the upstream gradient, long-context angles, values near the dtype's
maximum) is run forward and backward with random angles (the two halves differ: the contract is
elementwise) and a random upstream gradient, with the launcher's outputs starting as NaN, and every
element must lie within one rounding of the dtype against the float64 reference (tests/rope/numerics.py).
"""
from __future__ import annotations

import math

import torch
from hypothesis import example, given
from hypothesis import target as hypothesis_target
from hypothesis.control import currently_in_test_context

import rope
import rope._launch

from .cases import reference64, run_case
from .numerics import assert_within_rounding, error_bound, partner_scale
from .strategies import build, make_spec, rope_specs

# Edges every profile runs first (docs/contract.md sections 2-4).
PINS = [
    make_spec("sbhd", torch.float32, s=3, b=2, h=2, d=8, rot_dim=2, seed=1),  # d2 = 2: one pair
    make_spec("bshd", torch.bfloat16, s=1, b=3, h=2, d=16, max_start=5, seed=2),  # s = 1
    make_spec("sbhd", torch.float16, s=4, b=1, h=3, d=20, rot_dim=6, interleaved=True, seed=3),  # d2 < d
    make_spec("sbhd", torch.bfloat16, s=2, b=1, h=17, d=80, rot_dim=64, seed=4),  # h = 17, d = 80
    make_spec("bshd", torch.float32, s=3, b=2, h=1, d=96, interleaved=True, seed=5),  # h = 1, d = 96
    make_spec("thd", torch.float32, h=2, d=16, rot_dim=8, seqlens=(3, 0, 1, 4), max_start=3, seed=6),  # empty, 1
    make_spec("thd", torch.bfloat16, h=2, d=12, seqlens=(0, 4, 8, 0), cp_size=2, cp_rank=1, seed=7),  # cp, empty
    make_spec("sbhd", torch.float32, s=5, b=2, h=2, d=16, angle_log2=17, seed=8),  # angles to 1.3e5 rad
    make_spec("thd", torch.bfloat16, h=3, d=32, seqlens=(5, 2), angle_log2=17, interleaved=True, seed=9),
    make_spec("sbhd", torch.float16, s=3, b=2, h=2, d=16, values="near_max", seed=10),  # |x| to 32752
    make_spec("bshd", torch.float16, s=4, b=2, h=3, d=16, rot_dim=8, grad_layout="expanded", seed=11),
    make_spec("thd", torch.float32, h=2, d=16, seqlens=(2, 3), layout="sliced", grad_layout="expanded",
              interleaved=True, seed=12),
    make_spec("sbhd", torch.bfloat16, s=4, b=2, h=2, d=10, rot_dim=4, cp_size=2, cp_rank=0, extra_freqs=3,
              layout="transposed", grad_layout="strided_last", seed=13),
    # start_positions with context parallelism: p = cp_position(j) + start (TE's unfused path)
    make_spec("sbhd", torch.float32, s=4, b=3, h=2, d=16, cp_size=2, cp_rank=1, max_start=5, seed=14),
    make_spec("bshd", torch.bfloat16, s=6, b=2, h=3, d=16, rot_dim=8, cp_size=3, cp_rank=2, max_start=7,
              interleaved=True, seed=15),
    make_spec("thd", torch.float32, h=2, d=16, seqlens=(8, 0, 4, 12), cp_size=2, cp_rank=0, max_start=4, seed=16),
]


def observe(name: str, err_over_bound: float):
    """Feed the worst error/bound ratio to Hypothesis' targeting (nightly hunts the worst case)."""
    if currently_in_test_context() and math.isfinite(err_over_bound):
        hypothesis_target(err_over_bound, label=name)


def worst_ratio(got, ref64, x, rot_dim, interleaved) -> float:
    if got.numel() == 0:
        return 0.0
    bound = error_bound(ref64, partner_scale(x, rot_dim, interleaved), got.dtype)
    err = (got.detach().double() - ref64).abs()
    return (err / bound.clamp_min(torch.finfo(torch.float64).tiny)).max().item()


def check_output_contract(out, t):
    """docs/contract.md section 2: a new contiguous tensor of t's shape and dtype."""
    assert isinstance(out, torch.Tensor), f"output: expected a tensor, got {type(out).__name__}"
    assert out.shape == t.shape, f"output: shape {tuple(out.shape)}, expected {tuple(t.shape)}"
    assert out.dtype == t.dtype, f"output: dtype {out.dtype}, expected t's {t.dtype}"
    assert out.device == t.device, f"output: device {out.device}, expected t's {t.device}"
    assert out.is_contiguous(), f"output: not contiguous (strides {out.stride()})"
    if out.numel() and t.numel():
        assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), "output: aliases t"


def check_matches_reference(impl, spec):
    """Forward and backward within one rounding of the float64 reference; the output contract."""
    case = build(spec)
    kw = case.kwargs()
    out, grad = run_case(impl, case)
    ref, ref_grad = reference64(case.t, case.freqs, case.g, **kw)
    check_output_contract(out, case.t)
    assert grad.shape == case.t.shape and grad.dtype == case.t.dtype, "grad: wrong shape or dtype"
    observe("forward error / bound", worst_ratio(out, ref, case.t, case.rot_dim, spec.interleaved))
    observe("backward error / bound", worst_ratio(grad, ref_grad, case.g, case.rot_dim, spec.interleaved))
    assert_within_rounding(out, ref, case.t, case.rot_dim, spec.interleaved, "forward")
    assert_within_rounding(grad, ref_grad, case.g, case.rot_dim, spec.interleaved, "backward")


def _with_pins(test):
    for pin in reversed(PINS):
        test = example(spec=pin)(test)
    return test


# The profile's count: the native suite certifies this call too (its `te` convention, 120 forward examples on a GPU).
@given(spec=rope_specs())
@_with_pins
def test_matches_float64_reference(spec):
    """Forward and backward within one rounding of the float64 reference, with outputs starting as NaN (the
    launcher's allocator is replaced): an unwritten element cannot pass."""
    with rope._launch.nan_outputs():
        check_matches_reference(rope.apply_rotary_pos_emb, spec)
