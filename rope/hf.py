"""transformers' convention: `apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)`, and
`apply_multimodal_rotary_pos_emb` (Qwen2-VL's multimodal RoPE).

q, k: [b, h, s, d] (unsqueeze_dim=1) or [b, s, h, d] (unsqueeze_dim=2), d even; cos, sin: [b, s, d],
already gathered by position (b may be 1), both halves of each row for the half-split pairs
(rotate_half). Returns (q * cos + rotate_half(q) * sin, the same for k).
"""
from __future__ import annotations

import torch

from . import reference
from ._apply import apply, kernel_runs
from ._launch import Angles
from ._validate import Call, Layout, call_for, check_mrope_section, check_pair, check_tables

_SHAPES = {1: "[b, h, s, d]", 2: "[b, s, h, d]"}


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' `apply_rotary_pos_emb`, with float32 math and one rounding to the output dtype
    (torch's promotion of q's and cos's dtypes, as transformers' expression gives). `position_ids` is
    unused, as in transformers. New tensors; the gradient flows to q and k."""
    qv, kv = _bshd_views(q, k, unsqueeze_dim)
    check_tables(cos, sin, q, "q")
    b, s, _, d = qv.shape
    if cos.dim() != 3 or cos.shape[1:] != (s, d) or cos.shape[0] not in (1, b):
        raise ValueError(f"cos: expected shape [b, s, d] with b = {b} or 1, s = {s}, d = {d}, got "
                         f"{tuple(cos.shape)}")
    return _rotate(q, k, qv, kv, cos, sin, unsqueeze_dim, 0, (0, 0, 0, 0))


def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1, mrope_interleaved=False):
    """transformers' `apply_multimodal_rotary_pos_emb` (Qwen2-VL, Qwen2.5-VL): cos, sin [3, b, s, d], one
    table per position stream (temporal, height, width) as the model's rotary module returns them; pair
    (i, i + d/2) takes stream m's cos/sin where i lies in section m of `mrope_section` (pairs per stream,
    summing to d/2; transformers doubles the list over both halves). mrope_interleaved=True (not in
    transformers' function): Qwen3-VL's layout, pair i reads stream i % 3 while i < 3 * mrope_section[i % 3],
    else stream 0, which Qwen3-VL's rotary module applies while it builds cos/sin. New tensors."""
    qv, kv = _bshd_views(q, k, unsqueeze_dim)
    check_tables(cos, sin, q, "q")
    b, s, _, d = qv.shape
    if cos.dim() != 4 or cos.shape[0] != 3 or cos.shape[2:] != (s, d) or cos.shape[1] not in (1, b):
        raise ValueError(f"cos: expected shape [3, b, s, d] (one table per stream) with b = {b} or 1, s = {s}, "
                         f"d = {d}, got {tuple(cos.shape)}")
    streams = check_mrope_section(mrope_section, d // 2, mrope_interleaved)
    return _rotate(q, k, qv, kv, cos, sin, unsqueeze_dim, 1, streams)


def _bshd_views(q, k, unsqueeze_dim):
    """q and k as [b, s, h, d] views (the kernel's bshd roles), checked."""
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int) or unsqueeze_dim not in _SHAPES:
        raise ValueError(f"unsqueeze_dim: expected 1 (q, k as {_SHAPES[1]}) or 2 ({_SHAPES[2]}), got {unsqueeze_dim!r}")
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor {_SHAPES[unsqueeze_dim]}, got shape {tuple(x.shape)}")
    qv, kv = (q.transpose(1, 2), k.transpose(1, 2)) if unsqueeze_dim == 1 else (q, k)
    check_pair(qv, kv, "bshd")
    if qv.shape[-1] % 2:
        raise ValueError(f"q: rotate_half pairs channel i with i + d/2: expected an even head dim, got {qv.shape[-1]}")
    return qv, kv


def _rotate(q, k, qv, kv, cos, sin, unsqueeze_dim, stream_dims, streams):
    """q and k rotated by cos/sin [*stream, b, s, d] (stream_dims leading stream dims, `streams` as
    `rope._launch.Angles` holds them)."""
    b, s, _, d = qv.shape
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    if not kernel_runs(q) or out_dtype != q.dtype:
        # transformers' result in a wider dtype than q's: the reference computes it
        if stream_dims:
            stream = reference.section_of_pair(streams[1:], d // 2, streams[0] == 2, cos.device)
            cos, sin = (reference.select_streams(tab, stream, False) for tab in (cos, sin))
        return _reference(q, k, cos, sin, unsqueeze_dim, out_dtype)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    per_batch = cos.shape[stream_dims] > 1
    angles = Angles(cos, sin, s, cos.stride(-2), cos.stride(-3) if per_batch else 0, cos.stride(-1), True, False,
                    cos.stride(0) if stream_dims else 0, streams)
    key = ("hf", qv.shape, qv.stride(), qv.dtype, qv.device, kv.shape[2])
    call = call_for(key, lambda: Call(Layout(s, b, qv.shape[2], d, d, s, 0), "bshd", False, None, None, 1, 0))
    qo, ko = apply((qv, kv), call, angles)
    return (qo.transpose(1, 2), ko.transpose(1, 2)) if unsqueeze_dim == 1 else (qo, ko)


def _reference(q, k, cos, sin, unsqueeze_dim, out_dtype):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return tuple(reference.rotate(x.to(out_dtype), cos, sin, False) for x in (q, k))
