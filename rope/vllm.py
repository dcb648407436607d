"""vLLM's convention: `rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)`, in place,
and `mrotary_embedding` (its `MRotaryEmbedding`, multimodal RoPE).

positions: [num_tokens] (or [b, s]) int32/int64; query, key: [num_tokens, heads * head_size] or
[num_tokens, heads, head_size] (leading dims as positions'); key may be None. cos_sin_cache:
[max_position, rotary_dim], row p = cos of the rotary_dim / 2 angles of position p, then their sin.
is_neox: half-split pairs (i, i + rotary_dim / 2), else interleaved pairs (2i, 2i + 1). Channels from
rotary_dim to head_size are left as they are.
"""
from __future__ import annotations

import torch

from . import reference
from ._backend import Call, check_once, convention, dispatch
from ._checks import (
    Layout,
    check_bools,
    check_cos_sin_cache,
    check_disjoint,
    check_inplace,
    check_mrope_section,
    check_positions_in,
    check_schedule,
    check_stream_positions,
    check_token_positions,
    heads_view,
    view_heads,
)
from ._launch import table_angles


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False, *,
                     schedule=None):
    """vLLM's `rotary_embedding` op: rotates query and key (if not None) in place; returns None. The rotated
    channels of each head are rope_dim_offset .. rope_dim_offset + rotary_dim (DeepSeek-V4 passes whole heads with
    the rope slice last); `inverse` rotates by -theta (V4's attention output). `schedule` (not in vLLM): "eager",
    bitwise vLLM's `forward_native` (cos and sin cast to query's dtype, each operation rounded to it); "float32",
    each operation rounded to float32, then the result once (docs/contract.md, "Schedules")."""
    seen = check_once("vllm.rotary_embedding", _check_call, (positions, query, key, cos_sin_cache),
                      (head_size, is_neox, rope_dim_offset, inverse, schedule))
    q, k, cos, sin, rows = _in_place(positions, query, key, head_size, cos_sin_cache)
    check_positions_in(positions, rows)  # the caller's tensor, whose identity the value-check memo keys on
    if rope_dim_offset:  # the rotated slice alone (in place, the channels outside it are neither read nor written)
        q, k = (None if x is None else x[..., rope_dim_offset:rope_dim_offset + 2 * cos.shape[1]] for x in (q, k))
    _rotate(q, k, cos, sin, positions.reshape(-1), is_neox, (0, 0, 0, 0), seen, schedule, inverse)
    return None


def _check_call(positions, query, key, cos_sin_cache, head_size, is_neox, rope_dim_offset, inverse, schedule) -> None:
    """`rotary_embedding`'s static checks (`rope._backend.check_once`: once per signature); the in-place checks
    are `_in_place`'s, on every call."""
    _check_positions_rank(positions, "[num_tokens] or [b, s]")
    q, _, cos, _, _ = _static(positions, query, key, head_size, cos_sin_cache, is_neox)
    check_token_positions(positions.reshape(-1), positions.numel(), q, "query")
    rot = 2 * cos.shape[1]
    if isinstance(rope_dim_offset, bool) or not isinstance(rope_dim_offset, int) or not \
            0 <= rope_dim_offset <= head_size - rot:
        raise ValueError(f"rope_dim_offset: expected an int from 0 to head_size - rotary_dim = {head_size - rot}, got "
                         f"{rope_dim_offset!r}")
    check_bools(inverse=inverse)
    check_schedule(schedule)


