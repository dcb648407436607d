"""A target's callables against their conventions' SIGNATURE: the parameter names and their order.

The native properties call each convention with its arguments by name past the first few, so a callable whose
parameter is named otherwise, or lies elsewhere, fails them for that reason alone; here it is named as such.
Compatible: every name of SIGNATURE accepted (a parameter of that name, or **kwargs), the parameters the suite
passes positionally (the convention's first few) in SIGNATURE's order with nothing of their own between them,
and no required parameter SIGNATURE lacks. Extra optional parameters are allowed (Gemma 3n's unused position_ids
before unsqueeze_dim, which the suite passes by keyword); *args and **kwargs wrappers and functools.partial
(inspect.signature) are read as what they accept. Runs for whatever --rope-impl names (`target.fns`).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import warnings

import pytest
import torch

from . import spec

CONVENTIONS = spec.available()
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def signature_problems(signature: tuple, fn, positional: int = None, may_lack: tuple = ()) -> list:
    """What keeps `fn` from being called as `signature` says, its first `positional` arguments by position and
    the rest by name (None: all by position); empty: compatible. `may_lack`: optional parameters an older release
    lacks, whose capabilities are then off (registry.absent_caps). Raises ValueError or TypeError where Python
    cannot read fn's signature (a builtin or compiled op)."""
    positional = len(signature) if positional is None else positional
    params = list(inspect.signature(fn).parameters.values())
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    var_pos = any(p.kind == p.VAR_POSITIONAL for p in params)
    named = {p.name: p for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    problems = []
    missing = [n for n in signature if n not in named and n not in may_lack]
    if missing and not (var_kw or var_pos):
        problems.append(f"no parameter {', '.join(missing)}")
    positional_params = [p for p in params if p.kind in POSITIONAL]
    for i, p in enumerate(positional_params):
        if i >= positional:
            break
        if p.kind == p.POSITIONAL_ONLY or p.name == signature[i]:
            continue
        where = f"parameter {i + 1} is {p.name!r}, the convention's is {signature[i]!r}"
        problems.append(where + (f" (which it has at {list(named).index(signature[i]) + 1})"
                                 if signature[i] in named else ""))
        break
    by_name = [n for n in signature[positional:] if n in named and named[n].kind == inspect.Parameter.POSITIONAL_ONLY]
    if by_name:
        problems.append(f"{', '.join(by_name)} positional-only, but passed by name")
    extra = [p.name for p in params if p.name not in signature and p.default is p.empty
             and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if extra:
        problems.append(f"requires {', '.join(extra)}, which the convention does not pass")
    return problems


def positional_count(conv) -> int:
    """How many of the convention's arguments the suite passes by position (a built case's)."""
    from .run import make_case

    caps = conv.caps()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = conv.plans(caps).example()
    return make_case(conv, caps, plan, torch.device("cpu")).positional


def describe(fn) -> str:
    base = fn.func if isinstance(fn, functools.partial) else fn
    return f"{getattr(base, '__module__', '?')}.{getattr(base, '__qualname__', repr(base))}"


@pytest.mark.parametrize("name", CONVENTIONS)
def test_signature(target, name):
    fn = target.fns.get(name)
    if fn is None:
        pytest.skip(f"{target.name} has no {name} call")
    conv = spec.load(name)
    try:
        problems = signature_problems(conv.SIGNATURE, fn, positional_count(conv), tuple(conv.PARAMETER_CAPS))
    except (ValueError, TypeError) as e:
        pytest.skip(f"{describe(fn)}: Python cannot read its signature ({e})")
    assert not problems, f"{name}: {describe(fn)}{inspect.signature(fn)} against the convention's " \
                         f"{name}({', '.join(conv.SIGNATURE)}): {'; '.join(problems)}"


# ---- the check on itself ---------------------------------------------------------------------------------------

def hf_renamed(q, k, cos, sine, position_ids=None, unsqueeze_dim=1):
    """transformers' call with sin named otherwise."""


def hf_swapped(q, k, sin, cos, position_ids=None, unsqueeze_dim=1):
    """cos and sin in each other's place."""


def hf_extra_required(q, k, cos, sin, layer, position_ids=None, unsqueeze_dim=1):
    """A parameter the convention never passes, required."""


def hf_wrapped(*args, **kwargs):
    """A wrapper that forwards everything."""


def hf_extra_optional(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, scale=1.0):
    """An optional parameter of its own, after the convention's."""


def single_as_gemma3n(x, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Gemma 3n's one-tensor form: an unused position_ids before unsqueeze_dim (passed by keyword)."""


@pytest.mark.parametrize("fn,expect", [
    (hf_renamed, "no parameter sin"), (hf_swapped, "parameter 3 is 'sin', the convention's is 'cos'"),
    (hf_extra_required, "requires layer"),
])
def test_mismatch_is_named(fn, expect):
    problems = signature_problems(spec.load("hf").SIGNATURE, fn)
    assert any(expect in p for p in problems), problems


@pytest.mark.parametrize("fn", [hf_wrapped, hf_extra_optional,
                                functools.partial(hf_extra_optional, scale=2.0)])
def test_compatible_forms_pass(fn):
    assert signature_problems(spec.load("hf").SIGNATURE, fn) == []


def test_keyword_arguments_may_lie_elsewhere():
    """Past the arguments passed by position, an extra optional parameter may come first; within them it may not."""
    conv = spec.load("hf-single")
    assert signature_problems(conv.SIGNATURE, single_as_gemma3n, positional_count(conv)) == []
    assert signature_problems(conv.SIGNATURE, single_as_gemma3n), "position_ids in unsqueeze_dim's place passed"


@pytest.mark.parametrize("name", CONVENTIONS)
def test_zoo_signatures(name):
    """Every implementation of the zoo, correct or planted with a bug, takes its convention's signature."""
    try:
        zoo = importlib.import_module(f"{__package__}.zoo.{name.replace('-', '_')}")
    except ModuleNotFoundError:
        pytest.skip(f"no zoo for {name}")
    signature = spec.load(name).SIGNATURE
    positional = positional_count(spec.load(name))
    for label, fn in [("CORRECT", zoo.CORRECT), *((bug, fn) for bug, (fn, _) in zoo.BUGS.items())]:
        problems = signature_problems(signature, fn, positional)
        assert problems == [], f"{name}: {label}: {problems}"


def megatron_before_inverse(t, cos, sin, nope_dim, emb_dim, cu_seqlens_q=None, cp_rank=0, cp_size=1,
                            rotary_interleaved=False):
    """Megatron-LM's MLA call as releases before inverse, remove_interleaving and position_ids spelled it."""
    import rope

    return rope.megatron.fused_mla_rope_inplace(t, cos, sin, nope_dim, emb_dim, cu_seqlens_q, cp_rank, cp_size,
                                                rotary_interleaved)


def test_an_older_signature_is_certified_for_what_it_has():
    """A callable without some of the convention's optional parameters (an older release): those parameters'
    capabilities off, no default passed by name to it, its signature compatible, and what is not certified said;
    the properties then run on it (a few draws: none passes an argument it lacks, which would be a TypeError)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from . import registry, run
    from .test_native import not_certified

    target = registry.resolve("megatron-mla:tests.conformance.test_signatures:megatron_before_inverse")
    conv, fn, caps = spec.load("megatron-mla"), target.fns["megatron-mla"], target.caps["megatron-mla"]
    assert {k: caps[k] for k in ("inverse", "remove_interleaving", "position_ids", "explicit_defaults")} == \
        dict.fromkeys(("inverse", "remove_interleaving", "position_ids", "explicit_defaults"), False), caps
    assert signature_problems(conv.SIGNATURE, fn, positional_count(conv), tuple(conv.PARAMETER_CAPS)) == []
    assert signature_problems(conv.SIGNATURE, fn, positional_count(conv)) == [
        "no parameter inverse, remove_interleaving, position_ids"]
    caps = conv.caps(caps)
    said = not_certified(conv, caps)
    assert all(word in said for word in ("inverse", "remove_interleaving", "position_ids")), said

    @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data())
    def forward(data):
        run.forward(conv, fn, caps, data.draw(conv.plans(caps)))

    forward()
