"""Multimodal RoPE for training on padded or packed batches (docs/contract.md section 7b).

The rotary pairs are split into three sections (temporal, height, width: `mrope_section`, pairs per
stream), and each section reads its position from its own stream. `positions` holds the three streams,
[3, t] (thd), [3, s, b] (sbhd) or [3, b, s] (bshd), or one stream for all three (text only: plain RoPE).
They already place every token, so packed sequences need no `cu_seqlens` here (the attention that
follows takes them). Angles come from `freqs` [s2, 1, 1, d2] or a `rope.RoPECache`, as in
`rope.apply_rotary_pos_emb`; the gradient flows to t (q and k).
"""
from __future__ import annotations

from . import reference
from ._backend import Call, convention, dispatch
from ._checks import (
    Layout,
    check_mrope_section,
    check_pair,
    check_positions_in,
    check_stream_positions,
    check_t_and_freqs,
)
from ._launch import angles_for, table_angles
from .cache import RoPECache


def apply_multimodal_rotary_pos_emb(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                                    mrope_interleaved=False):
    """t rotated by three position streams: a new contiguous tensor of t's shape and dtype.

    t: [t, h, d] (thd), [s, b, h, d] (sbhd) or [b, s, h, d] (bshd), any strides.
    mrope_section: three counts of rotary pairs, summing to d2 / 2 (e.g. [16, 24, 24] for d2 = 128).
    interleaved: GPT-J pairs (2i, 2i + 1), else (i, i + d2/2). mrope_interleaved: Qwen3-VL's layout,
    pair k reads stream k % 3 while k < 3 * mrope_section[k % 3], else stream 0; else sections of
    consecutive pairs (Qwen2-VL, Qwen2.5-VL)."""
    return _rotate((t,), ("t",), freqs, positions, mrope_section, tensor_format, interleaved, mrope_interleaved)[0]


def apply_multimodal_rotary_pos_emb_qk(q, k, freqs, positions, mrope_section, tensor_format="thd",
                                       interleaved=False, mrope_interleaved=False):
    """q and k rotated in one launch (head counts may differ); returns (q_out, k_out)."""
    check_pair(q, k, tensor_format)
    return _rotate((q, k), ("q", "k"), freqs, positions, mrope_section, tensor_format, interleaved,
                   mrope_interleaved)


def _rotate(ts, names, freqs, positions, mrope_section, tensor_format, interleaved, mrope_interleaved):
    cache = freqs if isinstance(freqs, RoPECache) else None
    table = freqs if cache is None else cache.as_freqs
    for name, x in zip(names, ts, strict=True):
        # float64 is refused on every path, as by the kernel: the verdict does not depend on the device
        check_t_and_freqs(x, table, tensor_format, interleaved, allow_float64=False, name=name)
    t = ts[0]
    rot_dim = table.shape[-1]
    streams = check_mrope_section(mrope_section, rot_dim // 2, mrope_interleaved)
    check_stream_positions(positions, t.shape[:-2], t, names[0])
    check_positions_in(positions, table.shape[0], table="freqs")
    cos, sin = (None, None) if cache is None else (cache.cos, cache.sin)
    return dispatch(MROPE, ts, (table, cos, sin, positions), (tensor_format, interleaved, streams))


def _roles(t, tensor_format) -> tuple:
    """(s, b) of t in the kernel's roles."""
    if tensor_format == "thd":
        return t.shape[0], 1
    return tuple(t.shape[:2]) if tensor_format == "sbhd" else tuple(t.shape[1::-1])


def _call(ts, reads, flags) -> Call:
    t, table = ts[0], reads[0]
    s, b = _roles(t, flags[0])
    return Call(Layout(s=s, b=b, h=t.shape[-2], d=t.shape[-1], rot_dim=table.shape[-1], freqs_len=table.shape[0]),
                tensor_format=flags[0], interleaved=flags[1])


def _reads(call, reads, flags) -> tuple:
    table, cos, sin, positions = reads
    tensor_format, streams = flags[0], flags[2]
    if positions.dim() == (1 if tensor_format == "thd" else 2):
        positions = positions.expand(3, *positions.shape)  # one stream for all three: stream stride 0
    if tensor_format == "thd":  # positions in the kernel's [streams, s, b] roles
        by_token = positions[..., None]
    else:
        by_token = positions if tensor_format == "sbhd" else positions.transpose(1, 2)
    angles = angles_for(call, table) if cos is None else table_angles(cos, sin, half=False)
    return angles._replace(streams=streams), None, by_token, True


def _reference(ts, reads, flags, backward) -> tuple:
    table, cos, sin, positions = reads
    tensor_format, interleaved, streams = flags
    return tuple(reference.multimodal_rotate(x, table, cos, sin, positions, streams[1:], interleaved, streams[0] == 2)
                 for x in ts)


MROPE = convention("mrope", _call, _reads, _reference)
