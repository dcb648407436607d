"""The implementation under test, chosen with `pytest --rope-impl module:function`.

Any callable with TransformerEngine's signature works:
    apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                         fused=..., cu_seqlens=None, cp_size=1, cp_rank=0)
The suite passes `t` and `freqs` positionally and only the keyword arguments a case needs, so a
version without `start_positions` still runs the cases that do not use it. `fused` is never passed:
wrap the function to pin it (TE's default is fused=False, its less accurate unfused path).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT = "rope:apply_rotary_pos_emb"
OURS = {"rope:apply_rotary_pos_emb", "rope.functional:apply_rotary_pos_emb"}


@dataclass(frozen=True)
class Target:
    name: str
    fn: Callable

    @property
    def is_ours(self) -> bool:
        """True when the target is this package's fused entry point (tests of its internals apply)."""
        return self.name in OURS

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def load_target(spec: str) -> Target:
    """`package.module:attr.attr` -> Target."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--rope-impl: expected 'module:function', got {spec!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"--rope-impl: {spec!r} is not callable")
    return Target(spec, obj)
