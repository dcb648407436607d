"""The stress run (stress.py) on a few calls: every call of a correct implementation passes, and a planted bug is
counted as wrong, not lost in a thread."""
from __future__ import annotations

from .stress import stress


def test_correct_calls_pass_on_threads():
    report = stress("hf:tests.conformance.zoo.hf:correct", calls=8, threads=2)
    assert report["per_convention"] == {"hf": {"ok": 8}}, report


def test_a_planted_bug_is_counted_wrong():
    report = stress("hf:tests.conformance.zoo.hf:k_rotates_q", calls=8, threads=2)
    assert report["per_convention"]["hf"].get("wrong", 0) > 0, report
