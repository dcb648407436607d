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
from ._backend import Call, apply, call_for, kernel_runs
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
    if not kernel_runs(t):
        return tuple(reference.apply_multimodal_rotary_pos_emb(x, freqs, positions, mrope_section, tensor_format,
                                                               interleaved, mrope_interleaved) for x in ts)
    if positions.dim() == t.dim() - 2:
        positions = positions.expand(3, *positions.shape)  # one stream for all three: stream stride 0
    if tensor_format == "thd":  # positions in the kernel's [streams, s, b] roles
        s, b, by_token = t.shape[0], 1, positions[..., None]
    else:
        s, b = t.shape[:2] if tensor_format == "sbhd" else t.shape[1::-1]
        by_token = positions if tensor_format == "sbhd" else positions.transpose(1, 2)
    key = ("mrope", tensor_format, t.shape, t.stride(), t.dtype, t.device, rot_dim, table.shape[0], interleaved,
           tuple(x.shape[-2] for x in ts))
    call = call_for(key, lambda: Call(Layout(s, b, t.shape[-2], t.shape[-1], rot_dim, table.shape[0], 0),
                                      tensor_format, interleaved, None, None, 1, 0))
    angles = angles_for(call, freqs) if cache is None else table_angles(cache.cos, cache.sin, half=False)
    return apply(ts, call, angles._replace(streams=streams), token_index=by_token, pos_table=True)
