"""The generic properties, for every convention the target has, in that convention's own signature.

    forward     every output (returned or written in place) within the accuracy model of the convention's
                float64 definition, from the inputs as given; the promised objects returned; nothing else
                written (every buffer, the padding around views, tables, positions: bitwise)
    backward    every promised gradient within the accuracy model of the definition's vector-Jacobian product,
                from random upstream gradients, with the arguments given as views in the graph; the upstream
                gradients left alone
    determinism two identical calls, on inputs built alike, bitwise equal: outputs and gradients (a target that is
                not declares deterministic=false)
A convention the target does not have is skipped; a capability it declares off is not drawn, and the skip
reason of a convention names what is then not certified (spec.domains.declared_off). The convention's own
invariants run as test_invariant[convention-invariant].

Budget (budget.py): the Hypothesis profile in force (conftest.py: cpu-interp, gpu, nightly; HYPOTHESIS_PROFILE) and
ROPE_MAX_EXAMPLES apply to every property here. The CI default (cpu-interp) gives each kind of property its small
count; the gpu profile gives each property of each convention the count at which the convention's planted bugs are
caught under the device's draws. ROPE_MAX_EXAMPLES, where set, gives every property that many; the nightly profile
gives every property its own count.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from . import run, spec
from .budget import CI_PROFILE, CPU_EXAMPLES, OWN_EXAMPLES, PROFILE_EXAMPLES, budget, examples_for
from .spec import domains

CONVENTIONS = spec.available()
INVARIANTS = [(name, inv) for name in CONVENTIONS for inv in spec.load(name).INVARIANTS]


def convention_of(target, name):
    fn = target.fns.get(name)
    if fn is None:
        pytest.skip(f"{target.name} has no {name} call")
    conv = spec.load(name)
    return conv, fn, conv.caps(target.caps.get(name))


def not_certified(conv, caps) -> str:
    """What the capabilities in force leave out of the certification (for skip reasons and reports)."""
    off = domains.declared_off(conv, caps)
    return f"not certified: {'; '.join(off)}" if off else ""


def property_test(kind: str, key: tuple, check):
    """The Hypothesis test of check(data) for property `key` (convention, property) of kind `kind`: as many examples
    as `budget` gives it (a property's count follows its convention, which a decorator on the parametrized test
    could not give it), and its own key in the example database, as Hypothesis' pytest plugin gives each
    parametrized case, so that a failing example is replayed by the property it failed and by no other."""
    @budget(kind, key)
    @given(data=st.data())
    def holds(data):
        check(data)

    holds.hypothesis.inner_test._hypothesis_internal_add_digest = repr((kind, *key)).encode()
    return holds


def for_each_example(kind: str, key: tuple, check) -> None:
    """check(data) on each example Hypothesis draws for property `key` (property_test)."""
    property_test(kind, key, check)()


@pytest.mark.parametrize("name", CONVENTIONS)
def test_forward(target, name):
    conv, fn, caps = convention_of(target, name)
    for_each_example("forward", (name, "forward"),
                     lambda data: run.forward(conv, fn, caps, data.draw(conv.plans(caps), label="plan")))


@pytest.mark.parametrize("name", CONVENTIONS)
def test_backward(target, name):
    conv, fn, caps = convention_of(target, name)
    if not conv.DIFFERENTIABLE or not caps.get("backward", True):
        pytest.skip(f"{name}: no backward in this convention" if not conv.DIFFERENTIABLE else
                    f"{target.name} declares no backward for {name}")
    for_each_example("backward", (name, "backward"),
                     lambda data: run.backward(conv, fn, caps, data.draw(conv.plans(caps), label="plan"),
                                               data.draw(domains.upstreams(caps), label="upstream")))


@pytest.mark.parametrize("name", CONVENTIONS)
def test_determinism(target, name):
    """Two identical calls give bitwise the same outputs and gradients (run.determinism): what an RL trainer and its
    rollout engine need of a kernel called twice on one input. A target declares deterministic=false otherwise."""
    conv, fn, caps = convention_of(target, name)
    if not caps["deterministic"]:
        pytest.skip(f"{target.name} declares {name} not deterministic")

    def check(data):
        upstream = data.draw(domains.upstreams(caps), label="upstream") if conv.DIFFERENTIABLE else "contiguous"
        run.determinism(conv, fn, caps, data.draw(conv.plans(caps), label="plan"), upstream)

    for_each_example("determinism", (name, "determinism"), check)


@pytest.mark.parametrize("name", CONVENTIONS)
def test_schedule(target, schedule, name):
    """With --rope-schedule NAME: the target's outputs bitwise equal to the convention's schedule NAME on every draw
    (run.schedule), beside the accuracy verdict of test_forward, with its count."""
    if schedule is None:
        pytest.skip("no --rope-schedule given")
    conv, fn, caps = convention_of(target, name)
    if schedule not in conv.SCHEDULES:
        pytest.skip(f"{name} has no schedule {schedule!r} (its schedules: {', '.join(conv.SCHEDULES) or 'none'})")
    for_each_example("forward", (name, "forward"),
                     lambda data: run.schedule(conv, fn, caps, data.draw(conv.plans(caps), label="plan"), schedule))


PINNED = [(name, i) for name in CONVENTIONS for i in range(len(spec.load(name).PINS))]


@pytest.mark.parametrize("name,index", PINNED, ids=[f"{n}-{i}" for n, i in PINNED])
def test_pinned(target, name, index):
    """A convention's pinned edge case (spec PINS), forward and (where the convention has one) backward."""
    conv, fn, caps = convention_of(target, name)
    plan = conv.PINS[index]
    why = conv.outside(plan, caps)
    if why:
        pytest.skip(f"{target.name} declares no {why}")
    run.forward(conv, fn, caps, plan)
    if conv.DIFFERENTIABLE and caps.get("backward", True):
        run.backward(conv, fn, caps, plan)


@pytest.mark.parametrize("name,invariant", INVARIANTS, ids=[f"{n}-{i}" for n, i in INVARIANTS])
def test_invariant(target, name, invariant):
    """The convention's invariant on the draws of its plans, with the invariant's own count (`budget`)."""
    conv, fn, caps = convention_of(target, name)
    if invariant == "batch_rows_alone" and not caps["batch_invariant"]:
        pytest.skip(f"{target.name} declares {name} not batch invariant")
    for_each_example("invariant", (name, invariant),
                     lambda data: conv.INVARIANTS[invariant](conv, fn, caps, data.draw(conv.plans(caps), label="plan")))


@pytest.mark.parametrize("name", CONVENTIONS)
def test_declared_domain(target, name):
    """What the target's declared capabilities leave out of its convention's declared domain: a skip that names
    each class not certified (argument: class (capability)), a pass when the whole domain is drawn."""
    conv, _, caps = convention_of(target, name)
    why = not_certified(conv, caps)
    if why:
        pytest.skip(why)


# ---- the budget on itself -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("profile,env,want", [
    (CI_PROFILE, {}, CPU_EXAMPLES),
    (CI_PROFILE, {"ROPE_MAX_EXAMPLES": "200"}, {}),
    ("nightly", {}, {}),
    ("gpu", {}, {"backward": 50, "invariant": 10, "determinism": 20}),
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
    nodes = [f"{Path(__file__).relative_to(root)}::{test}" for test in ("test_forward[hf]",
                                                                       "test_invariant[hf-batch_rows_alone]")]
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
