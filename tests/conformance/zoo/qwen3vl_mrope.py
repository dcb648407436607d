"""Qwen3-VL's interleaved multimodal RoPE (spec/qwen3vl_mrope.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch

from .hf_mrope import _SelfAdjoint, rotate, select_sections


def interleaved_streams(tab, mrope_section, offsets=(1, 2), extra=0, half=True):
    """transformers' `apply_interleaved_mrope` on full-width tables: stream 0's table, with pairs m, m + 3, ...
    below 3 * section[m] + extra taken from stream m (offsets: where streams 1 and 2 start); `half`: the rule
    counts pairs (channel modulo d/2), else channels."""
    d = tab.shape[-1]
    channel = torch.arange(d, device=tab.device)
    pair = channel % (d // 2) if half else channel
    out = tab[0]
    for m, offset in zip((1, 2), offsets, strict=True):
        take = (pair % 3 == offset % 3) & (pair >= offset) & (pair < 3 * mrope_section[m] + extra)
        out = torch.where(take, tab[m], out)
    return out


def correct(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    return rotate(q, k, interleaved_streams(cos, mrope_section), interleaved_streams(sin, mrope_section),
                  unsqueeze_dim)


def math_depends_on_batch(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """One sequence computes in float64, a batch in float32 (a kernel picking its path by the batch size): each result
    within one rounding, forward and backward, but a sequence's result depends on what else is in the batch."""
    return rotate(q, k, interleaved_streams(cos, mrope_section), interleaved_streams(sin, mrope_section),
                  unsqueeze_dim, math_dtype=torch.float64 if q.shape[0] == 1 else torch.float32)


def consecutive_sections(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Qwen2-VL's consecutive sections on Qwen3-VL's tables (the layout flag forgotten)."""
    return rotate(q, k, select_sections(cos, mrope_section), select_sections(sin, mrope_section), unsqueeze_dim)


def streams_start_one_early(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Streams 1 and 2 start at pairs 0 and 1 (enumerate((1, 2)) read as the offsets minus one)."""
    return rotate(q, k, interleaved_streams(cos, mrope_section, (0, 1)),
                  interleaved_streams(sin, mrope_section, (0, 1)), unsqueeze_dim)


def one_pair_too_many(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Streams 1 and 2 run to pair 3 * section + m inclusive: one pair each beyond their section."""
    return rotate(q, k, interleaved_streams(cos, mrope_section, extra=3), interleaved_streams(sin, mrope_section,
                                                                                              extra=3), unsqueeze_dim)


def rule_over_channels(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """The interleaving applied to the full-width table's channels, not to the pairs (the second half then
    reads other streams than the first)."""
    return rotate(q, k, interleaved_streams(cos, mrope_section, half=False),
                  interleaved_streams(sin, mrope_section, half=False), unsqueeze_dim)


def height_width_swapped(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Streams 1 and 2 exchanged (tables stacked temporal, width, height)."""
    return correct(q, k, cos[[0, 2, 1]], sin[[0, 2, 1]], mrope_section, unsqueeze_dim)


def stream_zero_only(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """The temporal table for every pair (a [3, ...] table read as its first row)."""
    return rotate(q, k, cos[0], sin[0], unsqueeze_dim)


def math_in_input_dtype(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Products and sum in q's dtype: several roundings in 16-bit."""
    return rotate(q, k, interleaved_streams(cos, mrope_section), interleaved_streams(sin, mrope_section),
                  unsqueeze_dim, q.dtype)


def backward_not_transposed(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """The backward applies the rotation itself instead of its transpose."""
    cos, sin = (interleaved_streams(t, mrope_section).unsqueeze(unsqueeze_dim) for t in (cos, sin))
    return _SelfAdjoint.apply(q, cos, sin), _SelfAdjoint.apply(k, cos, sin)


CORRECT = correct
BUGS = {
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "consecutive_sections": (consecutive_sections, ("forward",)),
    "streams_start_one_early": (streams_start_one_early, ("forward",)),
    "one_pair_too_many": (one_pair_too_many, ("forward",)),
    "rule_over_channels": (rule_over_channels, ("forward",)),
    "height_width_swapped": (height_width_swapped, ("forward",)),
    "stream_zero_only": (stream_zero_only, ("forward",)),
    "math_in_input_dtype": (math_in_input_dtype, ("forward",)),
    "backward_not_transposed": (backward_not_transposed, ("backward",)),
}
