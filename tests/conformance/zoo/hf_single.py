"""transformers' one-tensor form (spec/hf_single.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch

from . import rotate_half
from .hf import _embed
from .hf import _SignFlippedBackward as _SelfAdjoint
from .hf import pairs_at_head_half as _pairs_at_head_half


def correct(x, cos, sin, unsqueeze_dim=1):
    out = torch.promote_types(x.dtype, cos.dtype)
    return _embed(x, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim), out)


def whole_head(x, cos, sin, unsqueeze_dim=1):
    """Gemma's whole-head expression on narrower tables: every channel rotated, pairs (i, i + d/2), channel c
    reading column c % r (the rotary width not passed on)."""
    r, d = cos.shape[-1], x.shape[-1]
    if r == d:
        return correct(x, cos, sin, unsqueeze_dim)
    idx = (torch.arange(d // 2 * 2) % r).to(cos.device)
    return correct(x, cos[..., idx], sin[..., idx], unsqueeze_dim)


def pairs_at_head_half(x, cos, sin, unsqueeze_dim=1):
    """Partial rotary pairing channel i with i + d/2 instead of i + r/2 (i < r/2)."""
    return _pairs_at_head_half(x, x, cos, sin, None, unsqueeze_dim)[0]


def pass_through_scaled(x, cos, sin, unsqueeze_dim=1):
    """Channels r.. multiplied by the tables' last cos column (one expression over the whole head, cos padded with
    its edge value instead of ones)."""
    out = correct(x, cos, sin, unsqueeze_dim)
    r = cos.shape[-1]
    edge = cos.unsqueeze(unsqueeze_dim)[..., -1:].to(out.dtype)
    return torch.cat([out[..., :r], out[..., r:] * edge], -1)


def unsqueeze_dim_ignored(x, cos, sin, unsqueeze_dim=1):
    """The tables broadcast over dim 1 whatever unsqueeze_dim says: [b, s, h, d] read as [b, h, s, d]."""
    if unsqueeze_dim == 1:
        return correct(x, cos, sin, 1)
    return correct(x.reshape(x.shape[0], x.shape[2], x.shape[1], x.shape[3]), cos, sin, 1).reshape(x.shape)


def first_half_of_tables(x, cos, sin, unsqueeze_dim=1):
    """One angle per pair from the first half of each row: wrong where the halves differ."""
    h = cos.shape[-1] // 2
    return correct(x, torch.cat([cos[..., :h]] * 2, -1), torch.cat([sin[..., :h]] * 2, -1), unsqueeze_dim)


def math_in_input_dtype(x, cos, sin, unsqueeze_dim=1):
    """The products and the sum in x's dtype: several roundings in 16-bit."""
    out = torch.promote_types(x.dtype, cos.dtype)
    return _embed(x, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim), out, x.dtype)


def writes_x(x, cos, sin, unsqueeze_dim=1):
    """Returns a new tensor but also writes the result into the caller's x."""
    out = correct(x, cos, sin, unsqueeze_dim)
    if out.dtype == x.dtype:
        x.detach().copy_(out)
    return out


def sign_flipped(x, cos, sin, unsqueeze_dim=1):
    """rotate_half's negation on the second half: a rotation by -theta."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    out = torch.promote_types(x.dtype, cos.dtype)
    r = cos.shape[-1]
    xm = x[..., :r].float()
    rot = xm * cos.float() - rotate_half(xm) * sin.float()
    return torch.cat([rot.to(out), x[..., r:].to(out)], -1)


def many_heads_round_otherwise(x, cos, sin, unsqueeze_dim=1):
    """More than two heads take another code path, evaluated in float64: within the accuracy model, but a call on
    some of the heads no longer gives the same bits."""
    if x.shape[unsqueeze_dim] <= 2:
        return correct(x, cos, sin, unsqueeze_dim)
    out = torch.promote_types(x.dtype, cos.dtype)
    return _embed(x, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim), out, torch.float64)


def backward_not_transposed(x, cos, sin, unsqueeze_dim=1):
    """The backward applies the rotation itself instead of its transpose."""
    return _SelfAdjoint.apply(x, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))


CORRECT = correct
BUGS = {
    "whole_head": (whole_head, ("forward", "partial_is_sliced")),
    "pairs_at_head_half": (pairs_at_head_half, ("forward", "partial_is_sliced")),
    "pass_through_scaled": (pass_through_scaled, ("forward", "partial_is_sliced")),
    "unsqueeze_dim_ignored": (unsqueeze_dim_ignored, ("forward", "unsqueeze_transposed")),
    "first_half_of_tables": (first_half_of_tables, ("forward",)),
    "math_in_input_dtype": (math_in_input_dtype, ("forward",)),
    "writes_x": (writes_x, ("forward",)),
    "sign_flipped": (sign_flipped, ("forward",)),
    "backward_not_transposed": (backward_not_transposed, ("backward",)),
    # within the accuracy model: only the invariant sees it
    "many_heads_round_otherwise": (many_heads_round_otherwise, ("heads_together",)),
}
