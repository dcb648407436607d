"""The generic properties, for every convention the target has, in that convention's own signature.

    forward     every output (returned or written in place) within the accuracy model of the convention's
                float64 definition, from the inputs as given; the promised objects returned; nothing else
                written (every buffer, the padding around views, tables, positions: bitwise)
    backward    every promised gradient within the accuracy model of the definition's vector-Jacobian product,
                from random upstream gradients, with the arguments given as views in the graph; the upstream
                gradients left alone
A convention the target does not have is skipped; a capability it declares off is not drawn (the report says
which). Each convention's own invariants are in test_<convention>.py.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from . import run, spec

CONVENTIONS = spec.available()
# Examples per property on the CPU (Triton's interpreter runs every kernel program after another): enough to
# draw every dtype, layout kind and flag of a convention a few times over the CI runs; the GPU profile's 100
# examples (realistic shapes) are the certification.
CPU_EXAMPLES = {"forward": 10, "backward": 6, "invariant": 4}
INVARIANTS = [(name, inv) for name in CONVENTIONS for inv in spec.load(name).INVARIANTS]


def budget(prop: str) -> settings:
    return settings(max_examples=CPU_EXAMPLES[prop]) if spec.small() else settings()


def convention_of(target, name):
    fn = target.fns.get(name)
    if fn is None:
        pytest.skip(f"{target.name} has no {name} call")
    conv = spec.load(name)
    return conv, fn, conv.caps(target.caps.get(name))


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
    run.backward(conv, fn, caps, data.draw(conv.plans(caps), label="plan"))


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
@budget("invariant")
@given(data=st.data())
def test_invariant(target, name, invariant, data):
    conv, fn, caps = convention_of(target, name)
    conv.INVARIANTS[invariant](conv, fn, caps, data.draw(conv.plans(caps), label="plan"))
