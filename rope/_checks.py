"""The one vocabulary of argument checks, shared by every convention and by both paths (docs/contract.md sections
2, 3 and 5): each check raises ValueError or TypeError whose message starts with the argument's name, before
anything is written or launched.

`check_static` checks what depends only on shapes, dtypes, devices and plain Python values, once per call
signature (the back end's call memo, `rope._backend.checked_call`). `check_positions` checks the *values* of
`cu_seqlens` and `start_positions`: one device-to-host copy per new or modified index tensor, skipped during
CUDA-graph capture and tracing, where the kernel's range guard (NaN, never an out-of-range read of `freqs`) is what
remains.
"""
from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import torch

from . import _memo
from ._cuda import capturing_on

FORMATS = ("sbhd", "bshd", "thd")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int32, torch.int64)


class Layout(NamedTuple):
    """What the checks learned about a call, in the kernel's (s, b, h, d) roles (thd: s = T, b = 1)."""

    s: int
    b: int
    h: int
    d: int
    rot_dim: int
    freqs_len: int
    n_seqs: int = 0  # thd only: number of sequences (len(cu_seqlens) - 1)


def check_t_and_freqs(t, freqs, tensor_format, interleaved, allow_float64: bool, name: str = "t",
                      freqs_name: str = "freqs") -> None:
    """What every call with `freqs` checks first: types, dtypes, the format's rank, freqs' shape and device
    (`name`, `freqs_name`: what the caller's signature calls t and freqs, for the messages)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not isinstance(freqs, torch.Tensor):
        raise TypeError(f"{freqs_name}: expected a torch.Tensor, got {type(freqs).__name__}")
    allowed = FLOAT_DTYPES + ((torch.float64,) if allow_float64 else ())
    if t.dtype not in allowed:
        extra = "" if allow_float64 else " (float64 runs only with fused=False, the reference)"
        raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16{extra}, got {t.dtype}")
    if not freqs.is_floating_point():
        raise TypeError(f"{freqs_name}: expected floating-point angles, got {freqs.dtype}")
    if tensor_format not in FORMATS:
        raise ValueError(f"tensor_format: expected one of {FORMATS}, got {tensor_format!r}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved: expected a bool, got {type(interleaved).__name__}")
    want_dim = 3 if tensor_format == "thd" else 4
    if t.dim() != want_dim:
        names = {"sbhd": "[s, b, h, d]", "bshd": "[b, s, h, d]", "thd": "[t, h, d]"}
        raise ValueError(f"{name}: tensor_format {tensor_format!r} expects a {want_dim}-D tensor "
                         f"{names[tensor_format]}, got shape {tuple(t.shape)}")
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"{freqs_name}: expected shape [s2, 1, 1, d2], got {tuple(freqs.shape)}")
    d, d2 = t.shape[-1], freqs.shape[3]
    if d2 < 2 or d2 % 2 or d2 > d:
        raise ValueError(f"{freqs_name}: rotary width d2 = {freqs_name}.shape[-1] must be even with "
                         f"2 <= d2 <= d = {d}, got d2 = {d2}")
    if freqs.device != t.device:
        raise ValueError(f"{freqs_name}: expected the device of {name} ({t.device}), got {freqs.device}")


def check_bools(**flags) -> None:
    """Flags are bools, as `interleaved` is: a string or a number is refused, not read as true or false."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


# The forward's rounding a caller may ask for (docs/contract.md, "Schedules"): None, float32 math rounded once to the
# output (a product may be fused into the sum); "float32", each product and the sum rounded to float32, as PyTorch's
# float32 operations; "eager", the convention's PyTorch expression run eagerly in the output dtype.
SCHEDULES = (None, "float32", "eager")


def check_schedule(schedule) -> None:
    if not (schedule is None or (isinstance(schedule, str) and schedule in SCHEDULES)):
        raise ValueError(f"schedule: expected None, 'float32' or 'eager', got {schedule!r}")


