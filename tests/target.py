"""The implementation under test, chosen with `pytest --rope-impl SPEC` (tests/adapters: the registry).

SPEC is a named implementation (te, flash, liger, hf, vllm, rope; liger-mrope, hf-mrope, vllm-mrope, rope-mrope
for multimodal RoPE), `module:callable` in TransformerEngine's convention, or `CONVENTION:module:callable` for a
callable in another library's convention, which an adapter maps TE's calls onto. A TE-convention callable is
called as it is, with TransformerEngine's signature:
    apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                         fused=..., cu_seqlens=None, cp_size=1, cp_rank=0)
The suite passes `t` and `freqs` positionally and only the keyword arguments a case needs, so a
version without `start_positions` still runs the cases that do not use it. `fused` is never passed:
wrap the function to pin it (TE's default is fused=False, its less accurate unfused path); the named
`te` does.

A call outside the target's capabilities (tests/adapters: Capabilities) is no verdict: inside a Hypothesis test
the example is rejected (`hypothesis.reject`, counted per reason in REJECTED), elsewhere the test is skipped.

Multimodal RoPE: `target.mrope` is the target's canonical mRoPE call, `rope.mrope.apply_multimodal_rotary_pos_emb`'s
signature (tests/test_mrope.py), with the same gate on `target.mrope_caps` (MRoPECapabilities); None for targets
without one (TE-convention callables other than this package's, the plain conventions). `target.mrope_call(...)`
calls it, or skips with "<name> has no multimodal RoPE".
"""
from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from tests.adapters import (  # noqa: F401 - Unavailable re-exported
    ALL_CONVENTIONS,
    DEFAULT,
    MROPE_ARGS,
    Capabilities,
    MRoPECapabilities,
    Unavailable,
    load,
)
from tests.conformance.registry import Native, resolve
from tests.conformance.spec import NAMES as CONVENTION_NAMES

NATIVE_ONLY = tuple(n for n in CONVENTION_NAMES if n not in ALL_CONVENTIONS)  # no TE bridge for these
OURS = {"rope", "rope:apply_rotary_pos_emb", "rope.functional:apply_rotary_pos_emb"}
REJECTED: Counter = Counter()  # reason -> calls rejected in the current test (conftest clears it per test)


@dataclass(frozen=True, repr=False)
class Target:
    name: str
    fn: Callable
    caps: Capabilities = field(default_factory=Capabilities)
    convention: str = "te"
    mrope: Optional[Callable] = None  # the canonical mRoPE call, gated by mrope_caps (see checked_mrope)
    mrope_caps: Optional[MRoPECapabilities] = None
    native: Native = Native({}, {}, {})  # the conventions certified natively (tests/conformance)

    @property
    def is_ours(self) -> bool:
        """True when the target is this package's fused entry point (tests of its internals apply)."""
        return self.name in OURS

    def __repr__(self):  # short: Hypothesis prints it in every failing example
        return f"Target({self.name!r})"

    def _repr_pretty_(self, printer, cycle):  # Hypothesis' printer would otherwise list the dataclass fields
        printer.text(repr(self))

    def __call__(self, *args, **kwargs):
        if not self.caps.full:
            why = self.caps.lacks(args[0] if args else None, args[1] if len(args) > 1 else None, kwargs)
            if why is not None:
                _outside(why)
        return self.fn(*args, **kwargs)

    def mrope_call(self, *args, **kwargs):
        """The canonical mRoPE call (outside the capabilities: rejected or skipped, as __call__)."""
        if self.mrope is None:
            import pytest

            pytest.skip(f"{self.name} has no multimodal RoPE")
        return self.mrope(*args, **kwargs)


def checked_mrope(fn: Optional[Callable], caps: Optional[MRoPECapabilities]) -> Optional[Callable]:
    """fn behind the gate of caps: a call outside them is rejected or skipped (`_outside`) before fn sees it.
    Full capabilities: fn itself (nothing to check)."""
    if fn is None or caps is None or caps.full:
        return fn

    @functools.wraps(fn)
    def gated(*args, **kwargs):
        named = {**dict(zip(MROPE_ARGS, args, strict=False)), **kwargs}  # positional ones by name
        why = caps.lacks(named.get("t"), named.get("freqs"), named.get("positions"), named)
        if why is not None:
            _outside(why)
        return fn(*args, **kwargs)

    return gated


def _outside(why: str):
    from hypothesis.control import currently_in_test_context

    REJECTED[why] += 1
    if currently_in_test_context():
        from hypothesis import reject

        reject()
    import pytest

    pytest.skip(f"not supported: {why}")


@functools.cache
def load_target(spec: str, caps: str = "") -> Target:
    """--rope-impl (and --rope-caps) -> Target. Raises Unavailable for a named implementation none of whose
    conventions is installed. A convention the TE bridges do not know (tests/adapters) has no TE-convention
    call (`fn` None): only its native properties run."""
    native = resolve(spec, caps)
    if spec.split(":")[0] in NATIVE_ONLY:
        return Target(spec, None, Capabilities(), spec.split(":")[0], native=native)
    try:
        loaded = load(spec)
    except Unavailable:
        if not native.fns:
            raise
        return Target(spec, None, Capabilities(), "native", native=native)
    return Target(spec, loaded.fn, loaded.caps, loaded.convention, checked_mrope(loaded.mrope, loaded.mrope_caps),
                  loaded.mrope_caps, native)
