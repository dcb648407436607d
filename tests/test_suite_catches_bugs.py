"""The suite tested on itself: every deliberately broken implementation in tests/broken_impls.py is
caught by the suite's own predicates, run on the suite's own strategies (and explicit examples).

For each bug, `CAUGHT_BY` names the checks expected to catch it: the float64 reference comparison
where the bug changes values, and independently at least one check that does not use the
reference (an invariant, or a bad-input rule), so the suite does not rest on the oracle alone.
The meta-test asserts each named check fails with an AssertionError (a verdict, not a crash)
within a fixed, derandomized budget of examples.

`python -m tests.test_suite_catches_bugs` prints the full matrix: every check against every bug.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings

from rope import reference

from . import broken_impls
from .cases import DEVICE
from .strategies import LIMITS, build, limits_override, rope_specs
from .test_bad_input import CHECKS as BAD_INPUT_CHECKS
from .test_invariants import CHECKS as INVARIANT_CHECKS
from .test_properties import CHECKS as REFERENCE_CHECKS

ALL_CHECKS = {**REFERENCE_CHECKS, **INVARIANT_CHECKS, **BAD_INPUT_CHECKS}
REF = "matches_reference"

CAUGHT_BY = {
    "grad_read_as_contiguous": [REF, "adjoint", "layout_invariance", "pair_norms_preserved", "linearity"],
    "backward_own_sine": [REF, "adjoint"],
    "forward_drops_pass_through": [REF, "pass_through_bitwise", "adjoint"],
    "backward_drops_pass_through": [REF, "pass_through_bitwise", "adjoint"],
    "interleaved_ignored": [REF, "interleaved_is_permuted_half_split", "pair_norms_preserved", "round_trip"],
    "interleaved_sign_flipped": [REF, "interleaved_is_permuted_half_split"],
    "backward_ignores_start_positions": [REF, "adjoint", "sequences_independent", "round_trip"],
    "cp_chunks_swapped": [REF, "cp_shards_reassemble", "sequences_independent", "position_zero_is_identity"],
    "thd_positions_not_restarting": [REF, "formats_agree", "sequences_independent", "cp_shards_reassemble",
                                     "position_zero_is_identity", "relative_position"],
    "cos_sin_rounded_to_t_dtype": [REF],
    "angles_rounded_to_bf16": [REF, "relative_position"],
    "overwrites_input": ["input_not_modified"],
    "reads_one_angle_per_pair": [REF],
    "positions_off_by_one": [REF, "position_zero_is_identity", "relative_position"],
    "thd_start_positions_skip_empty_sequences": [REF, "sequences_independent"],
    "clamps_positions_past_freqs": ["bad_input: freqs too short", "bad_input: start_positions past the end of freqs"],
    "math_in_t_dtype": [REF, "pair_norms_preserved", "round_trip", "adjoint", "relative_position"],
    "rounds_toward_zero": [REF, "pair_norms_preserved"],
    "returns_float32": [REF],
    "reads_input_as_contiguous": [REF, "layout_invariance"],
}

# Examples per (bug, check): enough that every expected catch happens; derandomized, so fixed.
BUDGET = 60


def falsify(check_name, impl, max_examples=BUDGET):
    """Run one of the suite's checks on `impl` as the suite does; return the failure, or None."""
    check, strategy, pins = ALL_CHECKS[check_name]

    def run(spec):
        check(impl, spec)

    run._hypothesis_internal_add_digest = check_name.encode()  # a derandomized seed per check
    for pin in reversed(pins):
        run = example(spec=pin)(run)
    run = settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                   phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False,
                   suppress_health_check=list(HealthCheck))(given(spec=strategy)(run))
    try:
        with limits_override(LIMITS["cpu-interp"]):  # small shapes in every profile: a fixed, quick test
            run()
    except Exception as e:  # noqa: BLE001 - the caller decides what kind of failure counts
        return e
    return None


def test_catalogue_is_complete():
    assert set(CAUGHT_BY) == set(broken_impls.BROKEN)
    for checks in CAUGHT_BY.values():
        assert set(checks) <= set(ALL_CHECKS), set(checks) - set(ALL_CHECKS)


def test_perturbed_reference_without_hooks_is_the_reference():
    """The broken implementations differ from the reference by their one bug only."""

    @settings(max_examples=max(1, settings.default.max_examples), deadline=None)
    @given(spec=rope_specs())
    def same(spec):
        case = build(spec)
        kw = case.kwargs()
        x1 = case.t.detach().clone().requires_grad_()
        x2 = case.t.detach().clone().requires_grad_()
        a = reference.apply_rotary_pos_emb(x1, case.freqs, **kw)
        b = broken_impls.perturbed(x2, case.freqs, **kw)
        assert torch.equal(a, b)
        (ga,) = torch.autograd.grad(a, x1, case.g)
        (gb,) = torch.autograd.grad(b, x2, case.g)
        assert torch.equal(ga, gb)
        full = dict(start_positions=None, interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0)
        full.update(kw)
        assert torch.equal(broken_impls.adjoint(case.g, case.freqs, full), ga.to(case.g.dtype))

    with limits_override(LIMITS["cpu-interp"]):
        same()


@pytest.mark.parametrize("bug,check", [(b, c) for b, checks in CAUGHT_BY.items() for c in checks],
                         ids=[f"{b}-by-{c}" for b, checks in CAUGHT_BY.items() for c in checks])
def test_suite_catches_bug(bug, check):
    failure = falsify(check, broken_impls.BROKEN[bug])
    assert failure is not None, f"check {check!r} did not catch {bug!r} in {BUDGET} examples"
    assert isinstance(failure, AssertionError), (
        f"check {check!r} failed on {bug!r} with {type(failure).__name__} instead of a verdict: {failure}")


def test_reference_passes_every_check():
    """Control: the reference itself passes all the checks the bugs fail (so they fail for the bug)."""
    for name in ALL_CHECKS:
        failure = falsify(name, reference.apply_rotary_pos_emb, max_examples=10)
        assert failure is None, f"{name}: the reference fails: {failure!r}"


def matrix(max_examples=BUDGET):
    """{bug: {check: failure type name or ''}} for every bug and check."""
    return {bug: {name: type(e).__name__ if (e := falsify(name, impl, max_examples)) is not None else ""
                  for name in ALL_CHECKS}
            for bug, impl in broken_impls.BROKEN.items()}


if __name__ == "__main__":
    import conftest  # noqa: F401 - the interpreter switch and the Hypothesis profiles

    print(f"device {DEVICE}; '#' = caught with an AssertionError, 'E' = fails with another error")
    names = list(ALL_CHECKS)
    for i, n in enumerate(names):
        print(f"  c{i:02d} {n}")
    print(" " * 42 + " ".join(f"{i:02d}" for i in range(len(names))))
    for bug, row in matrix().items():
        marks = ["# " if row[n] == "AssertionError" else ("E " if row[n] else ". ") for n in names]
        caught = [n for n in names if row[n] == "AssertionError"]
        print(f"{bug:41s} " + " ".join(m.strip().ljust(2) for m in marks) + f"  ({len(caught)})")
