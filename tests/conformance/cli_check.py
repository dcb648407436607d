"""`pytest --rope-impl CONVENTION:module:callable` as a user runs it, for many targets in one process (the
interpreter and torch start once): `python -m tests.conformance.cli_check CONVENTION:module:callable ...` prints one
JSON line per target with pytest's exit status and the counts of passed and failed tests.

The forward property of the target's own convention runs (test_native.py::test_forward[CONVENTION]), each target
in a pytest session of its own, with its own configuration and options.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


class Outcomes:
    def __init__(self):
        self.counts = {"passed": 0, "failed": 0, "skipped": 0}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.counts[report.outcome] = self.counts.get(report.outcome, 0) + 1


def run(target: str) -> dict:
    parts = target.split(":")
    convention = parts[0] if len(parts) == 3 else "te"  # module:callable is TransformerEngine's convention
    node = f"{Path(__file__).relative_to(ROOT).parent}/test_native.py::test_forward[{convention}]"
    outcomes = Outcomes()
    status = pytest.main(["-q", "-n", "0", "-p", "no:cacheprovider", f"--rope-impl={target}", node],
                         plugins=[outcomes])
    return {"target": target, "status": int(status), **outcomes.counts}


if __name__ == "__main__":
    results = [run(target) for target in sys.argv[1:]]
    print("RESULTS " + json.dumps(results))
