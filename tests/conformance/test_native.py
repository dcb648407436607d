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

Budget: the Hypothesis profile in force (conftest.py: cpu-interp, gpu, nightly; HYPOTHESIS_PROFILE) and
ROPE_MAX_EXAMPLES apply to every property here. Two profiles give each kind of property its own count
(PROFILE_EXAMPLES): the CI default (cpu-interp) its small counts, and the gpu profile the counts at which the zoo's
planted bugs are caught under the device's draws. ROPE_MAX_EXAMPLES, where set, gives every property that many; the
nightly profile gives every property its own count.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import run, spec
from .spec import domains

CONVENTIONS = spec.available()
# Examples per property in the CI default (Triton's interpreter runs every kernel program after another): enough to
# draw every declared class of a convention over its properties together (test_domains.py proves it); the GPU
# profile (realistic shapes) and the nightly one are the certification.
CPU_EXAMPLES = {"forward": 10, "backward": 6, "invariant": 4, "determinism": 3}
CI_PROFILE = "cpu-interp"
# The gpu profile: forward takes the profile's 100, backward 50, an invariant 20, determinism 20. On a device the run
# is bound by Triton's compiles (most examples are a new specialization). The zoo's planted bugs, under the device's
# draws, show what each count catches (test_zoo.catch_budget gives a bug the count of its property): at 50 every
# backward and determinism bug is caught, two forward bugs are not (flash's offsets, mRoPE's pairing), at 100 every
# one. An invariant calls the target two to four times per example (the call and the calls it is compared with), so
# it takes the count its own bugs need: of the 35 planted bugs that only invariants catch, 32 were caught by example
# 15 on each of 10 random seeds' device draws (most by example 6: a bad input, a batch's math); the other three get
# 1.5 x their worst seed (INVARIANT_EXAMPLES; docs/conformance.md, "The budget"). Determinism calls it twice on
# inputs built alike: its bugs (a reduction whose order changes, a buffer read before it is written) show on any
# shape, so 20 draws suffice for what the zoo plants.
PROFILE_EXAMPLES = {CI_PROFILE: CPU_EXAMPLES, "gpu": {"backward": 50, "invariant": 20, "determinism": 20}}
# Invariants whose own count in a profile differs from the profile's "invariant": (convention, invariant) -> examples.
# Worst seed of 10: te's layouts_agree 26 (output_keeps_input_strides), hf-single's heads_together 43
# (many_heads_round_otherwise), hf-deepseek-v3's batch_rows_alone 19 (math_depends_on_batch).
INVARIANT_EXAMPLES = {"gpu": {("te", "layouts_agree"): 40, ("hf-single", "heads_together"): 70,
                              ("hf-deepseek-v3", "batch_rows_alone"): 30}}
INVARIANTS = [(name, inv) for name in CONVENTIONS for inv in spec.load(name).INVARIANTS]


def current_profile() -> str:
    get = getattr(settings, "get_current_profile_name", None)
    return get() if get else getattr(settings, "_current_profile", "default")


def examples_for(prop: str, profile: str, env, invariant: tuple | None = None) -> int | None:
    """The examples property `prop` runs: for an invariant (convention, name) its own count in the profile
    (INVARIANT_EXAMPLES), else the profile's count for `prop` (PROFILE_EXAMPLES), else None (the profile's own
    count); ROPE_MAX_EXAMPLES, where set, gives None (conftest.py registers it into the profile)."""
    if env.get("ROPE_MAX_EXAMPLES"):
        return None
    own = INVARIANT_EXAMPLES.get(profile, {}).get(invariant)
    return own if own is not None else PROFILE_EXAMPLES.get(profile, {}).get(prop)


def budget(prop: str, invariant: tuple | None = None):
    n = examples_for(prop, current_profile(), os.environ, invariant)
    return settings(max_examples=n) if n is not None else (lambda test: test)


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


@pytest.mark.parametrize("name", CONVENTIONS)
@budget("forward")
@given(data=st.data())
def test_forward(target, name, data):
    conv, fn, caps = convention_of(target, name)
    run.forward(conv, fn, caps, data.draw(conv.plans(caps), label="plan"))


@pytest.mark.parametrize("name", CONVENTIONS)
@budget("backward")
@given(data=st.data())
def test_backward(target, name, data):
    conv, fn, caps = convention_of(target, name)
    if not conv.DIFFERENTIABLE or not caps.get("backward", True):
        pytest.skip(f"{name}: no backward in this convention" if not conv.DIFFERENTIABLE else
                    f"{target.name} declares no backward for {name}")
    run.backward(conv, fn, caps, data.draw(conv.plans(caps), label="plan"),
                 data.draw(domains.upstreams(caps), label="upstream"))


