"""The suite on its own strategies: every class of every argument a convention declares (spec/<name>.py DOMAIN,
spec/domains.py) is drawn within the CPU budget, that is, in as many plans as the CI run of test_native.py draws
of the convention (its forward, backward and invariant properties together). Plans only: no kernel is called.

A class no strategy draws is a class of bugs the suite can never see; this test names it.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from . import spec
from .budget import current_profile, examples_for
from .draws import no_local_constants
from .spec import domains

CONVENTIONS = spec.available()


def run_budget(conv) -> int:
    """The plans test_native.py draws of `conv` in this run, its forward, backward (where the convention has one)
    and invariant properties together: the CPU counts in the CI default (cpu-interp profile), else the profile's
    count (ROPE_MAX_EXAMPLES included) for each. On a device the strategies draw device-sized plans, so the proof
    is for the draws this run makes."""
    def examples(prop, name=None):
        n = examples_for(prop, current_profile(), os.environ, (conv.NAME, name or prop))
        return settings.default.max_examples if n is None else n

    return (examples("forward") + (examples("backward") if conv.DIFFERENTIABLE else 0)
            + sum(examples("invariant", inv) for inv in conv.INVARIANTS))


def drawn_classes(conv, caps, examples: int) -> dict:
    """{argument: {class names drawn}} over `examples` derandomized plans (and upstream gradient layouts)."""
    seen: dict = {}

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(plan=conv.plans(caps), upstream=domains.upstreams(caps))
    def probe(plan, upstream):
        for arg, names in domains.classes_of(conv, plan, caps, upstream).items():
            seen.setdefault(arg, set()).update(names)

    with no_local_constants():  # the same draws whichever tests ran before in this process
        probe()
    return seen


def missing_classes(conv, caps, examples: int) -> list:
    seen = drawn_classes(conv, caps, examples)
    return [f"{arg}: {c.name}" for arg, classes in domains.domain(conv).items() for c in classes
            if not c.off(caps) and c.name not in seen.get(arg, ())]


@pytest.mark.parametrize("name", CONVENTIONS)
def test_every_declared_class_is_drawn(name):
    conv = spec.load(name)
    caps = conv.caps()
    assert conv.DOMAIN, f"{name}: no DOMAIN declared"
    missing = missing_classes(conv, caps, run_budget(conv))
    assert not missing, f"{name}: declared classes not drawn in {run_budget(conv)} plans: {missing}"


@pytest.mark.parametrize("name", CONVENTIONS)
def test_domain_covers_the_signature(name):
    """Every argument of the SIGNATURE has a declared domain, and the domain names no argument the signature
    lacks."""
    conv = spec.load(name)
    assert set(conv.DOMAIN) == set(conv.SIGNATURE), \
        f"{name}: undeclared {sorted(set(conv.SIGNATURE) - set(conv.DOMAIN))}, " \
        f"not in the signature {sorted(set(conv.DOMAIN) - set(conv.SIGNATURE))}"


@pytest.mark.parametrize("name", CONVENTIONS)
def test_declared_off_follows_capabilities(name):
    """The defaults switch nothing off that a capability names; declaring a class's capability off lists it."""
    conv = spec.load(name)
    caps = conv.caps()
    for arg, classes in domains.domain(conv).items():
        for c in classes:
            if c.cap and c.cap in caps and isinstance(caps[c.cap], bool) and caps[c.cap]:
                off = domains.declared_off(conv, conv.caps({c.cap: False}))
                assert f"{arg}: {c.name} ({c.cap})" in off, f"{name}: {c.cap}=false does not switch off {arg}: {c.name}"
