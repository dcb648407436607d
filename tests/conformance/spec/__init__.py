"""A convention: its signature, what it can express, how to draw its arguments, what it defines.

Each module here defines one `Convention` subclass: `NAME`, `SIGNATURE` (its parameters in order), `OPTIONAL`
(the parameters with a default, and the default: omitted or passed at it, as the plan draws), `DOMAIN` (each
argument's classes of values, domains.py), `CAPS` (capability -> (default, meaning); a target declares where it
differs; domains.GENERIC_CAPS are added to every convention), `DIFFERENTIABLE` (the arguments whose gradient the
convention promises; empty where it has no backward), and
    plans(caps)          a Hypothesis strategy of the call's structure (printable; tensors built from its seed)
    build(plan, arena)   -> Case: the native arguments, every tensor a view into an arena buffer
    effects(case)        -> (the argument names it writes, what it returns: contract.Returned or a tuple of them)
    define(case, x64)    -> {output name: Expect}: in float64, what the convention defines, from the inputs as
                            given (x64: every floating argument as float64, the differentiable ones leaves)
    read(case, name, t)  -> an output arranged as define's value (default: as it is)
    INVARIANTS           {name: check(conv, fn, caps, plan)}: the convention's own properties (oracle-free
                         where they can be: layout flags equivalent, in place equal to out of place, ...)
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from hypothesis import strategies as st

from ..tensors import DEVICE

NAMES = ("te", "hf", "hf-single", "hf-glm", "hf-deepseek-v3", "liger", "flash", "vllm", "hf-mrope", "vllm-mrope",
         "mrope", "qwen3vl-mrope", "te-qkv",
         "meta", "torchtitan-complex", "torchtitan-cossin", "qknorm", "vllm-qknorm", "vllm-cache", "sglang-cache",
         "te-qknorm", "qknorm-cache", "deepseek-v4", "megatron-mla", "megatron-mla-kv")


class Expect(NamedTuple):
    value: torch.Tensor  # float64, what the convention defines
    source: torch.Tensor  # float64, the rotated input arranged as value (its pairs give the accuracy scale)
    rot: int  # rotary width: channels past it are copies
    interleaved: bool
    dtype: torch.dtype  # the output's dtype


@dataclass
class Case:
    plan: Any
    args: dict  # name -> value, in the signature's order
    positional: int  # how many of args go positionally
    buffers: list = field(default_factory=list)
    caps: dict = field(default_factory=dict)  # the capabilities in force (set by the runner)
    omit: tuple = ()  # optional arguments the call leaves out while they hold their default (domains.py)
    optional: dict = field(default_factory=dict)  # optional argument -> its default

    def call(self, fn):
        from .domains import is_default

        names = [n for n in self.args
                 if n not in self.omit or not is_default(self.args[n], self.optional.get(n))]
        return fn(*(self.args[n] for n in names[:self.positional]),
                  **{n: self.args[n] for n in names[self.positional:]})


class Convention:
    NAME = ""
    SIGNATURE: tuple = ()
    # optional argument -> its default: omitted, or passed at it explicitly, as the plan draws (domains.py)
    OPTIONAL: dict = {}
    # argument -> its declared classes of values (domains.py); every class is drawn by `plans`
    DOMAIN: dict = {}
    # optional parameter a release of the convention's own implementation may lack (an older signature) -> the
    # capabilities that need it: off for a target whose signature lacks it (registry.absent_caps)
    PARAMETER_CAPS: dict = {}
    CAPS: dict = {}
    DIFFERENTIABLE: tuple = ()
    # The convention's own invariants: name -> check(conv, fn, caps, plan), run as run.forward is (test_native.py
    # runs each as test_invariant[convention-name]; test_zoo.py names them as catching planted bugs).
    INVARIANTS: dict = {}
    # Named schedules (`--rope-schedule`): name -> schedule(case) -> {output name: tensor}, the bits a PyTorch
    # program of that schedule gives on the case's arguments as given, on their device (run.schedule).
    SCHEDULES: dict = {}
    # Edge cases run forward and backward on every run before any drawn plan (test_native.py's test_pinned), as
    # Hypothesis' @example runs them: each a plan, run where outside(plan, caps) finds it within the capabilities.
    PINS: tuple = ()

    def caps(self, declared: dict = None) -> dict:
        """The capabilities in force: the defaults, overridden by what the target declares (unknown keys are
        an error, so that a typo cannot silently widen or narrow a certification)."""
        declared = declared or {}
        known = self.all_caps()
        unknown = set(declared) - set(known)
        if unknown:
            raise ValueError(f"{self.NAME}: unknown capabilities {sorted(unknown)}; known: {sorted(known)}")
        return {**{k: v[0] for k, v in known.items()}, **declared}

    def all_caps(self) -> dict:
        """CAPS with the capabilities every convention has (domains.GENERIC_CAPS, and the upstream gradients'
        layouts where it is differentiable)."""
        from .domains import generic_caps

        return {**generic_caps(self), **self.CAPS}

    def plans(self, caps: dict):
        raise NotImplementedError

    def build(self, plan, arena) -> Case:
        raise NotImplementedError

    def effects(self, case: Case):
        raise NotImplementedError

    def define(self, case: Case, x64: dict) -> dict:
        raise NotImplementedError

    def read(self, case: Case, name: str, t: torch.Tensor) -> torch.Tensor:
        return t

    def outside(self, plan, caps: dict):
        """Why a pinned plan lies outside the capabilities in force (a short reason), or None."""
        return None

    def backward_plan(self, plan, caps: dict):
        """The plan as the backward property runs it (a target may support less in backward than in forward)."""
        return plan

    def upstream(self, case: Case, name: str, g: torch.Tensor) -> torch.Tensor:
        """The upstream gradient of output `name` as the backward property passes it: `g` (contiguous) by default;
        a convention whose plans draw gradient layouts returns g's values as a strided or expanded view, as
        autograd hands a kernel the gradient of a slice or of a broadcast."""
        return g

    def leaf_args(self, case: Case) -> tuple:
        """The differentiable arguments the backward property passes as leaves that require grad themselves (a
        convention that writes such a leaf in place, as flash-attention's inplace=True does); the others are views
        of a tensor in the graph."""
        return ()

    def grad_of(self, case: Case, arg: str) -> str:
        """The output whose upstream gradient arg's gradient rotates back (for the accuracy scale)."""
        return arg

    def grad_scale(self, case: Case, arg: str, up64: dict, expect: dict):
        """(the accuracy scale of arg's gradient, where it is a copy of an upstream gradient): by default the pairs
        of the output `grad_of(arg)`, laid out as arg. A packed argument (qkv) overrides it, part by part."""
        from .. import pairing

        e = expect[self.grad_of(case, arg)]
        scale = pairing.pair_scale(up64[self.grad_of(case, arg)], e.rot, e.interleaved)
        return scale.reshape(up64[self.grad_of(case, arg)].shape), pairing.copied_mask(scale.shape[-1], e.rot)


def small() -> bool:
    """Shapes for Triton's interpreter (one program after another on the CPU), or for a device."""
    return DEVICE.type == "cpu"


def head_and_rotary(draw, dims, partial: bool) -> tuple:
    """(head dim d, rotary width rot) drawn by a plan strategy, its kind first (so that each is drawn often in a
    few examples): the whole head (even d, rot = d); partial rotary where it is a capability, an even d with a
    narrower even rot, or an odd d (a channel past every pair) with any even rot below it."""
    even = tuple(v for v in dims if v % 2 == 0)
    wide, odd = tuple(v for v in even if v > 2), tuple(v for v in dims if v % 2)
    kinds = ("whole",) + ((("narrower",) if wide else ()) + (("odd",) if odd else ()) if partial else ())
    kind = draw(st.sampled_from(kinds))
    if kind == "whole":
        d = draw(st.sampled_from(even))
        return d, d
    d = draw(st.sampled_from(wide if kind == "narrower" else odd))
    return d, 2 * draw(st.integers(1, d // 2 - (kind == "narrower")))


def load(name: str) -> Convention:
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}").CONVENTION


def available() -> tuple:
    """The conventions of NAMES whose module exists."""
    import importlib.util

    return tuple(n for n in NAMES if importlib.util.find_spec(f"{__name__}.{n.replace('-', '_')}") is not None)
