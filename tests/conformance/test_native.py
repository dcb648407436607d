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

import pytest
from hypothesis import given
from hypothesis import strategies as st

from . import run, spec
from .budget import budget
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