def _in_place(positions, query, key, head_size, cos_sin_cache) -> tuple:
    """(query and key as [num_tokens, heads, head_size] views, the cache's cos and sin halves, its rows) of a call
    whose static checks passed; query and key checked for rotation in place (autograd's state and their memory:
    every call)."""
    q = view_heads(query, positions, head_size)
    k = None if key is None else view_heads(key, positions, head_size)
    rows, rot = cos_sin_cache.shape
    check_inplace("query", q)
    if k is not None:
        check_inplace("key", k)
        check_disjoint(q, k, ("query", "key"))
    return q, k, cos_sin_cache[:, :rot // 2], cos_sin_cache[:, rot // 2:], rows


def mrotary_embedding(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                      mrope_interleaved=False):
    """vLLM's `MRotaryEmbedding` (Qwen2-VL's multimodal RoPE): positions [3, num_tokens] (temporal, height,
    width) or [num_tokens] (text: all three equal); pair i reads the stream of its section in
    `mrope_section` (pairs per stream, summing to rotary_dim / 2), or, mrope_interleaved (Qwen3-VL), stream
    i % 3 while i < 3 * mrope_section[i % 3], else stream 0. Rotates query and key (if not None) in place
    and returns them."""
    _check_positions_rank(positions, "[3, num_tokens] or [num_tokens]")
    tokens = positions[0] if positions.dim() == 2 else positions
    q, k, cos, sin, rows = _checked(tokens, query, key, head_size, cos_sin_cache, is_neox)
    streams = check_mrope_section(mrope_section, cos.shape[1], mrope_interleaved)
    check_stream_positions(positions, (q.shape[0],), q, "query")
    check_positions_in(positions, rows)
    if positions.dim() == 1:
        positions = positions.expand(3, q.shape[0])  # one stream for all three: stream stride 0
    _rotate(q, k, cos, sin, positions, is_neox, streams)
    return query, key


def _check_positions_rank(positions, shapes: str):
    """positions holds one or two dims (`shapes`): a 0-d tensor holds no token dim to match query's."""
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions: expected a torch.Tensor, got {type(positions).__name__}")
    if not 1 <= positions.dim() <= 2:
        raise ValueError(f"positions: expected shape {shapes}, got {tuple(positions.shape)}")


def _checked(positions, query, key, head_size, cos_sin_cache, is_neox):
    """`_static`'s views, checked for rotation in place too."""
    q, k, cos, sin, rows = _static(positions, query, key, head_size, cos_sin_cache, is_neox)
    check_inplace("query", q)
    if k is not None:
        check_inplace("key", k)
        check_disjoint(q, k, ("query", "key"))
    return q, k, cos, sin, rows


def _static(positions, query, key, head_size, cos_sin_cache, is_neox):
    """(query and key as [num_tokens, heads, head_size] views, the cos and sin halves of the cache, its rows), their
    shapes, dtypes and devices checked; `positions`: the token dims of query and key."""
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 2:
        raise ValueError(f"head_size: expected an int >= 2, got {head_size!r}")
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
    q = heads_view("query", query, positions, head_size)
    k = None if key is None else heads_view("key", key, positions, head_size)
    cos, sin, rows = check_cos_sin_cache(cos_sin_cache, head_size, q, "query")
    if k is not None and (k.dtype != q.dtype or k.device != q.device):
        raise ValueError(f"key: expected the dtype and device of query ({q.dtype}, {q.device}), got "
                         f"{k.dtype}, {k.device}")
    return q, k, cos, sin, rows


def _rotate(q, k, cos, sin, positions, is_neox, streams, seen=None, schedule=None, inverse=False):
    """Rotate q and k in place by the rows `positions` ([num_tokens], or [3, num_tokens] with `streams`), by -theta
    where `inverse`; `seen`: the front end's checked signature (`check_once`)."""
    dispatch(VLLM, (q,) if k is None else (q, k), (cos, sin, positions), (not is_neox, streams, schedule, inverse),
             inplace=True, seen=seen)


def _call(ts, reads, flags) -> Call:
    q, cos = ts[0], reads[0]
    return Call(Layout(s=q.shape[0], b=1, h=q.shape[1], d=q.shape[2], rot_dim=2 * cos.shape[1],
                       freqs_len=cos.shape[0]), tensor_format="thd", interleaved=flags[0], schedule=flags[2],
                inverse=flags[3])


def _reads(call, reads, flags) -> tuple:
    cos, sin, positions = reads
    streams = flags[1]
    return (table_angles(cos, sin, half=True, streams=streams), None,
            positions[..., None] if streams[0] else positions, True)


def _reference(ts, reads, flags, backward) -> tuple:
    cos, sin, positions = reads
    interleaved, streams, schedule, inverse = flags
    full = [reference.full_width(tab, interleaved) for tab in (cos, sin)]
    if inverse:  # one angle per pair: the rotation by -theta
        full[1] = -full[1]
    if streams[0]:
        stream = reference.section_of_pair(streams[1:], cos.shape[1], streams[0] == 2, cos.device)
        cos_t, sin_t = (reference.select_streams(reference.rows_at(tab, positions.long()), stream, interleaved)
                        for tab in full)
    else:
        cos_t, sin_t = (reference.rows_at(tab, positions.long()) for tab in full)
    return tuple(reference.rotate_scheduled(x, cos_t.unsqueeze(-2), sin_t.unsqueeze(-2), interleaved, schedule)
                 for x in ts)


VLLM = convention("vllm", _call, _reads, _reference)
