"""torchtitan's conventions (torchtitan/models/common/rope.py at pytorch/torchtitan
b5bcd76c66d0acb1a08b176d9639425bc55e0b2a): query [T, N, H] and key [T, N_k, H], tokens first (the batch
folded into T), a cache of every position, and optional `positions` [T] gathering one row per token.

    complex_rope(query, key, cache, positions=None)   ComplexRoPE.forward: cache complex64 [rows, H/2] (its
                                                      `cache` buffer), pairs (2i, 2i + 1) times cache[p, i]
    cossin_rope(query, key, cache, positions=None)    CosSinRoPE.forward: cache [rows, 2H] = cat(cos, sin), each
                                                      full width, rotate_half pairs (i, i + H/2)
    complex_apply_rotary_emb(query, key, rope_cache)  ComplexRoPE.apply_rotary_emb: rope_cache [T, 1, H/2]
    cossin_apply_rotary_emb(query, key, rope_cache)   CosSinRoPE.apply_rotary_emb: rope_cache [T, 1, 2H]

Token t reads row positions[t], or row t without positions. Math in float32, rounded once to each input's dtype
(`type_as`). New tensors; the gradient flows to query and key. A torchtitan subclass takes the kernel with
`apply_rotary_emb = staticmethod(rope.torchtitan.complex_apply_rotary_emb)`.
"""
from __future__ import annotations

import torch

from . import reference
from ._backend import Call, convention, dispatch
from ._checks import (
    Layout,
    check_heads_pair,
    check_positions_in,
    check_tables,
    check_token_positions,
    complex_tables,
)
from ._launch import table_angles

_NAMES = ("query", "key")


def complex_rope(query, key, cache, positions=None):
    """`ComplexRoPE.forward` with the module's complex64 cache [rows, H/2] passed in."""
    check_heads_pair(query, key, _NAMES, 3, "[T, N, H]")
    return _complex(query, key, cache, positions, "cache")


def cossin_rope(query, key, cache, positions=None):
    """`CosSinRoPE.forward` with the module's cache [rows, 2H] (cos, then sin, full width) passed in."""
    check_heads_pair(query, key, _NAMES, 3, "[T, N, H]")
    return _cossin(query, key, cache, positions, "cache")


def complex_apply_rotary_emb(query, key, rope_cache):
    """`ComplexRoPE.apply_rotary_emb`: rope_cache complex64 [T, 1, H/2], already one row per token."""
    check_heads_pair(query, key, _NAMES, 3, "[T, N, H]")
    return _complex(query, key, _prepared(rope_cache, query, "[T, 1, H/2]"), None, "rope_cache")


def cossin_apply_rotary_emb(query, key, rope_cache):
    """`CosSinRoPE.apply_rotary_emb`: rope_cache [T, 1, 2H], already one row per token."""
    check_heads_pair(query, key, _NAMES, 3, "[T, N, H]")
    return _cossin(query, key, _prepared(rope_cache, query, "[T, 1, 2H]"), None, "rope_cache")


def _complex(query, key, cache, positions, name):
    cos, sin = complex_tables(cache, query, "query", name)
    if cos.dim() != 2 or cos.shape[1] != query.shape[-1] // 2:
        raise ValueError(f"{name}: expected shape [rows, H/2] with H/2 = {query.shape[-1] // 2}, got "
                         f"{_shape(cache, name)}")
    return _rotate(query, key, cos, sin, positions, True, name)


def _cossin(query, key, cache, positions, name):
    h = query.shape[-1]
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() != 2 or cache.shape[1] != 2 * h:
        raise ValueError(f"{name}: expected shape [rows, 2H] (cos, then sin) with 2H = {2 * h}, got "
                         f"{_shape(cache, name)}")
    cos, sin = cache[:, :h], cache[:, h:]
    check_tables(cos, sin, query, "query", (name, name))
    return _rotate(query, key, cos, sin, positions, False, name)


def _prepared(rope_cache, query, shape: str):
    """A prepared cache [T, 1, width] as the module's cache [T, width] (its rows read in order)."""
    if not isinstance(rope_cache, torch.Tensor):
        raise TypeError(f"rope_cache: expected a torch.Tensor, got {type(rope_cache).__name__}")
    if rope_cache.dim() != 3 or rope_cache.shape[1] != 1 or rope_cache.shape[0] != query.shape[0]:
        raise ValueError(f"rope_cache: expected shape {shape} with T = {query.shape[0]}, got "
                         f"{tuple(rope_cache.shape)}")
    return rope_cache[:, 0]


def _shape(cache, name):
    """The shape as the caller gave it: a prepared cache's [T, 1, width]."""
    return tuple(cache.shape) if name == "cache" else (cache.shape[0], 1, *cache.shape[1:])


def _rotate(query, key, cos, sin, positions, interleaved: bool, table: str):
    """query and key rotated by rows of the tables cos/sin [rows, columns] (one per pair if interleaved, else one
    per channel): row positions[t] for token t, or row t."""
    t_len, n, h = query.shape
    rows = cos.shape[0]
    if positions is not None:
        check_token_positions(positions, t_len, query, "query")
        check_positions_in(positions, rows, table=table)
    elif t_len > rows:
        raise ValueError(f"{table}: too short: {t_len} tokens read rows 0 .. {t_len - 1}, got {rows} rows")
    if positions is None:  # tokens as [s = T, b = 1]: token t reads row t
        qo, ko = dispatch(TITAN, (query.unsqueeze(1), key.unsqueeze(1)), (cos, sin), (interleaved,))
        return qo.squeeze(1), ko.squeeze(1)
    return dispatch(TITAN_POSITIONS, (query, key), (cos, sin, positions), (interleaved,))


def _call(ts, reads, flags) -> Call:
    t_len, n, h = ts[0].shape[0], ts[0].shape[-2], ts[0].shape[-1]
    return Call(Layout(s=t_len, b=1, h=n, d=h, rot_dim=h, freqs_len=reads[0].shape[0]),
                tensor_format="sbhd" if ts[0].dim() == 4 else "thd", interleaved=flags[0])


def _reads(call, reads, flags) -> tuple:
    angles = table_angles(reads[0], reads[1], half=flags[0])
    return (angles, None, None, False) if len(reads) == 2 else (angles, None, reads[2], True)


def _reference(ts, reads, flags, backward) -> tuple:
    """Row positions[t] (or row t) of the tables for token t, broadcast over t's other dims."""
    interleaved = flags[0]
    x = ts[0]
    pos = torch.arange(x.shape[0], device=x.device) if len(reads) == 2 else reads[2].long()
    full = [reference.full_width(tab, True) if interleaved else tab for tab in reads[:2]]
    c, s = (reference.rows_at(tab, pos).reshape(x.shape[0], *(1,) * (x.dim() - 2), tab.shape[-1]) for tab in full)
    return tuple(reference.rotate(x, c, s, interleaved) for x in ts)


TITAN = convention("torchtitan", _call, _reads, _reference)
TITAN_POSITIONS = convention("torchtitan-positions", _call, _reads, _reference)