@pytest.mark.parametrize("name", CONVENTIONS)
@budget("determinism")
@given(data=st.data())
def test_determinism(target, name, data):
    """Two identical calls give bitwise the same outputs and gradients (run.determinism): what an RL trainer and its
    rollout engine need of a kernel called twice on one input. A target declares deterministic=false otherwise."""
    conv, fn, caps = convention_of(target, name)
    if not caps["deterministic"]:
        pytest.skip(f"{target.name} declares {name} not deterministic")
    upstream = data.draw(domains.upstreams(caps), label="upstream") if conv.DIFFERENTIABLE else "contiguous"
    run.determinism(conv, fn, caps, data.draw(conv.plans(caps), label="plan"), upstream)


@pytest.mark.parametrize("name", CONVENTIONS)
@budget("forward")
@given(data=st.data())
def test_schedule(target, schedule, name, data):
    """With --rope-schedule NAME: the target's outputs bitwise equal to the convention's schedule NAME on every draw
    (run.schedule), beside the accuracy verdict of test_forward."""
    if schedule is None:
        pytest.skip("no --rope-schedule given")
    conv, fn, caps = convention_of(target, name)
    if schedule not in conv.SCHEDULES:
        pytest.skip(f"{name} has no schedule {schedule!r} (its schedules: {', '.join(conv.SCHEDULES) or 'none'})")
    run.schedule(conv, fn, caps, data.draw(conv.plans(caps), label="plan"), schedule)


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

    @budget("invariant", (name, invariant))
    @given(data=st.data())
    def holds(data):
        conv.INVARIANTS[invariant](conv, fn, caps, data.draw(conv.plans(caps), label="plan"))

    holds()


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
    ("gpu", {}, {"backward": 50, "invariant": 20, "determinism": 20}),
    ("gpu", {"ROPE_MAX_EXAMPLES": "200"}, {}),
    ("nightly", {"ROPE_MAX_EXAMPLES": "7"}, {}),
])
def test_budget_follows_the_run(profile, env, want):
    """The per-property counts of the CI default and of the gpu profile; otherwise, and wherever ROPE_MAX_EXAMPLES
    is set, the profile's own count (with ROPE_MAX_EXAMPLES registered into it by conftest.py)."""
    for prop in CPU_EXAMPLES:
        assert examples_for(prop, profile, env) == want.get(prop), (prop, profile, env)


def test_an_invariant_takes_its_own_count():
    """An invariant named in INVARIANT_EXAMPLES takes its own count in its profile, the others the profile's; under
    ROPE_MAX_EXAMPLES every one takes that."""
    (profile, counts), = INVARIANT_EXAMPLES.items()
    for key, n in counts.items():
        assert examples_for("invariant", profile, {}, key) == n != PROFILE_EXAMPLES[profile]["invariant"]
        assert examples_for("invariant", profile, {"ROPE_MAX_EXAMPLES": "7"}, key) is None
        assert examples_for("invariant", CI_PROFILE, {}, key) == CPU_EXAMPLES["invariant"]
    other = next(key for key in INVARIANTS if key not in counts)
    assert examples_for("invariant", profile, {}, other) == PROFILE_EXAMPLES[profile]["invariant"]


def test_rope_max_examples_reaches_a_property():
    """As a user runs it: ROPE_MAX_EXAMPLES=N gives a native property N examples, here under the nightly profile
    (one pytest process on a pure-PyTorch target: a few seconds; test_budget_follows_the_run covers the rest)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    node = f"{Path(__file__).relative_to(root)}::test_forward[hf]"
    base = {k: v for k, v in os.environ.items() if k not in ("ROPE_MAX_EXAMPLES", "HYPOTHESIS_PROFILE")}
    for env, want in [({"HYPOTHESIS_PROFILE": "nightly", "ROPE_MAX_EXAMPLES": "3"}, 3)]:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", node, "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
             "--hypothesis-show-statistics", "--hypothesis-seed=0", "--rope-impl=hf:tests.conformance.zoo.hf:correct"],
            cwd=root, env={**base, **env}, capture_output=True, text=True, timeout=300)
        generated = re.search(r"during generate phase.*?(\d+) passing", done.stdout, re.S)
        assert done.returncode == 0 and generated, f"{env}: the run failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        assert int(generated.group(1)) == want, f"{env}: {generated.group(1)} examples generated, expected {want}"
