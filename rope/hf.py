"""transformers' convention: `apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)`.

q, k: [b, h, s, d] (unsqueeze_dim=1) or [b, s, h, d] (unsqueeze_dim=2), d even; cos, sin: [b, s, d],
already gathered by position (b may be 1), both halves of each row for the half-split pairs
(rotate_half). Returns (q * cos + rotate_half(q) * sin, the same for k).
"""
from __future__ import annotations

import torch

from . import reference
from ._apply import apply, kernel_runs
from ._launch import Angles
from ._validate import Call, Layout, call_for, check_pair, check_tables

_SHAPES = {1: "[b, h, s, d]", 2: "[b, s, h, d]"}


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' `apply_rotary_pos_emb`, with float32 math and one rounding to the output dtype
    (torch's promotion of q's and cos's dtypes, as transformers' expression gives). `position_ids` is
    unused, as in transformers. New tensors; the gradient flows to q and k."""
    if unsqueeze_dim not in _SHAPES:
        raise ValueError(f"unsqueeze_dim: expected 1 (q, k as {_SHAPES[1]}) or 2 ({_SHAPES[2]}), got {unsqueeze_dim!r}")
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor {_SHAPES[unsqueeze_dim]}, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    # [b, s, h, d] views: the kernel's bshd roles
    qv, kv = (q.transpose(1, 2), k.transpose(1, 2)) if unsqueeze_dim == 1 else (q, k)
    check_pair(qv, kv, "bshd")
    check_tables(cos, sin, q, "q")
    b, s, _, d = qv.shape
    if d % 2:
        raise ValueError(f"q: rotate_half pairs channel i with i + d/2: expected an even head dim, got {d}")
    if cos.dim() != 3 or cos.shape[1:] != (s, d) or cos.shape[0] not in (1, b):
        raise ValueError(f"cos: expected shape [b, s, d] with b = {b} or 1, s = {s}, d = {d}, got "
                         f"{tuple(cos.shape)}")
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    if not kernel_runs(q) or out_dtype != q.dtype:
        # transformers' result in a wider dtype than q's: the reference computes it
        return _reference(q, k, cos, sin, unsqueeze_dim, out_dtype)
    cos3, sin3 = cos, sin
    if cos3.stride() != sin3.stride():
        cos3, sin3 = cos3.contiguous(), sin3.contiguous()
    per_batch = cos3.shape[0] > 1
    angles = Angles(cos3, sin3, s, cos3.stride(1), cos3.stride(0) if per_batch else 0, cos3.stride(2), True, False)
    key = ("hf", qv.shape, qv.stride(), qv.dtype, qv.device, kv.shape[2])
    call = call_for(key, lambda: Call(Layout(s, b, qv.shape[2], d, d, s, 0), "bshd", False, None, None, 1, 0))
    qo, ko = apply((qv, kv), call, angles)
    return (qo.transpose(1, 2), ko.transpose(1, 2)) if unsqueeze_dim == 1 else (qo, ko)


def _reference(q, k, cos, sin, unsqueeze_dim, out_dtype):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return tuple(reference.rotate(x.to(out_dtype), cos, sin, False) for x in (q, k))
