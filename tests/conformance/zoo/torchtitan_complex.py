"""torchtitan's ComplexRoPE (spec/torchtitan_complex.py): a correct implementation and planted bugs, in the
convention's complex arithmetic: rope_cache = cache[positions] (or cache[:T]) as [T, 1, H/2]."""
from __future__ import annotations

import torch

from . import rotate_half
from .meta import NotConjugated, rotated


def token_rows(cache, t, positions):
    return (cache[:t] if positions is None else cache[positions.long()]).unsqueeze(1)  # [T, 1, H/2]


def correct(query, key, cache, positions=None):
    f = token_rows(cache, query.shape[0], positions)
    return rotated(query, f), rotated(key, f)


def positions_ignored(query, key, cache, positions=None):
    """positions dropped: token t reads row t."""
    return correct(query, key, cache)


def positions_read_dense(query, key, cache, positions=None):
    """positions read from their first element as if dense (a kernel handed positions.data_ptr() alone): right for
    any positions whose elements are adjacent, wrong for a spaced view (ids[:, 0])."""
    if positions is not None and positions.numel():
        positions = torch.as_strided(positions, positions.shape, (1,), positions.storage_offset())
    return correct(query, key, cache, positions)


def positions_as_offset(query, key, cache, positions=None):
    """positions read as a start offset (Meta's start_pos): token t reads row positions[0] + t (the last row past
    the end)."""
    if positions is None or not len(positions):
        return correct(query, key, cache)
    rows = (positions[:1].long() + torch.arange(query.shape[0], device=positions.device)).clamp(max=len(cache) - 1)
    return correct(query, key, cache, rows)


def key_ignores_positions(query, key, cache, positions=None):
    """query gathers its rows by positions, key reads rows 0 .. T-1."""
    t = query.shape[0]
    return rotated(query, token_rows(cache, t, positions)), rotated(key, token_rows(cache, t, None))


def half_split_pairs(query, key, cache, positions=None):
    """Pairs (i, i + H/2) (rotate_half) instead of the complex form's (2i, 2i + 1)."""
    f = token_rows(cache, query.shape[0], positions)
    c, s = (torch.cat([v, v], dim=-1) for v in (f.real, f.imag))
    return tuple((x.float() * c + rotate_half(x.float()) * s).to(x.dtype) for x in (query, key))


def conj_angle(query, key, cache, positions=None):
    """Multiplies by conj(cache): rotation by -theta."""
    f = token_rows(cache, query.shape[0], positions).conj()
    return rotated(query, f), rotated(key, f)


def result_float32(query, key, cache, positions=None):
    """The float32 product returned without type_as."""
    f = token_rows(cache, query.shape[0], positions)
    return rotated(query, f, torch.float32), rotated(key, f, torch.float32)


def x_rounded_to_bf16(query, key, cache, positions=None):
    """query and key rounded to bfloat16 before the product."""
    f = token_rows(cache, query.shape[0], positions)
    return tuple(rotated(x.to(torch.bfloat16), f, x.dtype) for x in (query, key))


def no_positions_last_rows(query, key, cache, positions=None):
    """Without positions, the last T rows of the cache (a decode cache's tail) instead of rows 0 .. T-1."""
    if positions is None:
        positions = torch.arange(len(cache) - query.shape[0], len(cache), device=cache.device)
    return correct(query, key, cache, positions)


def sin_rows_shifted(query, key, cache, positions=None):
    """The imaginary parts read one row late (the last row kept): no rotation any more."""
    t = query.shape[0]
    rows = torch.arange(t, device=cache.device) if positions is None else positions.long()
    f = torch.complex(cache.real[rows], cache.imag[(rows + 1).clamp(max=len(cache) - 1)]).unsqueeze(1)
    return rotated(query, f), rotated(key, f)


def backward_not_conjugated(query, key, cache, positions=None):
    f = token_rows(cache, query.shape[0], positions)
    return NotConjugated.apply(query, f), NotConjugated.apply(key, f)


CORRECT = correct
BUGS = {
    "positions_ignored": (positions_ignored, ("forward", "positions_gather")),
    "positions_read_dense": (positions_read_dense, ("forward",)),
    "positions_as_offset": (positions_as_offset, ("forward", "tokens_independent", "positions_gather")),
    "key_ignores_positions": (key_ignores_positions, ("forward", "positions_gather", "swap_q_k")),
    "half_split_pairs": (half_split_pairs, ("forward",)),
    "conj_angle": (conj_angle, ("forward",)),
    "result_float32": (result_float32, ("forward",)),
    "x_rounded_to_bf16": (x_rounded_to_bf16, ("forward",)),
    "no_positions_last_rows": (no_positions_last_rows, ("forward", "arange_positions")),
    "sin_rows_shifted": (sin_rows_shifted, ("forward", "inverse")),
    "backward_not_conjugated": (backward_not_conjugated, ("backward",)),
}
