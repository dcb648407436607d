"""vLLM's multimodal RoPE as a function (spec/vllm_mrope.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch


def select_streams(rows, mrope_section, mrope_interleaved, extra=0):
    """[3, T, rot/2] -> [T, rot/2], as vLLM's MRotaryEmbedding selects: consecutive sections, or Qwen3-VL's
    interleaving (`extra` pairs beyond 3 * section[m] for a planted bug)."""
    if not mrope_interleaved:
        return torch.cat([m[i] for i, m in enumerate(rows.split(list(mrope_section), dim=-1))], dim=-1)
    out = rows[0].clone()
    for m in (1, 2):
        out[..., m:3 * mrope_section[m] + extra:3] = rows[m, ..., m:3 * mrope_section[m] + extra:3]
    return out


def tables(positions, cache, mrope_section, mrope_interleaved, tokens, first_row=False, extra=0,
           dtype=torch.float32):
    half = cache.shape[-1] // 2
    pos = positions.long()
    if pos.dim() == 1 or first_row:
        pos = (pos if pos.dim() == 1 else pos[0]).expand(3, tokens)
    cos, sin = cache[:, :half].to(dtype), cache[:, half:].to(dtype)
    return (select_streams(t[pos], mrope_section, mrope_interleaved, extra) for t in (cos, sin))


def rotated(x, cos, sin, head_size, is_neox, math_dtype=torch.float32, partner_offset=None):
    """x [T, h * d] or [T, h, d] rotated over its first rot = 2 * cos.shape[-1] channels (a new tensor)."""
    heads = x.shape[1] if x.dim() == 3 else x.shape[-1] // head_size  # named: T may be 0
    xf = x.to(math_dtype).reshape(x.shape[0], heads, head_size)
    half = cos.shape[-1]
    c, s = cos[:, None].to(math_dtype), sin[:, None].to(math_dtype)
    if is_neox:
        off = partner_offset or half
        x1, x2 = xf[..., :half], xf[..., off:off + half]
        out = xf.clone()
        out[..., :half], out[..., off:off + half] = x1 * c - x2 * s, x2 * c + x1 * s
    else:
        x1, x2 = xf[..., 0:2 * half:2], xf[..., 1:2 * half:2]
        head = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
        out = torch.cat([head, xf[..., 2 * half:]], dim=-1)
    return out.to(x.dtype).reshape(x.shape)


def correct(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True, mrope_interleaved=False):
    cos, sin = tables(positions, cos_sin_cache, mrope_section, mrope_interleaved, query.shape[0])
    for x in (query, key):
        if x is not None:
            x.copy_(rotated(x, cos, sin, head_size, is_neox))
    return query, key


def math_depends_on_batch(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                          mrope_interleaved=False):
    """A single token computes in float64, more in float32 (a kernel picking its path by the token count, as decode
    and prefill paths do): each result within one rounding, but a token's result depends on what else is in the
    call."""
    math = torch.float64 if query.shape[0] == 1 else torch.float32
    cos, sin = tables(positions, cos_sin_cache, mrope_section, mrope_interleaved, query.shape[0], dtype=math)
    for x in (query, key):
        if x is not None:
            x.copy_(rotated(x, cos, sin, head_size, is_neox, math))
    return query, key


def first_row_positions(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                        mrope_interleaved=False):
    """A [3, T] positions tensor read as its first row (text RoPE on every token)."""
    cos, sin = tables(positions, cos_sin_cache, mrope_section, mrope_interleaved, query.shape[0], first_row=True)
    for x in (query, key):
        if x is not None:
            x.copy_(rotated(x, cos, sin, head_size, is_neox))
    return query, key


def key_none_rotates_query_twice(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                                 mrope_interleaved=False):
    """key=None replaced by query (`key if key is not None else query`): query rotated twice, returned as key."""
    cos, sin = tables(positions, cos_sin_cache, mrope_section, mrope_interleaved, query.shape[0])
    for x in (query, key if key is not None else query):
        x.copy_(rotated(x, cos, sin, head_size, is_neox))
    return query, key


def new_tensors_promised_in_place(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                                  mrope_interleaved=False):
    """Returns new tensors (as forward_native does) where the op promises query and key written in place."""
    cos, sin = tables(positions, cos_sin_cache, mrope_section, mrope_interleaved, query.shape[0])
    return tuple(None if x is None else rotated(x, cos, sin, head_size, is_neox) for x in (query, key))


def is_neox_inverted(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                     mrope_interleaved=False):
    """The pairing flag read the wrong way round."""
    return correct(positions, query, key, head_size, cos_sin_cache, mrope_section, not is_neox, mrope_interleaved)


def math_in_query_dtype(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                        mrope_interleaved=False):
    """The cache cast to query's dtype (as vLLM's forward_native does) and the math in it: 16-bit roundings."""
    cos, sin = tables(positions, cos_sin_cache, mrope_section, mrope_interleaved, query.shape[0], dtype=query.dtype)
    for x in (query, key):
        if x is not None:
            x.copy_(rotated(x, cos, sin, head_size, is_neox, query.dtype))
    return query, key


def interleaved_one_pair_too_many(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                                  mrope_interleaved=False):
    """Qwen3-VL's streams 1 and 2 run one pair past 3 * section (the slice's end off by one stride)."""
    cos, sin = tables(positions, cos_sin_cache, mrope_section, mrope_interleaved, query.shape[0], extra=3)
    for x in (query, key):
        if x is not None:
            x.copy_(rotated(x, cos, sin, head_size, is_neox))
    return query, key


def streams_reversed(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                     mrope_interleaved=False):
    """Positions stacked width, height, temporal: section m reads stream 2 - m."""
    flipped = positions.flip(0) if positions.dim() == 2 else positions
    return correct(flipped, query, key, head_size, cos_sin_cache, mrope_section, is_neox, mrope_interleaved)


def partner_at_half_head(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                         mrope_interleaved=False):
    """NeoX pairs (i, i + head_size/2) instead of (i, i + rot/2): wrong under partial rotary."""
    cos, sin = tables(positions, cos_sin_cache, mrope_section, mrope_interleaved, query.shape[0])
    for x in (query, key):
        if x is not None:
            x.copy_(rotated(x, cos, sin, head_size, is_neox, partner_offset=head_size // 2))
    return query, key


def reads_as_contiguous(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                        mrope_interleaved=False):
    """Reads and writes query's memory as if it were contiguous (a kernel ignoring the row stride)."""
    if query.is_contiguous():
        return correct(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox, mrope_interleaved)
    flat = query.as_strided(query.shape, torch.empty(query.shape).stride(), query.storage_offset())
    correct(positions, flat, key, head_size, cos_sin_cache, mrope_section, is_neox, mrope_interleaved)
    return query, key


def empty_returns_none(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                       mrope_interleaved=False):
    """An early exit for T = 0 that returns nothing (as vLLM's in-place `rotary_embedding` op does), not (query,
    key): only an empty input exposes it."""
    if not query.shape[0]:
        return None
    return correct(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox, mrope_interleaved)


CORRECT = correct
BUGS = {
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "empty_returns_none": (empty_returns_none, ("forward",)),
    "first_row_positions": (first_row_positions, ("forward",)),
    "key_none_rotates_query_twice": (key_none_rotates_query_twice, ("forward", "key_none")),
    "new_tensors_promised_in_place": (new_tensors_promised_in_place, ("forward",)),
    "is_neox_inverted": (is_neox_inverted, ("forward", "is_neox")),
    "math_in_query_dtype": (math_in_query_dtype, ("forward",)),
    "interleaved_one_pair_too_many": (interleaved_one_pair_too_many, ("forward",)),
    "streams_reversed": (streams_reversed, ("forward",)),
    "partner_at_half_head": (partner_at_half_head, ("forward",)),
    "reads_as_contiguous": (reads_as_contiguous, ("forward",)),
}
