"""vLLM's convention: `rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)`, in place.

positions: [num_tokens] (or [b, s]) int32/int64; query, key: [num_tokens, heads * head_size] or
[num_tokens, heads, head_size] (leading dims as positions'); key may be None. cos_sin_cache:
[max_position, rotary_dim], row p = cos of the rotary_dim / 2 angles of position p, then their sin.
is_neox: half-split pairs (i, i + rotary_dim / 2), else interleaved pairs (2i, 2i + 1). Channels from
rotary_dim to head_size are left as they are.
"""
from __future__ import annotations

import torch

from . import reference
from ._apply import apply, kernel_runs
from ._launch import Angles
from ._validate import (
    Call,
    Layout,
    call_for,
    check_disjoint,
    check_inplace,
    check_positions_in,
    check_rotary_width,
    check_tables,
    check_token_positions,
)


def _heads(name, x, positions, head_size):
    """x as [num_tokens, heads, head_size] (a view); its leading dims are positions'."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    lead = positions.dim()
    rest = x.shape[lead:]
    if x.shape[:lead] != positions.shape or len(rest) not in (1, 2) or rest[-1] % head_size or \
            (len(rest) == 2 and rest[-1] != head_size):
        raise ValueError(f"{name}: expected [{', '.join(map(str, positions.shape))}, heads * {head_size}] or "
                         f"[..., heads, {head_size}] (leading dims as positions'), got {tuple(x.shape)}")
    try:
        return x.view(positions.numel(), rest[0] if len(rest) == 2 else rest[0] // head_size, head_size)
    except RuntimeError:
        raise ValueError(f"{name}: cannot be viewed as [num_tokens, heads, head_size] (strides "
                         f"{tuple(x.stride())}); pass a tensor whose heads are evenly strided") from None


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    """vLLM's `rotary_embedding` op: rotates query and key (if not None) in place; returns None."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions: expected a torch.Tensor, got {type(positions).__name__}")
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 2:
        raise ValueError(f"head_size: expected an int >= 2, got {head_size!r}")
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
    n_tokens = positions.numel()
    flat = positions.reshape(-1)
    q = _heads("query", query, positions, head_size)
    k = None if key is None else _heads("key", key, positions, head_size)
    if not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.dim() != 2:
        raise ValueError(f"cos_sin_cache: expected shape [max_position, rotary_dim], got "
                         f"{getattr(cos_sin_cache, 'shape', type(cos_sin_cache).__name__)}")
    rows, rot = cos_sin_cache.shape
    check_rotary_width(rot, head_size, "cos_sin_cache")
    cos, sin = cos_sin_cache[:, :rot // 2], cos_sin_cache[:, rot // 2:]
    check_tables(cos, sin, q, "query", ("cos_sin_cache", "cos_sin_cache"))
    check_token_positions(flat, n_tokens, q, "query")
    if k is not None and (k.dtype != q.dtype or k.device != q.device):
        raise ValueError(f"key: expected the dtype and device of query ({q.dtype}, {q.device}), got "
                         f"{k.dtype}, {k.device}")
    ts = (q,) if k is None else (q, k)
    for name, x in zip(("query", "key")[:len(ts)], ts, strict=True):
        check_inplace(name, x)
    if k is not None:
        check_disjoint(q, k)
    check_positions_in(flat, rows)
    interleaved = not is_neox
    if not kernel_runs(q):
        full = [reference.full_width(tab, interleaved) for tab in (cos, sin)]
        for x in ts:
            x.copy_(reference.rotate_rows(x, *full, flat.long(), "thd", interleaved))
        return None
    key_ = ("vllm", q.shape, q.stride(), q.dtype, q.device, rot, rows, interleaved, flat.dtype)
    call = call_for(key_, lambda: Call(Layout(n_tokens, 1, q.shape[1], head_size, rot, rows, 0), "thd",
                                       interleaved, None, None, 1, 0))
    angles = Angles(cos, sin, rows, cos_sin_cache.stride(0), 0, cos_sin_cache.stride(1), True, True)
    apply(ts, call, angles, None, flat, True, True)
    return None
