"""transformers' multimodal RoPE (spec/hf_mrope.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch

from .hf import _embed
from .hf import _SignFlippedBackward as _SelfAdjoint
from .hf import pairs_at_head_half as _pairs_at_head_half


def select_sections(cos, mrope_section):
    """transformers' selection: the section list doubled over both halves, chunk i from stream i % 3."""
    return torch.cat([m[i % 3] for i, m in enumerate(cos.split(list(mrope_section) * 2, dim=-1))], dim=-1)


def rotate(q, k, cos, sin, unsqueeze_dim, math_dtype=torch.float32, out=None):
    out = out or torch.promote_types(q.dtype, cos.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _embed(q, cos, sin, out, math_dtype), _embed(k, cos, sin, out, math_dtype)


def correct(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    return rotate(q, k, select_sections(cos, mrope_section), select_sections(sin, mrope_section), unsqueeze_dim)


def math_depends_on_batch(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """One sequence computes in float64, a batch in float32 (a kernel picking its path by the batch size): each result
    within one rounding, but a sequence's result depends on what else is in the batch."""
    return rotate(q, k, select_sections(cos, mrope_section), select_sections(sin, mrope_section), unsqueeze_dim,
                  math_dtype=torch.float64 if q.shape[0] == 1 else torch.float32)


def sections_not_doubled(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """The sections applied over the first half only; the second half keeps stream 0 (the list not doubled)."""
    h = cos.shape[-1] // 2

    def pick(tab):
        first = torch.cat([m[i] for i, m in enumerate(tab[..., :h].split(list(mrope_section), dim=-1))], dim=-1)
        return torch.cat([first, tab[0, ..., h:]], dim=-1)

    return rotate(q, k, pick(cos), pick(sin), unsqueeze_dim)


def pair_index_mod_3(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Qwen3-VL's rule on Qwen2-VL's layout: pair i reads stream i % 3 (every pair, the sections ignored)."""
    channel = torch.arange(cos.shape[-1], device=cos.device)
    stream = (channel % (cos.shape[-1] // 2)) % 3

    def pick(tab):
        return torch.where(stream == 0, tab[0], torch.where(stream == 1, tab[1], tab[2]))

    return rotate(q, k, pick(cos), pick(sin), unsqueeze_dim)


def stream_zero_only(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """The temporal table for every pair (text-only RoPE applied to an image's tokens)."""
    return rotate(q, k, cos[0], sin[0], unsqueeze_dim)


def streams_reversed(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Section m read from stream 2 - m (the tables stacked width, height, temporal)."""
    return correct(q, k, cos.flip(0), sin.flip(0), mrope_section, unsqueeze_dim)


def k_reads_stream_zero(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """k rotated with the unselected temporal table (the selection done for q's branch only)."""
    qo, _ = correct(q, k, cos, sin, mrope_section, unsqueeze_dim)
    return qo, rotate(k, k, cos[0], sin[0], unsqueeze_dim, out=qo.dtype)[0]


def first_half_of_tables(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """One angle per pair read from the first half of each row (Liger's kernel): wrong where the halves differ."""
    h = cos.shape[-1] // 2
    return correct(q, k, torch.cat([cos[..., :h]] * 2, -1), torch.cat([sin[..., :h]] * 2, -1), mrope_section,
                   unsqueeze_dim)


def first_sequence_tables(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """cos[:, 0] for every sequence of the batch (the batch stride of the tables ignored)."""
    return correct(q, k, cos[:, :1], sin[:, :1], mrope_section, unsqueeze_dim)


def math_in_input_dtype(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Products and sum in q's dtype: several roundings in 16-bit."""
    return rotate(q, k, select_sections(cos, mrope_section), select_sections(sin, mrope_section), unsqueeze_dim,
                  q.dtype)


def unsqueeze_dim_ignored(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """The tables broadcast over dim 1 whatever unsqueeze_dim says: [b, s, h, d] read as [b, h, s, d]."""
    if unsqueeze_dim == 1:
        return correct(q, k, cos, sin, mrope_section, 1)
    def as_bhsd(x):  # the memory of [b, s, h, d] reinterpreted, as a kernel ignoring the layout does
        return x.reshape(x.shape[0], x.shape[2], x.shape[1], x.shape[3])

    qo, ko = correct(as_bhsd(q), as_bhsd(k), cos, sin, mrope_section, 1)
    return qo.reshape(q.shape), ko.reshape(k.shape)


def backward_not_transposed(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """The backward applies the rotation itself instead of its transpose."""
    cos, sin = (select_sections(t, mrope_section).unsqueeze(unsqueeze_dim) for t in (cos, sin))
    return _SelfAdjoint.apply(q, cos, sin), _SelfAdjoint.apply(k, cos, sin)


def pairs_at_head_half(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Partial rotary with the partner at i + d/2 (the head's half) instead of i + r/2."""
    return _pairs_at_head_half(q, k, select_sections(cos, mrope_section), select_sections(sin, mrope_section), None,
                               unsqueeze_dim)


def pass_through_zeroed(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """Only the rotated channels written into a zeroed output: channels r.. are 0, not q's."""
    r = cos.shape[-1]
    return tuple(torch.cat([o[..., :r], torch.zeros_like(o[..., r:])], -1)
                 for o in correct(q, k, cos, sin, mrope_section, unsqueeze_dim))


CORRECT = correct
BUGS = {
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "sections_not_doubled": (sections_not_doubled, ("forward",)),
    "pair_index_mod_3": (pair_index_mod_3, ("forward", "relabel_streams")),
    "stream_zero_only": (stream_zero_only, ("forward",)),
    "streams_reversed": (streams_reversed, ("forward", "relabel_streams")),
    "k_reads_stream_zero": (k_reads_stream_zero, ("forward",)),
    "first_half_of_tables": (first_half_of_tables, ("forward",)),
    "first_sequence_tables": (first_sequence_tables, ("forward",)),
    "math_in_input_dtype": (math_in_input_dtype, ("forward",)),
    "unsqueeze_dim_ignored": (unsqueeze_dim_ignored, ("forward", "unsqueeze_dim")),
    "backward_not_transposed": (backward_not_transposed, ("backward",)),
    # partial rotary
    "pairs_at_head_half": (pairs_at_head_half, ("forward", "partial_is_sliced")),
    "pass_through_zeroed": (pass_through_zeroed, ("forward", "partial_is_sliced")),
}
