"""The suite on itself: every planted bug (zoo/) is caught by the properties named for it, and every
convention's correct implementation passes them all, run exactly as `--rope-impl CONVENTION:module:callable`
runs them (the same plans, checks and capabilities).

The zoo is pure PyTorch, so the budget is generous and fixed (derandomized): a bug that needs a rare
combination (a 16-bit dtype with an odd layout) is still drawn.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from . import run, spec
from .budget import examples_for
from .draws import no_local_constants
from .spec import domains

ZOO_EXAMPLES = 150


def catch_budget(name: str, prop: str, bug: str) -> int:
    """The examples planted bug `bug` of convention `name` gets for property `prop`: ZOO_EXAMPLES (pure PyTorch: a
    bug that needs a rare combination is still drawn); under the device's draws, the gpu profile's count for that
    property in that convention (budget.examples_for) where the certifying run relies on the property for the bug:
    forward, backward and determinism, and an invariant of a bug that only invariants catch. So every bug the zoo
    names for them is shown caught within what a certifying run gives them. An invariant of a bug that forward,
    backward or determinism catches keeps ZOO_EXAMPLES: some catch their bug on a few draws in a hundred (Meta's
    swap_q_k needs a per-token table over b > 1)."""
    if spec.small():
        return ZOO_EXAMPLES
    if prop in PROPERTIES:
        kind = prop
    elif only_invariants(name, bug):
        kind = "invariant"
    else:
        return ZOO_EXAMPLES
    return examples_for(kind, "gpu", {}, (name, prop)) or settings.get_profile("gpu").max_examples


def only_invariants(name: str, bug: str) -> bool:
    """Whether planted bug `bug` of convention `name` is named for invariants alone (no forward, backward or
    determinism property is relied on to catch it)."""
    return not set(zoo(name).BUGS[bug][1]) & set(PROPERTIES)


# The correct implementation's examples. On the CPU's draws 30: three times the CI default's forward count, seven
# times an invariant's, on an implementation that rounds once from float64 (a false alarm here is the oracle's or a
# tolerance's, and rope, a correct target too, runs every native property on the same kind of plans in the same
# run). On the device's draws (tensors up to tens of MB, the float64 oracle on every one) fewer, since every native
# property runs rope over the same plans with the profile's whole count: the floor of the gpu profile's counts.
CORRECT_EXAMPLES_SMALL, CORRECT_EXAMPLES_DEVICE = 30, 10
ROOT = Path(__file__).resolve().parents[2]
# determinism on contiguous upstream gradients here (the probe's source, and with it its derandomized draws, stays
# that of the other properties; test_native draws every layout for it)
PROPERTIES = {"forward": run.forward, "backward": run.backward, "determinism": run.determinism}


def zoo(name):
    return importlib.import_module(f"{__package__}.zoo.{name.replace('-', '_')}")


def zoo_modules():
    out = {}
    for name in spec.available():
        try:
            out[name] = zoo(name)
        except ModuleNotFoundError:
            continue
    return out


def _counted(check, drawn: list):
    def counted(conv, fn, caps, plan, *rest):
        drawn.append(plan)
        return check(conv, fn, caps, plan, *rest)
    return counted


def falsify(name, prop, fn, declared=None, max_examples=ZOO_EXAMPLES, drawn=None, draws_seed=None):
    """Run property `prop` of convention `name` on fn; the failure it finds (an exception), or None. `drawn`, a
    list, gets each example's plan as it runs (its length, on a failure, is the example that caught it).
    `draws_seed`: draws from that seed instead of the derandomized ones (a certifying run's are random)."""
    conv = spec.load(name)
    caps = conv.caps({**getattr(zoo(name), "CAPS", {}), **(declared or {})})
    check = PROPERTIES[prop] if prop in PROPERTIES else conv.INVARIANTS[prop]
    if drawn is not None:  # counted outside the probe: its source seeds the derandomized draws
        check = _counted(check, drawn)

    @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def probe(data):
        plan = data.draw(conv.plans(caps))
        if prop == "backward":
            check(conv, fn, caps, plan, data.draw(domains.upstreams(caps)))
        else:
            check(conv, fn, caps, plan)

    if draws_seed is not None:  # applied outside the probe's source, which seeds the derandomized draws
        probe = seed(draws_seed)(probe)
    with no_local_constants():
        try:
            probe()
        except Exception as e:  # noqa: BLE001 - any failure is the verdict
            return e
    return None


CASES = [(name, bug, prop) for name, mod in zoo_modules().items() for bug, (_, props) in mod.BUGS.items()
         for prop in props]


def test_falsify_records_its_draws_and_takes_a_seed():
    """What device_draws reports rests on these: `drawn` gets every example's plan, and `draws_seed` draws from that
    seed (the same plans for the same seed, others for another) instead of the derandomized draws."""
    fn = zoo("hf").CORRECT
    runs = {}
    for key, draws_seed in (("fixed", None), ("fixed again", None), ("seed 1", 1), ("seed 1 again", 1),
                            ("seed 2", 2)):
        runs[key] = []
        assert falsify("hf", "forward", fn, max_examples=5, drawn=runs[key], draws_seed=draws_seed) is None
    assert all(len(plans) == 5 for plans in runs.values()), {k: len(v) for k, v in runs.items()}
    assert runs["fixed"] == runs["fixed again"] and runs["seed 1"] == runs["seed 1 again"]
    assert runs["seed 1"] != runs["seed 2"] and runs["seed 1"] != runs["fixed"]


@pytest.mark.parametrize("name,bug,prop", CASES, ids=[f"{n}-{b}-{p}" for n, b, p in CASES])
def test_bug_is_caught(name, bug, prop):
    fn = zoo(name).BUGS[bug][0]
    failure = falsify(name, prop, fn, max_examples=catch_budget(name, prop, bug))
    assert failure is not None, f"{name}: the planted bug {bug!r} passed the {prop} property"
    assert isinstance(failure, AssertionError), f"{name}: {bug!r} crashed {prop} instead of failing a check: " \
                                                f"{type(failure).__name__}: {failure}"


PASSES = [(name, prop) for name in zoo_modules() for prop in (*PROPERTIES, *spec.load(name).INVARIANTS)]


@pytest.mark.parametrize("name,prop", PASSES, ids=[f"{n}-{p}" for n, p in PASSES])
def test_correct_passes(name, prop):
    conv = spec.load(name)
    if prop == "backward" and not conv.DIFFERENTIABLE:
        pytest.skip(f"{name} has no backward")
    examples = CORRECT_EXAMPLES_SMALL if spec.small() else CORRECT_EXAMPLES_DEVICE
    failure = falsify(name, prop, zoo(name).CORRECT, max_examples=examples)
    assert failure is None, f"{name}: the correct implementation fails {prop}: {failure}"


PINNED = [(name, i) for name in zoo_modules() for i in range(len(spec.load(name).PINS))]


@pytest.mark.parametrize("name,index", PINNED, ids=[f"{n}-{i}" for n, i in PINNED])
def test_pin_passes_the_correct(name, index):
    """Every pinned edge case (spec PINS) is a valid call: the correct implementation passes it forward and
    backward."""
    conv = spec.load(name)
    caps = conv.caps(getattr(zoo(name), "CAPS", {}))
    run.forward(conv, zoo(name).CORRECT, caps, conv.PINS[index])
    if conv.DIFFERENTIABLE:
        run.backward(conv, zoo(name).CORRECT, caps, conv.PINS[index])


@pytest.mark.parametrize("name", list(zoo_modules()))
def test_zoo_is_complete(name):
    """At least six planted bugs per convention."""
    assert len(zoo(name).BUGS) >= 6, f"{name}: {len(zoo(name).BUGS)} planted bugs"


def _first_forward_bug(name):
    """The planted bug the command-line test runs: the zoo's CLI_BUG where it names one (a bug that nearly every
    draw exposes, on both sets of draws), else its first forward bug."""
    return getattr(zoo(name), "CLI_BUG", None) or next(bug for bug, (_, props) in zoo(name).BUGS.items()
                                                         if "forward" in props)


# The conventions in groups, one process each, which pytest-xdist spreads over its workers (one process for all was
# the longest test of the GPU suite); each group starts torch once. Eight on a GPU host (16 workers; four groups took
# 40 to 60 s each there, the longest tests but two), four on the CPU (a start is some seconds of a 2-core machine).
_CLI_GROUP_COUNT = 8 if torch.cuda.is_available() else 4
CLI_GROUPS = [list(zoo_modules())[i::_CLI_GROUP_COUNT] for i in range(_CLI_GROUP_COUNT)]


@pytest.mark.parametrize("names", CLI_GROUPS, ids=[f"group{i}" for i in range(len(CLI_GROUPS))])
def test_through_rope_impl(names):
    """As a user runs it: `pytest --rope-impl CONVENTION:module:callable` (TE's convention: `module:callable`) fails on
    a planted bug (exit status 1, the forward property failed) and passes the correct implementation (exit status 0),
    in every convention; one process runs each target in a pytest session of its own (cli_check.py)."""
    targets = []
    for name in names:
        module = f"{__package__}.zoo.{name.replace('-', '_')}"
        prefix = "" if name == "te" else f"{name}:"  # TE's convention also as plain module:callable
        targets += [f"{prefix}{module}:{_first_forward_bug(name)}", f"{prefix}{module}:{zoo(name).CORRECT.__name__}"]
    # the forward property's CI count: every bug here fails within it on both sets of draws (a random seed each run)
    env = {**os.environ, "ROPE_MAX_EXAMPLES": "10"}
    done = subprocess.run([sys.executable, "-m", f"{__package__}.cli_check", *targets], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, f"cli_check did not finish:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    results = {r["target"]: r for r in json.loads(lines[-1][len("RESULTS "):])}
    for broken, correct in zip(targets[::2], targets[1::2], strict=True):
        got = results[broken]
        assert got["status"] == 1 and got["failed"] == 1, f"{broken} was not caught: {got}"
        got = results[correct]
        assert got["status"] == 0 and got["passed"] == 1, f"{correct} failed: {got}"


def test_cli_groups_cover_every_convention():
    assert sorted(sum(CLI_GROUPS, [])) == sorted(zoo_modules())


# Bugs only a declared class exposes (spec/domains.py): caught with the class drawn, passed with it declared off.
CLASS_BUGS = [
    ("hf", "mixed_tables_cast_to_q", "forward", {"mixed_tables": False}),
    ("hf", "empty_returns_flat", "forward", {"empty": False}),
    ("hf", "grad_read_as_contiguous", "backward", {"strided_grads": False, "expanded_grads": False}),
    ("hf", "grad_channels_read_as_adjacent", "backward", {"strided_grads": False, "expanded_grads": False}),
    ("hf", "k_grad_batch_by_q_heads", "backward", {"gqa": False}),
    ("hf", "k_grad_batch_by_q_heads", "backward", {"cos_batch": False}),
    ("vllm-cache", "block_by_shift", "forward", {"npot_block_size": False}),
    ("torchtitan-cossin", "explicit_none_positions_as_zero", "forward", {"explicit_defaults": False}),
    ("torchtitan-complex", "positions_read_dense", "forward", {"strides": False}),
]


@pytest.mark.parametrize("name,bug,prop,off", CLASS_BUGS, ids=[f"{n}-{b}-{'-'.join(o)}" for n, b, _, o in CLASS_BUGS])
def test_bug_needs_its_class(name, bug, prop, off):
    """The planted bug passes once its class is declared off: the class is what catches it."""
    fn = zoo(name).BUGS[bug][0]
    assert falsify(name, prop, fn, declared=off, max_examples=60) is None, f"{name}: {bug!r} is caught without {off}"


@pytest.mark.parametrize("prop", list(PROPERTIES))
def test_declared_off_is_not_drawn(prop):
    """zoo/meta.py's reshape_as_meta (Meta's own reshape) cannot take s = 0: with the empty=false it declares it
    passes; with s = 0 drawn it fails."""
    fn = zoo("meta").reshape_as_meta
    assert falsify("meta", prop, fn, declared=fn.rope_capabilities, max_examples=60) is None
    assert falsify("meta", prop, fn) is not None, "s = 0 was never drawn"


# `--rope-schedule` on the zoo: transformers' expression as its models run it (vLLM's forward_native) passes the
# `eager` schedule and fails the `float32` one, the float32-accurate implementation the other way round (16-bit draws
# tell them apart).
SCHEDULE_VERDICTS = [(name, schedule, impl, schedule == ("eager" if impl == eager else "float32"))
                     for name, eager in (("hf", "eager"), ("hf-glm", "eager"), ("vllm", "native"))
                     for schedule in ("eager", "float32") for impl in (eager, "correct")]
SCHEDULE_VERDICTS.append(("vllm", "eager", "native_sin_uncast", False))  # one operand not in the query's dtype
# QK norm's eager schedule (Qwen3's expression as it runs on CUDA): the float32-accurate implementation and one
# applying Qwen3's weight in float32 fail it
SCHEDULE_VERDICTS += [("qknorm", "eager", "eager", True), ("qknorm", "eager", "correct", False),
                      ("qknorm", "eager", "eager_weight_in_float32", False)]


@pytest.mark.parametrize("name,schedule,impl,passes", SCHEDULE_VERDICTS,
                         ids=[f"{n}-{s}-{i}" for n, s, i, _ in SCHEDULE_VERDICTS])
def test_schedule_verdict(name, schedule, impl, passes):
    conv = spec.load(name)
    fn = getattr(zoo(name), impl)
    # every implementation on the draws the schedule's own declares (QK norm's: a model in one dtype)
    eager = getattr(zoo(name), "eager", fn)
    caps = conv.caps(getattr(eager, "rope_capabilities", getattr(zoo(name), "CAPS", {})))
    failures = []

    @settings(max_examples=ZOO_EXAMPLES if passes else 60, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def probe(data):
        try:
            run.schedule(conv, fn, caps, data.draw(conv.plans(caps)), schedule)
        except AssertionError as e:
            failures.append(e)
            raise

    with no_local_constants():
        try:
            probe()
        except AssertionError:
            pass
    if passes:
        assert not failures, f"{impl} fails the schedule {schedule}: {failures[0]}"
    else:
        assert failures, f"{impl} passed the schedule {schedule}"
        assert f"schedule {schedule}" in str(failures[0])
