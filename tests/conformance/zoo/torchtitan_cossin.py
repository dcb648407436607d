"""torchtitan's CosSinRoPE (spec/torchtitan_cossin.py): a correct implementation and planted bugs:
rope_cache = cache[positions] (or cache[:T]) as [T, 1, 2H], cos its first H columns, sin the rest."""
from __future__ import annotations

import torch

from . import rotate_half


def token_tables(cache, t, positions, h):
    rows = (cache[:t] if positions is None else cache[positions.long()]).unsqueeze(1)  # [T, 1, 2H]
    return rows[..., :h], rows[..., h:]


def embed(x, cos, sin, math_dtype=torch.float32, out_dtype=None, interleaved=False, sign=1.0):
    xm = x.to(math_dtype)
    return (xm * cos.to(math_dtype) + sign * rotate_half(xm, interleaved) * sin.to(math_dtype)).to(out_dtype or x.dtype)


def tables(query, cache, positions):
    return token_tables(cache, query.shape[0], positions, query.shape[-1])


def correct(query, key, cache, positions=None):
    cos, sin = tables(query, cache, positions)
    return embed(query, cos, sin), embed(key, cos, sin)


def interleaved_pairs(query, key, cache, positions=None):
    """Pairs (2i, 2i + 1) (the complex form's) with the cos/sin cache's columns."""
    cos, sin = tables(query, cache, positions)
    return embed(query, cos, sin, interleaved=True), embed(key, cos, sin, interleaved=True)


def cos_sin_swapped(query, key, cache, positions=None):
    """The cache's halves read as (sin, cos)."""
    cos, sin = tables(query, cache, positions)
    return embed(query, sin, cos), embed(key, sin, cos)


def first_half_tables(query, key, cache, positions=None):
    """One angle per pair: cos/sin[..., :H/2] for both halves (wrong where the halves differ)."""
    cos, sin = tables(query, cache, positions)
    h = cos.shape[-1] // 2
    cos, sin = (torch.cat([v[..., :h]] * 2, dim=-1) for v in (cos, sin))
    return embed(query, cos, sin), embed(key, cos, sin)


def positions_ignored(query, key, cache, positions=None):
    """positions dropped: token t reads row t."""
    return correct(query, key, cache)


def result_float32(query, key, cache, positions=None):
    """The float32 result returned without type_as."""
    cos, sin = tables(query, cache, positions)
    return embed(query, cos, sin, out_dtype=torch.float32), embed(key, cos, sin, out_dtype=torch.float32)


def rotate_half_sign_flipped(query, key, cache, positions=None):
    """rotate_half's sign on the other half: rotation by -theta."""
    cos, sin = tables(query, cache, positions)
    return embed(query, cos, sin, sign=-1.0), embed(key, cos, sin, sign=-1.0)


def math_depends_on_batch(query, key, cache, positions=None):
    """One token computes in float64, more in float32 (a decode path and a prefill path): each result within one
    rounding, but a token's result depends on what else is in the call."""
    cos, sin = tables(query, cache, positions)
    math = torch.float64 if query.shape[0] == 1 else torch.float32
    return embed(query, cos, sin, math), embed(key, cos, sin, math)


def math_in_x_dtype(query, key, cache, positions=None):
    """The products and the sum in query's dtype (16-bit roundings at every step)."""
    cos, sin = tables(query, cache, positions)
    return embed(query, cos, sin, query.dtype), embed(key, cos, sin, key.dtype)


def no_positions_last_rows(query, key, cache, positions=None):
    """Without positions, the last T rows of the cache (a decode cache's tail) instead of rows 0 .. T-1."""
    if positions is None:
        positions = torch.arange(len(cache) - query.shape[0], len(cache), device=cache.device)
    return correct(query, key, cache, positions)


def positions_as_offset(query, key, cache, positions=None):
    """positions read as a start offset: token t reads row positions[0] + t (the last row past the end)."""
    if positions is None or not len(positions):
        return correct(query, key, cache)
    rows = (positions[:1].long() + torch.arange(query.shape[0], device=positions.device)).clamp(max=len(cache) - 1)
    return correct(query, key, cache, rows)


def key_ignores_positions(query, key, cache, positions=None):
    """query gathers its rows by positions, key reads rows 0 .. T-1."""
    return correct(query, key, cache, positions)[0], correct(query, key, cache)[1]


def sin_rows_shifted(query, key, cache, positions=None):
    """sin read one row late (the last row kept): no rotation any more."""
    t, h = query.shape[0], query.shape[-1]
    rows = torch.arange(t, device=cache.device) if positions is None else positions.long()
    cos = cache[rows, :h].unsqueeze(1)
    sin = cache[(rows + 1).clamp(max=len(cache) - 1), h:].unsqueeze(1)
    return embed(query, cos, sin), embed(key, cos, sin)


class _NotConjugated(torch.autograd.Function):
    """The backward rotates the upstream gradient by +theta instead of -theta."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return embed(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return embed(g, cos, sin), None, None


def backward_not_conjugated(query, key, cache, positions=None):
    cos, sin = tables(query, cache, positions)
    return _NotConjugated.apply(query, cos, sin), _NotConjugated.apply(key, cos, sin)


def explicit_none_positions_as_zero(query, key, cache, **kwargs):
    """A wrapper that fills a positions keyword given as None with zeros: every token reads row 0 where passing
    positions=None means what leaving it out means (token t reads row t)."""
    if "positions" in kwargs and kwargs["positions"] is None:
        kwargs["positions"] = torch.zeros(query.shape[0], dtype=torch.long, device=query.device)
    return correct(query, key, cache, **kwargs)


CORRECT = correct
BUGS = {
    "interleaved_pairs": (interleaved_pairs, ("forward",)),
    "cos_sin_swapped": (cos_sin_swapped, ("forward",)),
    "first_half_tables": (first_half_tables, ("forward",)),
    "positions_ignored": (positions_ignored, ("forward", "positions_gather")),
    "result_float32": (result_float32, ("forward",)),
    "rotate_half_sign_flipped": (rotate_half_sign_flipped, ("forward",)),
    "math_in_x_dtype": (math_in_x_dtype, ("forward",)),
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "no_positions_last_rows": (no_positions_last_rows, ("forward", "arange_positions")),
    "positions_as_offset": (positions_as_offset, ("forward", "tokens_independent", "positions_gather")),
    "key_ignores_positions": (key_ignores_positions, ("forward", "positions_gather", "swap_q_k")),
    "sin_rows_shifted": (sin_rows_shifted, ("forward", "inverse")),
    "backward_not_conjugated": (backward_not_conjugated, ("backward",)),
    # an optional argument passed at its default
    "explicit_none_positions_as_zero": (explicit_none_positions_as_zero, ("forward",)),
}