def check_float_tensor(name: str, x) -> None:
    """A tensor the kernel rotates: float32, float16 or bfloat16 (the conventions without a reference option)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16, got {x.dtype}")


def check_static(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                 allow_float64: bool, name: str = "t", freqs_name: str = "freqs") -> Layout:
    check_t_and_freqs(t, freqs, tensor_format, interleaved, allow_float64, name, freqs_name)
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size: expected an int >= 1, got {cp_size!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank: expected an int in [0, cp_size={cp_size}), got {cp_rank!r}")
    s2 = freqs.shape[0]
    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError("cu_seqlens: required when tensor_format is 'thd'")
        check_index_tensor("cu_seqlens", cu_seqlens, t)
        if cu_seqlens.shape[0] < 1:
            raise ValueError("cu_seqlens: expected shape [n + 1] with n >= 0, got an empty tensor")
        n_pos = cu_seqlens.shape[0] - 1
    else:
        if cu_seqlens is not None:
            raise ValueError(f"cu_seqlens: only valid with tensor_format 'thd', got {tensor_format!r}")
        s, n_pos = (t.shape[0], t.shape[1]) if tensor_format == "sbhd" else (t.shape[1], t.shape[0])
        if cp_size > 1 and s % 2:
            raise ValueError(f"{name}: with cp_size > 1 the local sequence length must be even, got {s}")
        if s > 0 and _max_position(s, cp_size, cp_rank) >= s2:
            raise ValueError(f"{freqs_name}: too short: positions reach {_max_position(s, cp_size, cp_rank)} "
                             f"but {freqs_name} has s2 = {s2} rows")

    if start_positions is not None:
        check_index_tensor("start_positions", start_positions, t)
        if start_positions.shape[0] != n_pos:
            what = "the number of sequences" if tensor_format == "thd" else "the batch size"
            raise ValueError(f"start_positions: expected shape [{n_pos}] ({what}), "
                             f"got {tuple(start_positions.shape)}")
    return te_layout(t, freqs, tensor_format, cu_seqlens)


def te_layout(t, freqs, tensor_format, cu_seqlens) -> Layout:
    """The layout of a TransformerEngine call whose arguments `check_static` passed (unchecked: the reference path
    reads it after the front end's checks)."""
    if tensor_format == "thd":
        s, b, h, n_seqs = t.shape[0], 1, t.shape[1], cu_seqlens.shape[0] - 1
    else:
        s, b = (t.shape[0], t.shape[1]) if tensor_format == "sbhd" else (t.shape[1], t.shape[0])
        h, n_seqs = t.shape[2], 0
    return Layout(s=s, b=b, h=h, d=t.shape[-1], rot_dim=freqs.shape[3], freqs_len=freqs.shape[0], n_seqs=n_seqs)


def check_inplace(name: str, x: torch.Tensor, leaf_written: bool = False) -> None:
    """In-place rotation needs every element stored once, and autograd must be able to record it: checked
    here, before the kernel writes, since autograd itself refuses only after a Function's forward ran.
    `leaf_written`: the convention writes a leaf that requires grad as flash-attention does (`rope._backend.write_leaf`:
    the leaf keeps no history to rebase, the rotation's node goes on a new tensor over its memory); views of such a
    leaf stay refused, as autograd refuses to write them in place."""
    # Traced, the call runs PyTorch's own in-place operations, which functionalization and autograd check (the overlap
    # and view queries have no graph).
    if not torch.compiler.is_compiling() and torch._debug_has_internal_overlap(x) == 1:
        raise ValueError(f"{name}: in-place rotation needs a tensor whose elements do not overlap in memory "
                         f"(an expanded or stride-0 view was given, strides {tuple(x.stride())})")
    if x.requires_grad and torch.is_grad_enabled():
        if x.is_leaf and not leaf_written:
            raise ValueError(f"{name}: in-place rotation of a leaf tensor that requires grad; rotate a copy, or "
                             f"use inplace=False")
        if not x.is_leaf and not torch.compiler.is_compiling() and x._is_view() and not _rebasable(x):
            raise ValueError(f"{name}: in-place rotation of a view that autograd does not let be modified in place "
                             f"(a view of a leaf that requires grad, or an output of split/unbind/chunk); rotate a "
                             f"copy, or use inplace=False")


_CREATION_META = getattr(torch._C._autograd, "_get_creation_meta", None)


def _rebasable(view: torch.Tensor) -> bool:
    """Whether autograd lets this view of a tensor that requires grad be modified in place (its rules in
    `check_inplace` of torch/csrc/autograd/VariableTypeUtils.h): not a view of a leaf, and made by a view
    function of one output in grad mode."""
    if view._base.is_leaf:
        return False
    return _CREATION_META is None or _CREATION_META(view) == torch._C._autograd.CreationMeta.DEFAULT


def _span(x: torch.Tensor) -> tuple:
    lo = hi = x.storage_offset()
    for n, st in zip(x.shape, x.stride(), strict=True):
        (lo, hi) = (lo + (n - 1) * st, hi) if st < 0 else (lo, hi + (n - 1) * st)
    return lo, hi


_DISJOINT = _memo.memo("disjointness of q and k views", 64)


def _same_stride_views_overlap(shape_q, shape_k, strides, delta) -> bool | None:
    """Whether two views with these strides, whose first elements are delta apart, share an element:
    delta = sum c_j * stride_j with -(nk_j - 1) <= c_j <= nq_j - 1. A depth-first search over the dims,
    largest stride first, each c_j confined to what the smaller dims can still make up for; None if it
    takes too long to decide."""
    dims = sorted((abs(st), nq, nk) for st, nq, nk in zip(strides, shape_q, shape_k, strict=True)
                  if st != 0 and (nq > 1 or nk > 1))[::-1]
    reach = [0] * (len(dims) + 1)  # reach[j]: the most that dims j.. can add or take away
    for j in range(len(dims) - 1, -1, -1):
        st, nq, nk = dims[j]
        reach[j] = reach[j + 1] + st * max(nq - 1, nk - 1)
    budget = [10_000]

    def search(j, rest) -> bool | None:
        if j == len(dims):
            return rest == 0
        budget[0] -= 1
        if budget[0] < 0:
            return None
        st, nq, nk = dims[j]
        lo = max(-(nk - 1), -((reach[j + 1] - rest) // st))  # ceil((rest - reach) / st)
        hi = min(nq - 1, (rest + reach[j + 1]) // st)
        for c in range(lo, hi + 1):
            found = search(j + 1, rest - c * st)
            if found is not False:
                return found
        return False

    return search(0, delta)


def check_disjoint(q: torch.Tensor, k: torch.Tensor, names: tuple = ("q", "k")) -> None:
    """In-place q and k in one launch must not share an element (their rows go to different
    programs, which would race). Separate buffers pass at once; views of one buffer (q and k sliced
    from a fused qkv projection) are decided exactly when they have the same strides, and refused
    when that cannot be shown (different strides)."""
    if torch.compiler.is_compiling():  # traced: storage addresses have no graph (PyTorch's in-place ops run there)
        return
    if q.numel() == 0 or k.numel() == 0 or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return
    (q_lo, q_hi), (k_lo, k_hi) = _span(q), _span(k)
    if q_hi < k_lo or k_hi < q_lo:
        return
    delta = k.storage_offset() - q.storage_offset()
    key = (q.shape, k.shape, q.stride(), k.stride(), delta)
    overlap = _DISJOINT.get(key)
    if overlap is None:
        # A dim of size 1 in one view has no stride that matters there (views give such dims any stride): the
        # other's stride stands for both. Other strides, or undecided (None): counted as sharing.
        strides = tuple(sq if nq > 1 else sk for sq, sk, nq in zip(q.stride(), k.stride(), q.shape, strict=True))
        same = all(sk == st for sk, st, nk in zip(k.stride(), strides, k.shape, strict=True) if nk > 1)
        overlap = not same or _same_stride_views_overlap(q.shape, k.shape, strides, delta) is not False
        _DISJOINT.put(key, overlap)
    if overlap:
        raise ValueError(f"{names[1]}: in-place rotation of {names[0]} and {names[1]} that share memory (or whose "
                         f"strides differ, so that they cannot be shown not to); pass disjoint tensors")


def check_pair(q, k, tensor_format: str) -> None:
    """q and k of one call: same tokens, head dim, dtype and device; head counts may differ."""
    if not isinstance(k, torch.Tensor):
        raise TypeError(f"k: expected a torch.Tensor, got {type(k).__name__}")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if k.dtype != q.dtype:
        raise TypeError(f"k: expected the dtype of q ({q.dtype}), got {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"k: expected the device of q ({q.device}), got {k.device}")
    if k.dim() != q.dim() or k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected the tokens and head dim of q (shape {tuple(q.shape)}, heads may differ), "
                         f"got shape {tuple(k.shape)}")


def check_index_tensor(name, x, t, t_name="t"):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INT_DTYPES:
        raise TypeError(f"{name}: expected dtype int32 or int64, got {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(x.shape)}")
    if x.device != t.device:
        raise ValueError(f"{name}: expected the device of {t_name} ({t.device}), got {x.device}")


def _max_position(length: int, cp_size: int, cp_rank: int) -> int:
    """Largest position a sequence of local length `length` reaches (docs/contract.md section 3)."""
    if cp_size == 1:
        return length - 1
    c = length // 2
    return (2 * cp_size - cp_rank) * c - 1


_VALUE_CHECKS = [True]


def set_value_checks(enabled: bool) -> None:
    """Turn the checks on the values of `cu_seqlens`/`start_positions` on or off (default on).

    They cost one device-to-host copy for each new (or modified) index tensor on the GPU, on every call
    for inference tensors (no version counter). With them off, a position outside `freqs` is still never
    read: the kernel writes NaN into that token's rotated channels instead.
    """
    check_bools(enabled=enabled)
    _VALUE_CHECKS[0] = enabled


def skip_value_checks(index: torch.Tensor) -> bool:
    """True when value checks are off, or while reading device values would break a capture or
    trace (`index`: the call's cu_seqlens or start_positions)."""
    if not _VALUE_CHECKS[0] or torch.compiler.is_compiling():
        return True
    return index.is_cuda and capturing_on(index.get_device())


# Index tensors whose values passed, by identity and version counter: every layer of a step (and q and
# k) passes the same `cu_seqlens`/`start_positions`. A write PyTorch does not count (`.data`, DLPack, a
# foreign kernel) is not checked again; the kernel's range guard remains.
_PASSED = _memo.memo("index tensors whose values passed", 64)


def _stamp(x):
    if x is None:
        return None
    if x.is_inference():
        return False
    return weakref.ref(x), x._version


def _still(stamp, x) -> bool:
    return stamp is None if x is None else (stamp is not False and stamp[0]() is x and stamp[1] == x._version)


def check_positions(layout: Layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank,
                    names=("freqs", "start_positions")):
    """Checks on the values of `cu_seqlens` and `start_positions` (one device-to-host copy, then
    none while the same tensors are passed again unmodified). `names`: what the caller's convention
    calls the angle table and the start positions, for the messages."""
    if (cu_seqlens is None and start_positions is None) or torch.compiler.is_compiling():
        return  # traced: the memo below (a weak reference, a version counter) has no graph
    # Tensors that passed come first: the lookup is cheaper than asking whether a graph is being
    # captured, and a tensor that passed needs no copy, captured or not.
    key = (id(start_positions), id(cu_seqlens), layout, tensor_format, cp_size, cp_rank)
    seen = _PASSED.get(key)
    if seen is not None and _still(seen[0], start_positions) and _still(seen[1], cu_seqlens):
        return
    if skip_value_checks(cu_seqlens if cu_seqlens is not None else start_positions):
        return
    _check_position_values(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, *names)
    stamps = (_stamp(start_positions), _stamp(cu_seqlens))
    if False not in stamps:
        _PASSED.put(key, stamps)


def _check_position_values(layout: Layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, table_name,
                           start_name):
    s, s2 = layout.s, layout.freqs_len
    if tensor_format == "thd":
        cu = cu_seqlens.to(torch.int64)
        lengths = cu[1:] - cu[:-1]
        local = lengths // cp_size
        no = torch.zeros((), dtype=torch.bool, device=cu.device)
        sp = start_positions.to(torch.int64) if start_positions is not None else 0
        flags = [cu[0] != 0, (lengths < 0).any(), cu[-1] != s * cp_size,
                 (lengths % (2 * cp_size) != 0).any() if cp_size > 1 else no,
                 ((local > 0) & (sp < 0)).any() if start_positions is not None else no]
        # the context-parallel position of a sequence's last local token, then its start (section 3)
        last = torch.where(local > 0, _max_position(local, cp_size, cp_rank) + sp, -1)  # empty: no position
        # no token at all (no sequence, or only empty ones): no position, so any s2 >= 0 is enough
        top = last.max() if last.numel() else torch.full((), -1, dtype=torch.int64, device=cu.device)
        values = torch.stack([f.to(torch.int64) for f in flags] + [top.to(torch.int64)]).tolist()
        bad_start, bad_order, bad_total, bad_cp, bad_neg, max_pos = values
        if bad_start:
            raise ValueError("cu_seqlens: must start at 0")
        if bad_order:
            raise ValueError("cu_seqlens: must be non-decreasing")
        if bad_total:
            raise ValueError(f"cu_seqlens: last value must equal t.shape[0] * cp_size = {s * cp_size}, "
                             f"got {int(cu_seqlens[-1])}")
        if bad_cp:
            raise ValueError(f"cu_seqlens: with cp_size = {cp_size} every sequence length must be a "
                             f"multiple of 2 * cp_size = {2 * cp_size}")
        if bad_neg:
            raise ValueError(f"{start_name}: must be >= 0")
        if max_pos >= s2:
            raise ValueError(f"{table_name}: too short: positions reach {max_pos} but {table_name} has {s2} rows")
    elif start_positions is not None and s > 0 and layout.b > 0:
        lo, hi = torch.stack(torch.aminmax(start_positions)).tolist()
        if lo < 0:
            raise ValueError(f"{start_name}: must be >= 0, got {lo}")
        top = hi + _max_position(s, cp_size, cp_rank)
        if top >= s2:
            raise ValueError(f"{table_name}: too short: {start_name} reach {hi}, so positions reach "
                             f"{top}, but {table_name} has {s2} rows")



def check_tables(cos, sin, x, x_name: str, names=("cos", "sin")) -> None:
    """cos and sin tables of one shape, dtype (float32, float16 or bfloat16) and strides, on x's device."""
    for name, tab in zip(names, (cos, sin), strict=True):
        if not isinstance(tab, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tab).__name__}")
        if tab.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16, got {tab.dtype}")
        if tab.device != x.device:
            raise ValueError(f"{name}: expected the device of {x_name} ({x.device}), got {tab.device}")
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise ValueError(f"{names[1]}: expected the shape and dtype of {names[0]} ({tuple(cos.shape)}, {cos.dtype}), "
                         f"got {tuple(sin.shape)}, {sin.dtype}")


def check_rotary_width(width: int, d: int, what: str) -> None:
    if width < 2 or width % 2 or width > d:
        raise ValueError(f"{what}: the rotary width must be even with 2 <= width <= head dim {d}, got {width}")


def check_token_positions(positions, n_tokens: int, x, x_name: str, name: str = "positions") -> None:
    """One int32/int64 position per token, on x's device."""
    check_index_tensor(name, positions, x, x_name)
    if positions.shape[0] != n_tokens:
        raise ValueError(f"{name}: expected {n_tokens} positions (one per token of {x_name}), "
                         f"got {positions.shape[0]}")


def check_positions_in(positions, rows: int, name: str = "positions", table: str = "cos_sin_cache") -> None:
    """Every position in [0, rows): one device-to-host copy per new or modified tensor, skipped while
    that would break a capture or trace (the kernel then writes NaN for a position outside)."""
    if torch.compiler.is_compiling():  # the memo (a weak reference, a version counter) has no graph
        return
    key = (id(positions), rows, name)
    seen = _PASSED.get(key)
    if (seen is not None and _still(seen[0], positions)) or positions.numel() == 0 or skip_value_checks(positions):
        return
    lo, hi = torch.stack(torch.aminmax(positions)).tolist()
    if lo < 0 or hi >= rows:
        raise ValueError(f"{name}: expected positions in [0, {rows}) (the rows of {table}), got values in "
                         f"[{lo}, {hi}]")
    stamp = _stamp(positions)
    if stamp is not False:
        _PASSED.put(key, (stamp,))


def check_packed_values(cu_seqlens, positions, rows: int, names=("cu_seqlens_q", "cos")) -> None:
    """Megatron's packed sequences (rope.megatron): `cu_seqlens` starting at 0 and non-decreasing, and `positions`,
    the table row of each token derived from it, within the table's `rows`. One device-to-host copy, then none while
    the same tensors are passed again unmodified; skipped where a capture or trace would break (the kernel then writes
    NaN for a row outside the table). Tokens past the last sequence are allowed: Megatron gives them position 0."""
    if torch.compiler.is_compiling():  # the memo (a weak reference, a version counter) has no graph
        return
    key = (id(cu_seqlens), id(positions), rows, names)
    seen = _PASSED.get(key)
    if (seen is not None and _still(seen[0], cu_seqlens) and _still(seen[1], positions)) or \
            skip_value_checks(cu_seqlens):
        return
    cu = cu_seqlens.to(torch.int64)
    no = torch.zeros((), dtype=torch.bool, device=cu.device)
    top = positions.max() if positions.numel() else torch.full((), -1, dtype=torch.int64, device=cu.device)
    flags = [cu[0] != 0, (cu[1:] < cu[:-1]).any() if cu.numel() > 1 else no, top.to(torch.int64)]
    bad_start, bad_order, max_pos = torch.stack([f.to(torch.int64) for f in flags]).tolist()
    if bad_start:
        raise ValueError(f"{names[0]}: must start at 0")
    if bad_order:
        raise ValueError(f"{names[0]}: must be non-decreasing")
    if max_pos >= rows:
        raise ValueError(f"{names[1]}: too short: positions reach {max_pos} but {names[1]} has {rows} rows")
    stamps = (_stamp(cu_seqlens), _stamp(positions))
    if False not in stamps:
        _PASSED.put(key, stamps)


def check_mrope_section(mrope_section, pairs: int, mrope_interleaved, name: str = "mrope_section") -> tuple:
    """Multimodal RoPE's sections (docs/contract.md section 7b) -> the kernel's (MROPE, SEC0, SEC1, SEC2):
    three counts of rotary pairs (temporal, height, width) covering all `pairs`. Interleaved, stream m
    takes pairs m, m + 3, ... below 3 * section[m], which must hold section[m] of them."""
    if not isinstance(mrope_interleaved, bool):
        raise TypeError(f"mrope_interleaved: expected a bool, got {type(mrope_interleaved).__name__}")
    if not isinstance(mrope_section, (list, tuple)) or len(mrope_section) != 3 or \
            any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in mrope_section):
        raise ValueError(f"{name}: expected three ints >= 0 (rotary pairs per stream: temporal, height, width), "
                         f"got {mrope_section!r}")
    if sum(mrope_section) != pairs:
        raise ValueError(f"{name}: the sections must cover the {pairs} rotary pairs (half the rotary width), "
                         f"got {list(mrope_section)} (sum {sum(mrope_section)})")
    if mrope_interleaved:
        for m in (1, 2):
            held = len(range(m, min(3 * mrope_section[m], pairs), 3))
            if held != mrope_section[m]:
                raise ValueError(f"{name}: interleaved, stream {m} takes pairs {m}, {m + 3}, ... below "
                                 f"3 * {mrope_section[m]}: only {held} of the {pairs} pairs, not {mrope_section[m]}")
    return (2 if mrope_interleaved else 1, *mrope_section)


def check_stream_positions(positions, lead: tuple, x, x_name: str, name: str = "positions") -> None:
    """Positions of the three streams, [3, *lead], or of one stream for all three (text), [*lead];
    int32/int64 on x's device."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(positions).__name__}")
    if positions.dtype not in INT_DTYPES:
        raise TypeError(f"{name}: expected dtype int32 or int64, got {positions.dtype}")
    if tuple(positions.shape) not in (tuple(lead), (3, *lead)):
        dims = ", ".join(map(str, lead))
        raise ValueError(f"{name}: expected shape [3, {dims}] (temporal, height, width) or [{dims}] (one stream "
                         f"for all three), the leading dims of {x_name}; got {tuple(positions.shape)}")
    if positions.device != x.device:
        raise ValueError(f"{name}: expected the device of {x_name} ({x.device}), got {positions.device}")


def check_cos_sin_cache(cache, d: int, x, x_name: str, rope_dim=None) -> tuple:
    """vLLM's cos_sin_cache [max_position, rot] (row p: the rot/2 cosines of position p, then their sines; rot even,
    rot <= the head dim d; SGLang's `rope_dim`: 0 or rot) -> (its cos half, its sin half, max_position)."""
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2:
        raise ValueError(f"cos_sin_cache: expected shape [max_position, rotary_dim], got "
                         f"{getattr(cache, 'shape', type(cache).__name__)}")
    rows, rot = cache.shape
    if rope_dim is not None and (isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or
                                 rope_dim not in (0, rot)):
        raise ValueError(f"rope_dim: expected 0 or cos_sin_cache's width {rot} (the rotary width), got {rope_dim!r}")
    check_rotary_width(rot, d, "cos_sin_cache")
    cos, sin = cache[:, :rot // 2], cache[:, rot // 2:]
    check_tables(cos, sin, x, x_name, ("cos_sin_cache", "cos_sin_cache"))
    return cos, sin, rows


_SHAPES = {1: "[b, h, s, d]", 2: "[b, s, h, d]"}


# The layouts of the conventions' rotated tensors

def heads_views(named, unsqueeze_dim) -> tuple:
    """transformers' rotated tensors ((name, tensor), ...: q and k, or x), [b, h, s, d] (unsqueeze_dim 1) or
    [b, s, h, d] (2), as [b, s, h, d] views (the kernel's bshd roles), checked."""
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int) or unsqueeze_dim not in _SHAPES:
        raise ValueError(f"unsqueeze_dim: expected 1 (q, k as {_SHAPES[1]}) or 2 ({_SHAPES[2]}), got {unsqueeze_dim!r}")
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor {_SHAPES[unsqueeze_dim]}, got shape {tuple(x.shape)}")
    views = tuple(x.transpose(1, 2) if unsqueeze_dim == 1 else x for _, x in named)
    if len(views) == 2:
        check_pair(*views, "bshd")
    return views


def check_rotary_tables(cos, sin, views, x_name: str, stream_dims: int) -> None:
    """transformers' cos, sin [b or 1, s, r] (with stream_dims = 1: [3, b or 1, s, r], one table per stream) for the
    views' b and s, r even with 2 <= r <= d. A rank-2 [s, r] table (Liger's extension) is refused: transformers'
    expression would broadcast it over the heads, not the positions."""
    check_tables(cos, sin, views[0], x_name)
    b, s, _, d = views[0].shape
    streams = "3, " if stream_dims else ""
    if cos.dim() != 3 + stream_dims or (stream_dims and cos.shape[0] != 3) or cos.shape[-2] != s or \
            cos.shape[-3] not in (1, b):
        hint = " (a table [s, r] for every sequence is cos[None])" if cos.dim() == 2 and not stream_dims else ""
        what = " (one table per stream)" if stream_dims else ""
        raise ValueError(f"cos: expected shape [{streams}b, s, r]{what} with b = {b} or 1, s = {s} and the rotary "
                         f"width r <= d = {d}, got {tuple(cos.shape)}{hint}")
    check_rotary_width(cos.shape[-1], d, "cos")


def check_heads_pair(q, k, names: tuple, ndim: int, shape: str) -> None:
    """q and k of one call, [..., heads, d] with `ndim` dims: float32/float16/bfloat16 tensors of one dtype and
    device, the same leading dims and an even head dim d; head counts may differ."""
    for name, x in zip(names, (q, k), strict=True):
        check_float_tensor(name, x)
        if x.dim() != ndim:
            raise ValueError(f"{name}: expected a {ndim}-D tensor {shape}, got shape {tuple(x.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"{names[1]}: expected the dtype of {names[0]} ({q.dtype}), got {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"{names[1]}: expected the device of {names[0]} ({q.device}), got {k.device}")
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{names[1]}: expected the tokens and head dim of {names[0]} (shape {tuple(q.shape)}, "
                         f"heads may differ), got shape {tuple(k.shape)}")
    if q.shape[-1] % 2 or q.shape[-1] == 0:
        raise ValueError(f"{names[0]}: rotary pairs are channels (2i, 2i + 1): expected an even head dim, got "
                         f"{q.shape[-1]}")


def complex_tables(freqs_cis, x, x_name: str, name: str = "freqs_cis"):
    """(cos, sin): the real and imaginary parts of complex64 `freqs_cis` as float32 views (stride 2 in
    `view_as_real`'s memory), no copy; a lazily conjugated or negated tensor is resolved first (one copy)."""
    if not isinstance(freqs_cis, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(freqs_cis).__name__}")
    if freqs_cis.dtype != torch.complex64:
        why = " (float64 math is refused on every path; convert with .to(torch.complex64))" \
            if freqs_cis.dtype == torch.complex128 else ""
        raise TypeError(f"{name}: expected dtype complex64 (torch.polar of float32 angles){why}, got "
                        f"{freqs_cis.dtype}")
    if freqs_cis.device != x.device:
        raise ValueError(f"{name}: expected the device of {x_name} ({x.device}), got {freqs_cis.device}")
    parts = torch.view_as_real(freqs_cis.resolve_conj().resolve_neg())  # each the tensor itself unless its bit is set
    return parts[..., 0], parts[..., 1]


def view_heads(x, positions, head_size):
    """x as [num_tokens, heads, head_size], unchecked (`heads_view` checks it)."""
    rest = x.shape[positions.dim():]
    return x.view(positions.numel(), rest[0] if len(rest) == 2 else rest[0] // head_size, head_size)


def heads_view(name, x, positions, head_size):
    """vLLM's x ([*positions.shape, heads * head_size] or [..., heads, head_size]) as [num_tokens, heads, head_size]
    (a view)."""
    check_float_tensor(name, x)
    lead = positions.dim()
    rest = x.shape[lead:]
    if x.shape[:lead] != positions.shape or len(rest) not in (1, 2) or rest[-1] % head_size or \
            (len(rest) == 2 and rest[-1] != head_size):
        raise ValueError(f"{name}: expected [{', '.join(map(str, positions.shape))}, heads * {head_size}] or "
                         f"[..., heads, {head_size}] (leading dims as positions'), got {tuple(x.shape)}")
    try:
        return view_heads(x, positions, head_size)
    except RuntimeError:
        raise ValueError(f"{name}: cannot be viewed as [num_tokens, heads, head_size] (strides "
                         f"{tuple(x.stride())}); pass a tensor whose heads are evenly strided") from None


# QK norm fused with RoPE (rope.qknorm)



def check_norm(q, q_weight, k_weight, eps, names=("q_weight", "k_weight")) -> None:
    """Weights [d] (d: q's head dim) of a float dtype on q's device; eps a finite number > 0."""
    d = q.shape[-1]
    for name, w in zip(names, (q_weight, k_weight), strict=True):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
        if w.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16, got {w.dtype}")
        if tuple(w.shape) != (d,):
            raise ValueError(f"{name}: expected shape [{d}] (the head dim), got {tuple(w.shape)}")
        if w.device != q.device:
            raise ValueError(f"{name}: expected the device of q ({q.device}), got {w.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps: expected a finite number > 0, got {eps!r}")


def check_table_call(q, k, q_weight, k_weight, cos, sin, eps, unsqueeze_dim, interleaved, gemma,
                     schedule=None) -> None:
    """`rope.qknorm.apply`'s arguments (static: `rope._backend.check_once` runs it once per signature)."""
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in _SHAPES:
        raise ValueError(f"unsqueeze_dim: expected 1 (q, k as {_SHAPES[1]}) or 2 ({_SHAPES[2]}), got {unsqueeze_dim!r}")
    check_bools(interleaved=interleaved, gemma=gemma)
    for name, x in (("q", q), ("k", k)):
        check_float_tensor(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor {_SHAPES[unsqueeze_dim]}, got shape {tuple(x.shape)}")
    qv, kv = (q.transpose(1, 2), k.transpose(1, 2)) if unsqueeze_dim == 1 else (q, k)
    check_pair(qv, kv, "bshd")
    check_norm(q, q_weight, k_weight, eps)
    check_tables(cos, sin, q, "q")
    b, s, _, d = qv.shape
    if cos.dim() != 3 or cos.shape[1] != s or cos.shape[0] not in (1, b):
        raise ValueError(f"cos: expected shape [b, s, rot] with b = {b} or 1, s = {s}, got {tuple(cos.shape)}")
    check_rotary_width(cos.shape[-1], d, "cos")
    check_norm_schedule(schedule, q, (("q_weight", q_weight), ("k_weight", k_weight), ("cos", cos), ("sin", sin)))


def check_norm_schedule(schedule, q, same_dtype) -> None:
    """QK norm's schedules: None, or "eager" with the weights and tables in q's dtype (a model's, whose eager
    expression keeps it) and rows that PyTorch's CUDA reduction reads from an aligned start (d < 128 or a
    multiple of 4)."""
    if schedule is None:
        return
    if schedule != "eager":
        raise ValueError(f"schedule: expected None or 'eager' (QK norm has no other), got {schedule!r}")
    for name, t in same_dtype:
        if t.dtype != q.dtype:
            raise ValueError(f"schedule: 'eager' reproduces a model run in one dtype: {name} is {t.dtype}, q "
                             f"{q.dtype}")
    d = q.shape[-1]
    if d >= 128 and d % 4:
        raise ValueError(f"schedule: 'eager' needs a head dim below 128 or a multiple of 4 (PyTorch's CUDA "
                         f"reduction reads rows from d = 128 on as vectors of 4 from an aligned start), got {d}")


def check_freqs_call(q, k, q_weight, k_weight, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
                     cp_rank, eps, gemma, check_signature=None):
    """`rope.qknorm.apply_freqs`'s arguments, in one order on every path: q and k (float64 refused), TransformerEngine's
    checks of each against freqs (angles [s2, 1, 1, rot]) naming q and k, gemma, the weights and eps, then the values
    of cu_seqlens and start_positions. `check_signature(x, freqs, ..., cp_rank, name)`: the memoised check of the
    kernel path (`rope._backend.checked_call`), returning a `Call`; without it `check_static`. Returns q's `Call`,
    or its Layout."""
    for name, x in (("q", q), ("k", k)):
        check_float_tensor(name, x)
    check_pair(q, k, tensor_format)
    args = (freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
    if check_signature is not None:
        call = check_signature(q, *args, "q")
        check_signature(k, *args, "k")
        layout = call.layout
    else:
        call = layout = check_static(q, *args, allow_float64=False, name="q")
        check_static(k, *args, allow_float64=False, name="k")
    check_bools(gemma=gemma)
    check_norm(q, q_weight, k_weight, eps)
    check_positions(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    return call


def check_cache_call(q, k, q_weight, k_weight, positions, cache, eps, is_neox, gemma, names=("q", "positions"),
                     mrope=None):
    """q [T, hq, d], k [T, hk, d], positions [T], cos_sin_cache [max_position, rot]; returns (its cos half, its
    sin half, max_position, the kernel's streams). `names`: what the caller calls q and positions (vLLM: qkv,
    position_ids). `mrope`: (mrope_section, mrope_interleaved) of multimodal RoPE, positions [3, T] or [T]."""
    check_bools(is_neox=is_neox, gemma=gemma)
    section, mrope_interleaved = (None, False) if mrope is None else mrope
    if not isinstance(mrope_interleaved, bool):
        raise TypeError(f"mrope_interleaved: expected a bool, got {type(mrope_interleaved).__name__}")
    if section is None:
        if mrope_interleaved:
            raise ValueError("mrope_interleaved: expected False without mrope_section (it orders the sections)")
        if isinstance(positions, torch.Tensor) and positions.dim() == 2:
            raise ValueError(f"{names[1]}: shape {tuple(positions.shape)} holds position streams (multimodal "
                             f"RoPE, [3, T]): pass mrope_section, the rotary pairs per stream")
    for name, x in (("q", q), ("k", k)):
        check_float_tensor(name, x)
        if x.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor [T, h, d], got shape {tuple(x.shape)}")
    check_pair(q, k, "thd")
    check_norm(q, q_weight, k_weight, eps)
    if section is None:
        check_token_positions(positions, q.shape[0], q, names[0], names[1])
    else:
        check_stream_positions(positions, (q.shape[0],), q, names[0], names[1])
    cos, sin, rows = check_cos_sin_cache(cache, q.shape[-1], q, names[0])
    rot = 2 * cos.shape[1]
    streams = (0, 0, 0, 0) if section is None else check_mrope_section(section, rot // 2, mrope_interleaved)
    return cos, sin, rows, streams


def check_packed(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim):
    """vLLM's packed qkv [T, (hq + hk + hv) * head_dim]: (q, k) as [T, h, head_dim] views, checked disjoint."""
    for name, v, low in (("num_heads_q", num_heads_q, 1), ("num_heads_k", num_heads_k, 1),
                         ("num_heads_v", num_heads_v, 0), ("head_dim", head_dim, 2)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {v!r}")
    check_float_tensor("qkv", qkv)
    width = (num_heads_q + num_heads_k + num_heads_v) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv: expected shape [T, (num_heads_q + num_heads_k + num_heads_v) * head_dim] = "
                         f"[T, {width}], got {tuple(qkv.shape)}")
    if qkv.stride(1) != 1:
        raise ValueError(f"qkv: expected unit channel stride, got strides {tuple(qkv.stride())}")
    hd = head_dim
    q = qkv[:, :num_heads_q * hd].unflatten(1, (num_heads_q, hd))
    k = qkv[:, num_heads_q * hd:(num_heads_q + num_heads_k) * hd].unflatten(1, (num_heads_k, hd))
    check_disjoint(q, k, ("qkv", "qkv"))
    return q, k


# RoPE fused with the KV-cache write (rope.serving)

CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8 = torch.float8_e4m3fn


def check_kv_cache(name: str, cache, shape: tuple, x, fp8: bool, x_name: str = "query"):
    """A cache of `shape` on x's device, in x's dtype (auto) or float8_e4m3fn (uint8 viewed as it); returns it."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
    if tuple(cache.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {tuple(cache.shape)}")
    if cache.device != x.device:
        raise ValueError(f"{name}: expected the device of {x_name} ({x.device}), got {cache.device}")
    if fp8:
        if cache.dtype not in (FP8, torch.uint8):
            raise TypeError(f"{name}: an fp8 cache holds float8_e4m3fn (or its bytes as uint8), got {cache.dtype}")
        cache = cache.view(FP8)
    elif cache.dtype != x.dtype:
        raise TypeError(f"{name}: kv_cache_dtype 'auto' stores the model's dtype {x.dtype}, got {cache.dtype}")
    check_inplace(name, cache)
    return cache


def check_scale(name: str, scale, x):
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name}: an fp8 cache needs a float32 tensor of one element, got {type(scale).__name__}")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(f"{name}: expected a float32 tensor of one element, got {scale.dtype} {tuple(scale.shape)}")
    if scale.device != x.device:
        raise ValueError(f"{name}: expected the device of query ({x.device}), got {scale.device}")
    return scale.reshape(1)


def check_output(name: str, out, shape: tuple, x, x_name: str) -> None:
    """A buffer the caller gives for a result: a tensor of the result's shape, in x's dtype and on x's device."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != x.dtype:
        raise TypeError(f"{name}: expected the dtype of {x_name} ({x.dtype}), got {out.dtype}")
    if out.device != x.device:
        raise ValueError(f"{name}: expected the device of {x_name} ({x.device}), got {out.device}")


def check_own_memory(name: str, out: torch.Tensor, others: dict) -> None:
    """A result buffer the call writes element by element: outside autograd's graph (a buffer that requires grad
    would be a leaf written in place), its elements stored once, and no memory shared with `others` ({name: tensor},
    read or written beside it), which would be read after being overwritten. Spans are compared, so disjoint views
    of one buffer whose spans interleave are refused too."""
    if out.requires_grad:
        raise ValueError(f"{name}: must not require grad (a buffer the call writes its result into)")
    if torch.compiler.is_compiling():  # traced: storage addresses have no graph
        return
    if torch._debug_has_internal_overlap(out) == 1:
        raise ValueError(f"{name}: its elements overlap in memory (an expanded or stride-0 view, strides "
                         f"{tuple(out.stride())}): it cannot hold a result")
    for other_name, other in others.items():
        if other is None or not out.numel() or not other.numel() or \
                out.untyped_storage().data_ptr() != other.untyped_storage().data_ptr():
            continue
        (lo, hi), (olo, ohi) = _byte_span(out), _byte_span(other)
        if lo <= ohi and olo <= hi:
            raise ValueError(f"{name}: shares memory with {other_name}; pass a buffer of its own")


def _byte_span(x: torch.Tensor) -> tuple:
    lo, hi = _span(x)
    return lo * x.element_size(), (hi + 1) * x.element_size() - 1


def check_no_grad(**tensors) -> None:
    """The op writes in place and has no backward."""
    if torch.is_grad_enabled():
        for name, x in tensors.items():
            if x.requires_grad:
                raise ValueError(f"{name}: the fused op writes in place and has no backward; call it under "
                                 f"torch.no_grad()")


def check_vllm(positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox,
               kv_cache_dtype, k_scale, v_scale):
    """vLLM's form -> (q, k, v as [T, h, d] views, the caches [num_blocks, block_size, hk, d] (fp8 as
    float8_e4m3fn), cos, sin, max_position, fp8, k_scale, v_scale as [1])."""
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of {CACHE_DTYPES}, got {kv_cache_dtype!r}")
    fp8 = kv_cache_dtype != "auto"
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions: expected a torch.Tensor, got {type(positions).__name__}")
    if positions.dim() != 1:
        raise ValueError(f"positions: expected shape [num_tokens], got {tuple(positions.shape)}")
    if not isinstance(key_cache, torch.Tensor) or key_cache.dim() != 4:
        raise ValueError(f"key_cache: expected shape [num_blocks, block_size, num_kv_heads, head_size], got "
                         f"{getattr(key_cache, 'shape', type(key_cache).__name__)}")
    hk, d = key_cache.shape[2], key_cache.shape[3]
    q = heads_view("query", query, positions, d)
    k, v = heads_view("key", key, positions, d), heads_view("value", value, positions, d)
    for name, x in (("key", k), ("value", v)):
        if x.shape[1] != hk:
            raise ValueError(f"{name}: expected num_kv_heads = {hk} heads (key_cache's), got {x.shape[1]}")
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name}: expected the dtype and device of query ({q.dtype}, {q.device}), got "
                             f"{x.dtype}, {x.device}")
    check_no_grad(query=query, key=key, value=value)
    check_token_positions(positions, q.shape[0], q, "query")
    cos, sin, rows = check_cos_sin_cache(cos_sin_cache, d, q, "query")
    kc = check_kv_cache("key_cache", key_cache, key_cache.shape, q, fp8)
    vc = check_kv_cache("value_cache", value_cache, key_cache.shape, q, fp8)
    check_index_tensor("slot_mapping", slot_mapping, q, "query")
    if slot_mapping.shape[0] > q.shape[0]:
        raise ValueError(f"slot_mapping: expected at most num_tokens = {q.shape[0]} slots, got "
                         f"{slot_mapping.shape[0]}")
    ks = check_scale("k_scale", k_scale, q) if fp8 else None
    vs = check_scale("v_scale", v_scale, q) if fp8 else None
    check_inplace("query", q)
    check_inplace("key", k)
    check_disjoint(q, k, ("query", "key"))
    check_disjoint(kc, vc, ("key_cache", "value_cache"))
    return q, k, v, kc, vc, cos, sin, rows, fp8, ks, vs


def check_sglang(q, k, v, k_cache, v_cache, cos_sin_cache, positions, out_loc, is_neox, rope_dim):
    """SGLang's flat pool form -> (q, k, v [T, h, d], the pools as [pool_size, 1, hk, d] (blocks of one slot), cos,
    sin, max_position)."""
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
    for name, x in (("q", q), ("k", k)):
        check_float_tensor(name, x)
        if x.dim() != 3:
            raise ValueError(f"{name}: expected [num_tokens, heads, head_dim], got {tuple(x.shape)}")
    t, hk, d = k.shape
    if q.shape[0] != t or q.shape[2] != d or q.dtype != k.dtype or q.device != k.device:
        raise ValueError(f"k: expected q's tokens, head_dim, dtype and device ({t}, {q.shape[2]}, {q.dtype}, "
                         f"{q.device}), got {tuple(k.shape)} {k.dtype} {k.device}")
    check_float_tensor("v", v)
    if v.dtype != k.dtype or v.device != k.device or tuple(v.shape) not in ((t, hk, d), (t, hk * d)):
        raise ValueError(f"v: expected k's dtype and device and shape [{t}, {hk}, {d}] or [{t}, {hk * d}], got "
                         f"{tuple(v.shape)} {v.dtype} {v.device}")
    v = v.unflatten(1, (hk, d)) if v.dim() == 2 else v
    check_no_grad(q=q, k=k, v=v)
    check_token_positions(positions, t, q, "q")
    cos, sin, rows = check_cos_sin_cache(cos_sin_cache, d, q, "q", rope_dim)
    pools = []
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() not in (2, 3) or c.shape[1:] not in ((hk * d,), (hk, d)):
            raise ValueError(f"{name}: expected shape [pool_size, {hk * d}] or [pool_size, {hk}, {d}] (num_kv_heads "
                             f"= {hk}, head_dim = {d}), got {getattr(c, 'shape', type(c).__name__)}")
        c = check_kv_cache(name, c, c.shape, q, False, "q")
        pools.append((c.unflatten(1, (hk, d)) if c.dim() == 2 else c).unsqueeze(1))
    if pools[1].shape != pools[0].shape:
        raise ValueError(f"v_cache: expected k_cache's pool size {pools[0].shape[0]}, got {pools[1].shape[0]}")
    check_index_tensor("out_loc", out_loc, q, "q")
    if out_loc.shape[0] != t:
        raise ValueError(f"out_loc: expected one slot per token ({t}), got {out_loc.shape[0]}")
    check_inplace("q", q)
    check_inplace("k", k)
    check_disjoint(q, k, ("q", "k"))
    check_disjoint(*pools, ("k_cache", "v_cache"))
    return q, k, v, pools[0], pools[1], cos, sin, rows


def check_slots_in(slots, n_slots: int, low: int, name: str) -> None:
    """Every slot in [low, n_slots) (low -1: vLLM's padding, not stored); as `check_positions_in`, one
    device-to-host copy per new or modified tensor, skipped where that would break a capture or trace."""
    key = (id(slots), n_slots, low, name)
    seen = _PASSED.get(key)
    if (seen is not None and _still(seen[0], slots)) or slots.numel() == 0 or skip_value_checks(slots):
        return
    lo, hi = torch.stack(torch.aminmax(slots)).tolist()
    if lo < low or hi >= n_slots:
        raise ValueError(f"{name}: expected slots in [{low}, {n_slots}) (the cache's slots"
                         f"{', -1: not stored' if low < 0 else ''}), got values in [{lo}, {hi}]")
    stamp = _stamp(slots)
    if stamp is not False:
        _PASSED.put(key, (stamp,))
