"""The budget (budget.py) on itself: the counts each profile gives each property, each property's own example
database key, and ROPE_MAX_EXAMPLES reaching a property as a user runs it. Apart from test_native.py, so that a
certifying run of that file (`pytest --rope-impl ... tests/conformance/test_native.py`) runs the target's
properties only."""
from __future__ import annotations

import os

import pytest

from .budget import CI_PROFILE, CPU_EXAMPLES, OWN_EXAMPLES, PROFILE_EXAMPLES, examples_for
from .test_native import CONVENTIONS, INVARIANTS, property_test


@pytest.mark.parametrize("profile,env,want", [
    (CI_PROFILE, {}, CPU_EXAMPLES),
    (CI_PROFILE, {"ROPE_MAX_EXAMPLES": "200"}, {}),
    ("nightly", {}, {}),
    ("gpu", {}, {"backward": 50, "invariant": 10, "determinism": 10}),
    ("gpu", {"ROPE_MAX_EXAMPLES": "200"}, {}),
    ("nightly", {"ROPE_MAX_EXAMPLES": "7"}, {}),
])
def test_budget_follows_the_run(profile, env, want):
    """The per-property counts of the CI default and of the gpu profile; otherwise, and wherever ROPE_MAX_EXAMPLES
    is set, the profile's own count (with ROPE_MAX_EXAMPLES registered into it by conftest.py)."""
    for prop in CPU_EXAMPLES:
        assert examples_for(prop, profile, env) == want.get(prop), (prop, profile, env)


def kind_of(prop: str) -> str:
    """The kind of property `prop` names: forward, backward, determinism, or an invariant's name: invariant."""
    return prop if prop in ("forward", "backward", "determinism") else "invariant"


def test_a_property_takes_its_own_count():
    """A (convention, property) named in OWN_EXAMPLES takes its own count in its profile, the others their kind's;
    under ROPE_MAX_EXAMPLES every one takes that; the CI default knows no own counts."""
    (profile, counts), = OWN_EXAMPLES.items()
    for key, n in counts.items():
        kind = kind_of(key[1])
        assert key[0] in CONVENTIONS and (kind != "invariant" or key in INVARIANTS), key
        assert examples_for(kind, profile, {}, key) == n, key
        assert examples_for(kind, profile, {"ROPE_MAX_EXAMPLES": "7"}, key) is None
        assert examples_for(kind, CI_PROFILE, {}, key) == CPU_EXAMPLES[kind]
    other = next(key for key in INVARIANTS if key not in counts)
    assert examples_for("invariant", profile, {}, other) == PROFILE_EXAMPLES[profile]["invariant"]


def test_each_property_has_its_own_database_key():
    """Where Hypothesis saves a property's failing example (and replays it first on the next run): one key per
    (convention, property), so that no other property replays it."""
    from hypothesis.internal.reflection import function_digest

    keys = [("hf", "forward"), ("vllm", "forward"), ("hf", "backward"), ("hf", "batch_rows_alone")]
    digests = {function_digest(property_test(kind_of(k[1]), k, lambda data: None).hypothesis.inner_test) for k in keys}
    assert len(digests) == len(keys)


def test_rope_max_examples_reaches_a_property(tmp_path):
    """As a user runs it: ROPE_MAX_EXAMPLES=N gives a native property N examples, here under the nightly profile
    (one pytest process on a pure-PyTorch target: a few seconds; test_budget_follows_the_run covers the rest): a
    forward property and an invariant, each example's plan printed by Hypothesis's verbose output and counted (an
    empty example database, so that none is replayed)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    native = Path(__file__).with_name("test_native.py").relative_to(root)
    nodes = [f"{native}::{test}" for test in ("test_forward[hf]", "test_invariant[hf-batch_rows_alone]")]
    base = {k: v for k, v in os.environ.items() if k not in ("ROPE_MAX_EXAMPLES", "HYPOTHESIS_PROFILE")}
    env = {"HYPOTHESIS_PROFILE": "nightly", "ROPE_MAX_EXAMPLES": "3", "HYPOTHESIS_STORAGE_DIRECTORY": str(tmp_path)}
    for node in nodes:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", node, "-q", "-s", "-p", "no:xdist", "-p", "no:cacheprovider",
             "--hypothesis-verbosity=verbose", "--hypothesis-seed=0",
             "--rope-impl=hf:tests.conformance.zoo.hf:correct"],
            cwd=root, env={**base, **env}, capture_output=True, text=True, timeout=300)
        plans = [line for line in done.stdout.splitlines() if line.startswith("Draw 1 (plan):")]
        assert done.returncode == 0, f"{node}: the run failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        assert len(plans) == 3, f"{node}: {len(plans)} examples run, expected 3:\n{done.stdout[-2000:]}"
