"""The path below transformers' entry points (`rope.hf`): their checks, and the one launch of the kernel's table
mode (or the reference) for q and k, or one tensor.

The kernel reads transformers' tables as they are: one column per channel of the rotary width r = cos.shape[-1]
(rotate_half pairs (i, i + r/2) read columns i and i + r/2), or, for GLM's interleaved pairs (2i, 2i + 1), one
column per pair, column i of the first half (`Angles.half`). Channels r.. are the kernel's pass-through tail.
"""
from __future__ import annotations

import torch

from . import reference
from ._apply import apply, kernel_runs
from ._launch import Angles
from ._validate import Call, Layout, call_for, check_pair, check_rotary_width, check_tables

_SHAPES = {1: "[b, h, s, d]", 2: "[b, s, h, d]"}


def heads_views(named, unsqueeze_dim) -> tuple:
    """The rotated tensors ((name, tensor), ...: q and k, or x) as [b, s, h, d] views (the kernel's bshd roles),
    checked."""
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
    """cos, sin [b or 1, s, r] (with stream_dims = 1: [3, b or 1, s, r], one table per stream) for the views' b and
    s, r even with 2 <= r <= d. A rank-2 [s, r] table (Liger's extension) is refused: transformers' expression
    would broadcast it over the heads, not the positions."""
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


def rotate(xs, views, cos, sin, unsqueeze_dim, interleaved=False, streams=None) -> tuple:
    """xs (q and k, or x; `views` their [b, s, h, d] views) rotated over the first r = cos.shape[-1] channels in one
    launch; `streams` as `rope._launch.Angles` holds them for tables per stream (cos [3, b, s, r])."""
    b, s, h, d = views[0].shape
    rot = cos.shape[-1]
    out_dtype = torch.promote_types(xs[0].dtype, cos.dtype)
    if not kernel_runs(xs[0]) or out_dtype != xs[0].dtype:
        # transformers' result in a wider dtype than q's: the reference computes it
        return _reference(xs, cos, sin, unsqueeze_dim, out_dtype, interleaved, streams)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    stream_dims = 0 if streams is None else 1
    per_batch = cos.shape[stream_dims] > 1
    angles = Angles(cos, sin, s, cos.stride(-2), cos.stride(-3) if per_batch else 0, cos.stride(-1), True, interleaved,
                    cos.stride(0) if stream_dims else 0, streams or (0, 0, 0, 0))
    key = ("hf", views[0].shape, views[0].stride(), views[0].dtype, views[0].device, rot, interleaved,
           tuple(v.shape[2] for v in views[1:]))
    call = call_for(key, lambda: Call(Layout(s, b, h, d, rot, s, 0), "bshd", interleaved, None, None, 1, 0))
    outs = apply(views, call, angles)
    return tuple(o.transpose(1, 2) for o in outs) if unsqueeze_dim == 1 else tuple(outs)


def _reference(xs, cos, sin, unsqueeze_dim, out_dtype, interleaved, streams) -> tuple:
    rot = cos.shape[-1]
    if streams is not None:
        stream = reference.section_of_pair(streams[1:], rot // 2, streams[0] == 2, cos.device)
        cos, sin = (reference.select_streams(tab, stream, False) for tab in (cos, sin))
    if interleaved:  # GLM: column i of the first half for both channels of pair i
        cos, sin = (reference.full_width(tab[..., :rot // 2], True) for tab in (cos, sin))
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return tuple(reference.rotate(x.to(out_dtype), cos, sin, interleaved) for x in xs)
