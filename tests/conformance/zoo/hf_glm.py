"""transformers' GLM convention (spec/hf_glm.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch

from .hf import _embed


class _SelfAdjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _embed(x, cos, sin, torch.promote_types(x.dtype, cos.dtype), interleaved=True)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _embed(g, cos, sin, ctx.x_dtype, interleaved=True), None, None  # R, not its transpose


def first_half(tab, unsqueeze_dim):
    """GLM's tables: the first half of each row, each column repeated for both channels of its pair."""
    tab = tab.unsqueeze(unsqueeze_dim)
    return tab[..., : tab.shape[-1] // 2].repeat_interleave(2, dim=-1)


def rotate(q, k, cos, sin, math_dtype=torch.float32, interleaved=True):
    out = torch.promote_types(q.dtype, cos.dtype)
    return tuple(_embed(x, cos, sin, out, math_dtype, interleaved) for x in (q, k))


def correct(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return rotate(q, k, first_half(cos, unsqueeze_dim), first_half(sin, unsqueeze_dim))


def eager(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """GLM's expression as transformers' models run it eagerly, each operation rounded to torch's promotion of its
    operands' dtypes (not a planted bug: the schedule `eager`, within the `dtype` accuracy model)."""
    cos, sin = first_half(cos, unsqueeze_dim), first_half(sin, unsqueeze_dim)
    out = []
    for x in (q, k):
        r = cos.shape[-1]
        x_rot, x_pass = x[..., :r], x[..., r:]
        partner = torch.stack((-x_rot[..., 1::2], x_rot[..., ::2]), dim=-1).flatten(-2)
        embed = x_rot * cos + partner * sin
        out.append(torch.cat([embed, x_pass.to(embed.dtype)], dim=-1))
    return tuple(out)


def half_split_pairs(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Llama's rotate_half (pairs (i, i + r/2)) on GLM's interleaved tables."""
    return rotate(q, k, first_half(cos, unsqueeze_dim), first_half(sin, unsqueeze_dim), interleaved=False)


def second_half_of_tables(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Pair i reads column i of the second half (cos[..., r/2:]): right only where the halves agree."""
    h = cos.shape[-1] // 2
    return correct(q, k, torch.cat([cos[..., h:]] * 2, -1), torch.cat([sin[..., h:]] * 2, -1), position_ids,
                   unsqueeze_dim)


def tables_per_channel(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The tables read one column per channel (channel c reads cos[..., c]) as for rotate_half, not one per pair."""
    return rotate(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))


def repeat_not_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """`.repeat(2)` for `.repeat_interleave(2)`: channel c reads column c % (r/2) of the first half."""
    c, s = (t.unsqueeze(unsqueeze_dim) for t in (cos, sin))
    h = c.shape[-1] // 2
    return rotate(q, k, c[..., :h].repeat(*(1,) * (c.dim() - 1), 2), s[..., :h].repeat(*(1,) * (s.dim() - 1), 2))


def rotary_width_halved(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The rotary width taken as the halved table's width (r/2): channels r/2.. passed through."""
    c, s = (first_half(t, unsqueeze_dim) for t in (cos, sin))
    h = c.shape[-1] // 2
    if h % 2:
        return rotate(q, k, c, s)
    return rotate(q, k, c[..., :h], s[..., :h])


def pass_through_zeroed(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Only the rotated channels written into a zeroed output: channels r.. are 0."""
    r = cos.shape[-1]
    return tuple(torch.cat([o[..., :r], torch.zeros_like(o[..., r:])], -1)
                 for o in correct(q, k, cos, sin, position_ids, unsqueeze_dim))


def sign_flipped(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The partner's sign on the second member of each pair (stack((x2, -x1))): a rotation by -theta."""
    return rotate(q, k, first_half(cos, unsqueeze_dim), -first_half(sin, unsqueeze_dim))


def math_in_input_dtype(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The products and the sum in q's dtype: several roundings in 16-bit."""
    return rotate(q, k, first_half(cos, unsqueeze_dim), first_half(sin, unsqueeze_dim), q.dtype)


def unsqueeze_dim_ignored(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The tables broadcast over dim 1 whatever unsqueeze_dim says: [b, s, h, d] read as [b, h, s, d]."""
    if unsqueeze_dim == 1:
        return correct(q, k, cos, sin, position_ids, 1)
    def as_bhsd(x):
        return x.reshape(x.shape[0], x.shape[2], x.shape[1], x.shape[3])

    qo, ko = correct(as_bhsd(q), as_bhsd(k), cos, sin, position_ids, 1)
    return qo.reshape(q.shape), ko.reshape(k.shape)


def backward_not_transposed(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The backward applies the rotation itself instead of its transpose."""
    c, s = first_half(cos, unsqueeze_dim), first_half(sin, unsqueeze_dim)
    return _SelfAdjoint.apply(q, c, s), _SelfAdjoint.apply(k, c, s)


CORRECT = correct
BUGS = {
    "half_split_pairs": (half_split_pairs, ("forward",)),
    "second_half_of_tables": (second_half_of_tables, ("forward", "second_half_unread")),
    "tables_per_channel": (tables_per_channel, ("forward", "second_half_unread")),
    "repeat_not_interleave": (repeat_not_interleave, ("forward",)),
    "rotary_width_halved": (rotary_width_halved, ("forward",)),
    "pass_through_zeroed": (pass_through_zeroed, ("forward", "partial_is_sliced")),
    "sign_flipped": (sign_flipped, ("forward",)),
    "math_in_input_dtype": (math_in_input_dtype, ("forward",)),
    "unsqueeze_dim_ignored": (unsqueeze_dim_ignored, ("forward", "unsqueeze_transposed")),
    "backward_not_transposed": (backward_not_transposed, ("backward",)),
}
