"""Side effects: what a call may write and what it must return, checked on every buffer of the case.

Before the call every buffer (each tensor argument's whole storage, padding included) is snapshotted. After
it: the tensors the convention promises to write hold the result (checked by the oracle comparison); every
other byte of every buffer is unchanged, bitwise: the inputs, the tables, the positions, the padding around
a sliced view. Returned objects are the promised ones: the argument itself for an in-place result, a tensor
that is no argument and shares no memory with one for a new one (empty ones included), None where the
convention returns nothing.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Returned(NamedTuple):
    """One element of what a call returns: the output `name`; `arg` names the argument it must be (in place),
    None for a new tensor. same="memory": the argument's memory, written (the argument itself, or a tensor with its
    data pointer, shape and strides, as an autograd Function that does not mark its input dirty returns it).
    same=False: the result may be new or share the argument's memory, and the argument may be written, with the
    result only (Liger's kernel writes q's memory where q is laid out as a projection gives it, and returns a view
    of it; elsewhere it rotates a copy)."""
    name: str
    arg: Optional[str] = None
    same: object = True


def bits(x: torch.Tensor) -> torch.Tensor:
    """The bytes of x as integers (NaN payloads and signed zeros compared exactly)."""
    x = x.detach()
    if x.dtype == torch.bool:
        return x.to(torch.uint8)
    return x.contiguous().view(_BITS[x.element_size()]) if x.is_floating_point() else x


def written_mask(buffer: torch.Tensor, views) -> torch.Tensor:
    """True on the elements of the contiguous `buffer` that the tensors `views` (into it) cover."""
    mask = torch.zeros(buffer.numel(), dtype=torch.bool, device=buffer.device)
    for v in views:
        if v.numel():
            mask.as_strided(v.shape, v.stride(), v.storage_offset()).fill_(True)
    return mask.view(buffer.shape)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements in the same places: data pointer, shape and strides (but a dim of size 1, whose stride
    addresses nothing: autograd returns an unmarked input as `view_as` of it, which may restride such a dim)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and
                      all(n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True)))


class Snapshot:
    def __init__(self, buffers):
        self.buffers = list(buffers)
        self.before = [bits(b).clone() for b in self.buffers]

    def check_unchanged(self, written=()):
        """Every buffer bitwise as before, except the elements of the `written` tensors (views into them)."""
        for i, (buf, old) in enumerate(zip(self.buffers, self.before, strict=True)):
            mine = [w for w in written if same_storage(w, buf)]
            changed = bits(buf) != old
            if mine:
                changed &= ~written_mask(buf, mine)
            if changed.any():
                where = tuple(int(j) for j in changed.nonzero()[0])
                raise AssertionError(
                    f"side effect: buffer {i} (shape {tuple(buf.shape)}, {buf.dtype}) changed at {where} "
                    f"({int(changed.sum())} elements), outside the tensors the convention writes")


def check_returned(result, promised, args: dict, buffers) -> dict:
    """The call's result against the promise (a tuple of Returned or None per element, a single Returned, or
    None for no result); returns {output name: tensor}, the outputs that were returned."""
    if promised is None:
        assert result is None, f"side effect: expected None (the result is written in place), got {type(result)}"
        return {}
    single = isinstance(promised, Returned)
    items = (promised,) if single else tuple(promised)
    got = (result,) if single else result
    if not single:
        assert isinstance(got, (tuple, list)) and len(got) == len(items), \
            f"side effect: expected {len(items)} results, got {type(result).__name__}"
    out = {}
    for r, g in zip(items, got, strict=True):
        if r is None:  # an element the convention returns as None (vLLM's key when key is None)
            assert g is None, f"side effect: expected None in place of a missing tensor, got {type(g).__name__}"
            continue
        assert isinstance(g, torch.Tensor), f"side effect: {r.name}: expected a tensor, got {type(g).__name__}"
        if r.arg is not None and r.same == "memory":
            got = "another view of it" if same_storage(g, args[r.arg]) else "a new tensor"
            assert same_memory(g, args[r.arg]), \
                f"side effect: {r.name}: expected the argument {r.arg}'s memory (in place), got {got}"
        elif r.arg is not None and r.same:
            assert g is args[r.arg], f"side effect: {r.name}: expected the argument {r.arg} itself (in place)"
        elif r.arg is not None:
            pass  # new, or over the argument's memory: the argument then holds the result (run.outputs checks)
        else:
            # identity first: an empty tensor holds no bytes, so only `is` tells an argument returned from a new one
            given = [name for name, a in args.items() if g is a]
            assert not given, f"side effect: {r.name}: a new tensor was promised, got the argument {given[0]} itself"
            shared = [i for i, b in enumerate(buffers) if b.numel() and g.numel() and same_storage(g, b)]
            assert not shared, f"side effect: {r.name}: a new tensor was promised, got one sharing memory with an " \
                               f"argument (buffer {shared[0]})"
        out[r.name] = g
    return out
