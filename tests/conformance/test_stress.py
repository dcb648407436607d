"""The stress run (stress.py) on a few calls: every call of a correct implementation passes, and a planted bug is
counted as wrong, not lost in a thread."""
from __future__ import annotations

import json

from .stress import main, stress


def test_correct_calls_pass_on_threads():
    report = stress("hf:tests.conformance.zoo.hf:correct", calls=8, threads=2)
    assert report["per_convention"] == {"hf": {"ok": 8}}, report


def test_a_planted_bug_is_counted_wrong():
    report = stress("hf:tests.conformance.zoo.hf:k_rotates_q", calls=8, threads=2)
    assert report["per_convention"]["hf"].get("wrong", 0) > 0, report


def test_processes_report_their_sum(tmp_path):
    # Two processes, each half the calls of its own seed: the sum reaches the report, and so does a wrong call.
    out = tmp_path / "report.json"
    status = main(["--impl", "hf:tests.conformance.zoo.hf:k_rotates_q", "--calls", "6", "--threads", "1",
                   "--processes", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert status == 1 and report["calls"] == 6 and report["processes"] == 2, report
    assert report["per_convention"]["hf"].get("wrong", 0) > 0, report
