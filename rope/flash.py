"""flash-attention's convention: `apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False,
seqlen_offsets=0, cu_seqlens=None, max_seqlen=None)`.

x: [b, s, h, d], or [total, h, d] with cu_seqlens [b + 1]. cos, sin: [seqlen_ro, rotary_dim / 2], one
angle per pair; rotary_dim <= d (the rest is copied). Token j of sequence i reads row
j + seqlen_offsets (an int, or a [b] int32/int64 tensor with one offset per sequence).
"""
from __future__ import annotations

import torch

from . import reference
from ._backend import Call, convention, dispatch
from ._checks import (
    Layout,
    check_bools,
    check_float_tensor,
    check_index_tensor,
    check_inplace,
    check_positions,
    check_rotary_width,
    check_tables,
)
from ._launch import table_angles, token_index_for


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """flash-attention's `apply_rotary_emb`: a new tensor, or x itself with inplace=True. cos/sin may be
    float32, float16 or bfloat16 whatever x's dtype (math in float32, one rounding). `max_seqlen` is
    not needed (positions are checked against seqlen_ro instead). The gradient flows to x. In place on a leaf
    that requires grad, as flash's autograd Function: x written, a new tensor over x's memory returned, x.grad
    the inverse rotation of the upstream gradient (docs/contract.md, 7a)."""
    fmt = "bshd" if cu_seqlens is None else "thd"
    check_float_tensor("x", x)
    if x.dim() != (4 if fmt == "bshd" else 3):
        raise ValueError(f"x: expected {'[b, s, h, d]' if fmt == 'bshd' else '[total, h, d] (with cu_seqlens)'}, "
                         f"got shape {tuple(x.shape)}")
    check_tables(cos, sin, x, "x")
    if cos.dim() != 2:
        raise ValueError(f"cos: expected shape [seqlen_ro, rotary_dim / 2], got {tuple(cos.shape)}")
    check_bools(interleaved=interleaved, inplace=inplace)
    rows, d, rot = cos.shape[0], x.shape[-1], 2 * cos.shape[1]
    check_rotary_width(rot, d, "cos")
    start = None
    if isinstance(seqlen_offsets, torch.Tensor):
        start = seqlen_offsets
    elif isinstance(seqlen_offsets, int) and not isinstance(seqlen_offsets, bool):
        if not 0 <= seqlen_offsets <= rows:
            raise ValueError(f"seqlen_offsets: expected an int in [0, seqlen_ro = {rows}], got {seqlen_offsets}")
        cos, sin, rows = cos[seqlen_offsets:], sin[seqlen_offsets:], rows - seqlen_offsets
    else:
        raise TypeError(f"seqlen_offsets: expected an int or a tensor, got {type(seqlen_offsets).__name__}")
    if fmt == "thd":
        check_index_tensor("cu_seqlens", cu_seqlens, x, "x")
        if cu_seqlens.shape[0] < 1:
            raise ValueError("cu_seqlens: expected shape [b + 1], got an empty tensor")
        s, b, n_seqs = x.shape[0], 1, cu_seqlens.shape[0] - 1
    else:
        b, s, n_seqs = x.shape[0], x.shape[1], 0
        if start is None and s > rows:
            raise ValueError(f"cos: too short: seqlen {s} from seqlen_offsets = {seqlen_offsets} needs "
                             f"{seqlen_offsets + s} rows (seqlen_ro), got {seqlen_offsets + rows}")
    if start is not None:
        check_index_tensor("seqlen_offsets", start, x, "x")
        if start.shape[0] != (n_seqs if fmt == "thd" else b):
            raise ValueError(f"seqlen_offsets: expected one offset per sequence ({n_seqs if fmt == 'thd' else b}), "
                             f"got shape {tuple(start.shape)}")
    if inplace:
        check_inplace("x", x, leaf_written=True)
    layout = Layout(s=s, b=b, h=x.shape[-2], d=d, rot_dim=rot, freqs_len=rows, n_seqs=n_seqs)
    check_positions(layout, fmt, start, cu_seqlens, 1, 0, ("cos", "seqlen_offsets"))
    return dispatch(FLASH, (x,), (cos, sin, start, cu_seqlens), (fmt, interleaved), inplace=inplace)[0]


def _layout(ts, reads, flags) -> Layout:
    x, cos, cu_seqlens = ts[0], reads[0], reads[3]
    if flags[0] == "thd":
        s, b, n_seqs = x.shape[0], 1, cu_seqlens.shape[0] - 1
    else:
        b, s, n_seqs = x.shape[0], x.shape[1], 0
    return Layout(s=s, b=b, h=x.shape[-2], d=x.shape[-1], rot_dim=2 * cos.shape[1], freqs_len=cos.shape[0],
                  n_seqs=n_seqs)


def _call(ts, reads, flags) -> Call:
    return Call(_layout(ts, reads, flags), tensor_format=flags[0], interleaved=flags[1], start_positions=reads[2],
                cu_seqlens=reads[3])


def _reads(call, reads, flags) -> tuple:
    cos, sin, start, cu_seqlens = reads
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return (table_angles(cos, sin, half=True), start, *token_index_for(call, cu_seqlens))


def _reference(ts, reads, flags, backward) -> tuple:
    """Rows at each token's position; backward: the inverse rotation, -sin (exact)."""
    cos, sin, start, cu_seqlens = reads
    fmt, interleaved = flags
    x = ts[0]
    pos = reference.token_positions(_layout(ts, reads, flags), fmt, start, cu_seqlens, 1, 0, x.device)
    full = [reference.full_width(tab, interleaved) for tab in (cos, sin)]
    return (reference.rotate_rows(x, full[0], -full[1] if backward else full[1], pos, fmt, interleaved),)


FLASH = convention("flash", _call, _reads, _reference, keep_order=True)
