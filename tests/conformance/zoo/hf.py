"""transformers' convention (spec/hf.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch

from . import rotate_half


def _embed(x, cos, sin, out_dtype, math_dtype=torch.float32):
    xm = x.to(math_dtype)  # converted once: the backward then rounds the summed gradient once
    return (xm * cos.to(math_dtype) + rotate_half(xm) * sin.to(math_dtype)).to(out_dtype)


def correct(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    out = torch.promote_types(q.dtype, cos.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _embed(q, cos, sin, out), _embed(k, cos, sin, out)


def k_rotates_q(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """k's expression reads rotate_half(q) (a typo that survives when k is a copy of q)."""
    out = torch.promote_types(q.dtype, cos.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    kf = k.float() * cos.float() + rotate_half(q.float()[:, : k.shape[1]] if unsqueeze_dim == 1 else
                                              q.float()[:, :, : k.shape[2]]) * sin.float()
    return _embed(q, cos, sin, out), kf.to(out)


def unsqueeze_dim_ignored(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Positions read along dim 2 whatever unsqueeze_dim says: [b, s, h, d] rotated by the heads' index."""
    out = torch.promote_types(q.dtype, cos.dtype)
    if unsqueeze_dim == 1:
        return correct(q, k, cos, sin, position_ids, unsqueeze_dim)

    def embed(x):
        idx = torch.arange(x.shape[2], device=cos.device) % cos.shape[1]
        return _embed(x, cos[:, idx].unsqueeze(1), sin[:, idx].unsqueeze(1), out)

    return embed(q), embed(k)


def first_sequence_tables(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """cos[0] for every sequence of the batch (a kernel that indexes the table without the batch stride)."""
    return correct(q, k, cos[:1], sin[:1], position_ids, unsqueeze_dim)


def math_in_input_dtype(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The products and the sum in q's dtype: several roundings in 16-bit."""
    out = torch.promote_types(q.dtype, cos.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _embed(q, cos, sin, out, q.dtype), _embed(k, cos, sin, out, q.dtype)


def first_half_of_tables(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Reads cos/sin[..., :d/2] for both halves (one angle per pair): wrong where the halves differ."""
    h = cos.shape[-1] // 2
    return correct(q, k, torch.cat([cos[..., :h]] * 2, -1), torch.cat([sin[..., :h]] * 2, -1), position_ids,
                   unsqueeze_dim)


def writes_q(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Returns new tensors but also writes the rotated q into the caller's q."""
    qo, ko = correct(q, k, cos, sin, position_ids, unsqueeze_dim)
    if qo.dtype == q.dtype:
        q.detach().copy_(qo)
    return qo, ko


def reads_as_contiguous(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Reads q's memory as if it were contiguous (a kernel that ignores strides)."""
    qc = q.detach().as_strided(q.shape, torch.empty(q.shape).stride(), q.storage_offset()) \
        if not q.is_contiguous() else q
    return correct(qc, k, cos, sin, position_ids, unsqueeze_dim)


def returns_float32(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The float32 result, not rounded to the promoted dtype."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _embed(q, cos, sin, torch.float32), _embed(k, cos, sin, torch.float32)


class _SignFlippedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _embed(x, cos, sin, torch.promote_types(x.dtype, cos.dtype))

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _embed(g, cos, sin, ctx.x_dtype), None, None  # R, not its transpose


def backward_not_transposed(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The backward applies the rotation itself instead of its transpose (the inverse)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _SignFlippedBackward.apply(q, cos, sin), _SignFlippedBackward.apply(k, cos, sin)


def transposed_layout_rounds_otherwise(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The [b, s, h, d] path (unsqueeze_dim=2) evaluates in float64: within the accuracy model, but not the
    unsqueeze_dim=1 path's bits for the same values (two kernels that disagree on the last bit)."""
    if unsqueeze_dim == 1:
        return correct(q, k, cos, sin, position_ids, unsqueeze_dim)
    out = torch.promote_types(q.dtype, cos.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _embed(q, cos, sin, out, torch.float64), _embed(k, cos, sin, out, torch.float64)


def batched_tables_round_otherwise(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """One table per sequence (cos batch > 1) takes another code path, evaluated in float64: a batch-1 table
    expanded over the batch no longer gives the batch-1 call's bits."""
    if cos.shape[0] == 1:
        return correct(q, k, cos, sin, position_ids, unsqueeze_dim)
    out = torch.promote_types(q.dtype, cos.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _embed(q, cos, sin, out, torch.float64), _embed(k, cos, sin, out, torch.float64)


CORRECT = correct
BUGS = {
    "k_rotates_q": (k_rotates_q, ("forward", "backward", "q_k_independent", "swap_q_k")),
    "unsqueeze_dim_ignored": (unsqueeze_dim_ignored, ("forward", "unsqueeze_transposed")),
    "first_sequence_tables": (first_sequence_tables, ("forward",)),
    "math_in_input_dtype": (math_in_input_dtype, ("forward",)),
    "first_half_of_tables": (first_half_of_tables, ("forward",)),
    "writes_q": (writes_q, ("forward",)),
    "reads_as_contiguous": (reads_as_contiguous, ("forward",)),
    "returns_float32": (returns_float32, ("forward",)),
    "backward_not_transposed": (backward_not_transposed, ("backward",)),
    # within the accuracy model: only the invariants see them
    "transposed_layout_rounds_otherwise": (transposed_layout_rounds_otherwise, ("unsqueeze_transposed",)),
    "batched_tables_round_otherwise": (batched_tables_round_otherwise, ("tables_batch_broadcast",)),
}
