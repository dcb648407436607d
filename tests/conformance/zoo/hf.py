"""transformers' convention (spec/hf.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch

from . import channels_adjacent, rotate_half


def _embed(x, cos, sin, out_dtype, math_dtype=torch.float32, interleaved=False):
    """transformers' expression on x[..., :r] (r = cos.shape[-1]), x[..., r:] passed through."""
    r = cos.shape[-1]
    xm = x[..., :r].to(math_dtype)  # converted once: the backward then rounds the summed gradient once
    rot = (xm * cos.to(math_dtype) + rotate_half(xm, interleaved) * sin.to(math_dtype)).to(out_dtype)
    return torch.cat([rot, x[..., r:].to(out_dtype)], dim=-1)


def correct(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    out = torch.promote_types(q.dtype, cos.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _embed(q, cos, sin, out), _embed(k, cos, sin, out)


_CALLS = [0]


def math_changes_between_calls(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Every other call computes in float64 instead of float32 (a kernel picking its path by a counter, a heuristic
    or the device's load): each result within one rounding, but two identical calls may differ in the last bit."""
    _CALLS[0] += 1
    out = torch.promote_types(q.dtype, cos.dtype)
    math = torch.float64 if _CALLS[0] % 2 else torch.float32
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _embed(q, cos, sin, out, math), _embed(k, cos, sin, out, math)


def eager(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' expression as its models run it eagerly, each operation rounded to torch's promotion of its
    operands' dtypes (not a planted bug: the schedule `eager`, within the `dtype` accuracy model, not the float32
    one)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return tuple(_as_transformers(x, cos, sin) for x in (q, k))


def _as_transformers(x, cos, sin):
    r = cos.shape[-1]
    out = torch.promote_types(x.dtype, cos.dtype)
    x_rot, x_pass = x[..., :r], x[..., r:]
    embed = (x_rot * cos) + (rotate_half(x_rot) * sin)
    return torch.cat([embed.to(out), x_pass.to(out)], dim=-1)


def math_depends_on_batch(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """A single sequence computes in float64, a batch in float32 (a kernel picking its path by the batch size): each
    result within one rounding, but a sequence's result depends on what else is in the batch."""
    out = torch.promote_types(q.dtype, cos.dtype)
    math = torch.float64 if q.shape[0] == 1 else torch.float32
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _embed(q, cos, sin, out, math), _embed(k, cos, sin, out, math)


def k_rotates_q(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """k's expression reads rotate_half(q) (a typo that survives when k is a copy of q)."""
    out = torch.promote_types(q.dtype, cos.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    qk = q[:, : k.shape[1]] if unsqueeze_dim == 1 else q[:, :, : k.shape[2]]
    kf = k[..., :r].float() * cos.float() + rotate_half(qk[..., :r].float()) * sin.float()
    return _embed(q, cos, sin, out), torch.cat([kf.to(out), k[..., r:].to(out)], dim=-1)


def unsqueeze_dim_ignored(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Positions read along dim 2 whatever unsqueeze_dim says: [b, s, h, d] rotated by the heads' index."""
    out = torch.promote_types(q.dtype, cos.dtype)
    if unsqueeze_dim == 1 or not cos.shape[1]:  # (no tokens: nothing to read along any dim)
        return correct(q, k, cos, sin, position_ids, unsqueeze_dim)

    def embed(x):
        idx = torch.arange(x.shape[2], device=cos.device) % max(1, cos.shape[1])
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


# ---- partial rotary (tables narrower than the head)

def pairs_at_head_half(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Partial rotary with the partner at i + d/2 (the head's half) instead of i + r/2: pairs (i, i + d/2) for
    i < r/2 take the tables' columns i and i + r/2; the other channels pass through."""
    out = torch.promote_types(q.dtype, cos.dtype)
    r, d = cos.shape[-1], q.shape[-1]
    if r == d:
        return correct(q, k, cos, sin, position_ids, unsqueeze_dim)
    channels = torch.cat([torch.arange(r // 2), torch.arange(r // 2) + d // 2]).to(q.device)
    rest = torch.tensor([c for c in range(d) if c not in channels.tolist()], dtype=torch.int64).to(q.device)
    order = torch.argsort(torch.cat([channels, rest]))
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return tuple(_embed(torch.cat([x[..., channels], x[..., rest]], -1), cos, sin, out)[..., order] for x in (q, k))


def rotary_from_the_end(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The last r channels rotated, the first d - r passed through (a rope/nope split read in the other order)."""
    out = torch.promote_types(q.dtype, cos.dtype)
    r, d = cos.shape[-1], q.shape[-1]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return tuple(_embed(x.roll(r - d, -1), cos, sin, out).roll(d - r, -1) for x in (q, k))


def pass_through_zeroed(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Only the rotated channels written into a zeroed output: channels r.. are 0, not q's."""
    qo, ko = correct(q, k, cos, sin, position_ids, unsqueeze_dim)
    r = cos.shape[-1]
    return tuple(torch.cat([o[..., :r], torch.zeros_like(o[..., r:])], -1) for o in (qo, ko))


def odd_tail_dropped(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The passed-through channels copied two at a time: of an odd count, the last one is left 0."""
    qo, ko = correct(q, k, cos, sin, position_ids, unsqueeze_dim)
    if (q.shape[-1] - cos.shape[-1]) % 2 == 0:
        return qo, ko
    return tuple(torch.cat([o[..., :-1], torch.zeros_like(o[..., -1:])], -1) for o in (qo, ko))


def whole_head_tables_tiled(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Tables narrower than the head repeated across it: the whole head rotated (pairs (i, i + d/2)), as a kernel
    that knows no rotary width; an odd head keeps its last channel."""
    r, d = cos.shape[-1], q.shape[-1]
    if r == d:
        return correct(q, k, cos, sin, position_ids, unsqueeze_dim)
    idx = (torch.arange(d // 2 * 2) % r).to(cos.device)
    return correct(q, k, cos[..., idx], sin[..., idx], position_ids, unsqueeze_dim)


# ---- bugs of the declared classes (spec/domains.py): mixed 16-bit tables, s = 0, upstream gradient layouts, GQA
# with one table per sequence

def mixed_tables_cast_to_q(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """cos/sin of the other 16-bit dtype cast to q's first (a kernel built for tables in q's dtype or float32):
    float16 q with bfloat16 tables is rounded through float16 and returned as float16, not the promoted float32."""
    sixteen = (torch.float16, torch.bfloat16)
    if q.dtype in sixteen and cos.dtype in sixteen and cos.dtype != q.dtype:
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return correct(q, k, cos, sin, position_ids, unsqueeze_dim)


def empty_returns_flat(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """An early exit for s = 0 that returns flat empty tensors, not q's and k's shapes."""
    if not q.numel():
        out = torch.promote_types(q.dtype, cos.dtype)
        return q.new_empty(0, dtype=out), k.new_empty(0, dtype=out)
    return correct(q, k, cos, sin, position_ids, unsqueeze_dim)


def empty_returns_inputs(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """An early exit for s = 0 that returns q and k themselves (new tensors are promised; the dtype is right where q's
    is the promoted one): an identity no value or memory comparison sees, since empty tensors hold no bytes."""
    if not q.numel():
        out = torch.promote_types(q.dtype, cos.dtype)
        return q if q.dtype == out else q.to(out), k if k.dtype == out else k.to(out)
    return correct(q, k, cos, sin, position_ids, unsqueeze_dim)


def _dense_strides(shape) -> list:
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return strides


def channels_read_as_adjacent(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Reads q's and k's channels as adjacent (a kernel that takes the row strides and assumes dense channels):
    right wherever the channels are adjacent, wrong for a head whose last dim has another stride."""
    return correct(channels_adjacent(q), channels_adjacent(k), cos, sin, position_ids, unsqueeze_dim)


class _GradReadAsContiguous(torch.autograd.Function):
    """The rotation, whose backward reads the upstream gradient through dense strides from its data pointer (a
    kernel handed g.data_ptr() alone): right for a contiguous g only."""

    @staticmethod
    def forward(ctx, x, cos, sin, out_dtype):
        ctx.save_for_backward(x, cos, sin)
        ctx.out_dtype = out_dtype
        return _embed(x, cos, sin, out_dtype)

    @staticmethod
    def backward(ctx, g):
        x, cos, sin = ctx.saved_tensors
        g = torch.as_strided(g, g.shape, _dense_strides(g.shape), g.storage_offset())
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            (grad,) = torch.autograd.grad(_embed(leaf, cos, sin, ctx.out_dtype), leaf, g)
        return grad, None, None, None


def grad_read_as_contiguous(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The backward reads the upstream gradients as if they were contiguous: wrong for a strided one, out of bounds
    for an expanded one (stride 0)."""
    out = torch.promote_types(q.dtype, cos.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _GradReadAsContiguous.apply(q, cos, sin, out), _GradReadAsContiguous.apply(k, cos, sin, out)


class _GradUnitLastStride(_GradReadAsContiguous):
    """The rotation, whose backward reads the upstream gradient through its own strides but the last taken as 1 (a
    kernel that keeps the row strides and assumes dense channels): right wherever g's channels are adjacent."""

    @staticmethod
    def backward(ctx, g):
        x, cos, sin = ctx.saved_tensors
        g = channels_adjacent(g)
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            (grad,) = torch.autograd.grad(_embed(leaf, cos, sin, ctx.out_dtype), leaf, g)
        return grad, None, None, None


def grad_channels_read_as_adjacent(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The backward reads the upstream gradients' channels as adjacent (last-dim stride 1), whatever their stride."""
    out = torch.promote_types(q.dtype, cos.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _GradUnitLastStride.apply(q, cos, sin, out), _GradUnitLastStride.apply(k, cos, sin, out)


class _KGradBatchByQHeads(torch.autograd.Function):
    """k's rotation; its backward picks each (sequence, head) row's table by the row's index over q's head count
    (row // hq) instead of k's: with GQA and one table per sequence, k's heads read other sequences' tables."""

    @staticmethod
    def forward(ctx, k, cos, sin, out_dtype, hq, dim):
        ctx.save_for_backward(k, cos, sin)
        ctx.out_dtype, ctx.hq, ctx.dim = out_dtype, hq, dim
        return _embed(k, cos.unsqueeze(dim), sin.unsqueeze(dim), out_dtype)

    @staticmethod
    def backward(ctx, g):
        k, cos, sin = ctx.saved_tensors
        b, hk = k.shape[0], k.shape[ctx.dim]
        batch = (torch.arange(b * hk, device=k.device) // ctx.hq).clamp(max=cos.shape[0] - 1)
        c, s = (t[batch].unflatten(0, (b, hk)) for t in (cos, sin))  # [b, hk, s, r]
        if ctx.dim == 2:
            c, s = c.transpose(1, 2), s.transpose(1, 2)
        with torch.enable_grad():
            leaf = k.detach().requires_grad_()
            (grad,) = torch.autograd.grad(_embed(leaf, c, s, ctx.out_dtype), leaf, g)
        return grad, None, None, None, None, None


def k_grad_batch_by_q_heads(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """k's gradient wrong only under GQA (hk < hq) with one table per sequence (cos batch b > 1)."""
    out = torch.promote_types(q.dtype, cos.dtype)
    q_out = _embed(q, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim), out)
    return q_out, _KGradBatchByQHeads.apply(k, cos, sin, out, q.shape[unsqueeze_dim], unsqueeze_dim)


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
    # partial rotary
    "pairs_at_head_half": (pairs_at_head_half, ("forward", "partial_is_sliced")),
    "rotary_from_the_end": (rotary_from_the_end, ("forward", "partial_is_sliced")),
    "pass_through_zeroed": (pass_through_zeroed, ("forward", "partial_is_sliced")),
    "odd_tail_dropped": (odd_tail_dropped, ("forward", "partial_is_sliced")),
    "whole_head_tables_tiled": (whole_head_tables_tiled, ("forward", "partial_is_sliced")),
    # the declared classes
    "mixed_tables_cast_to_q": (mixed_tables_cast_to_q, ("forward",)),
    "empty_returns_flat": (empty_returns_flat, ("forward",)),
    "empty_returns_inputs": (empty_returns_inputs, ("forward",)),
    "grad_read_as_contiguous": (grad_read_as_contiguous, ("backward",)),
    "channels_read_as_adjacent": (channels_read_as_adjacent, ("forward",)),
    "grad_channels_read_as_adjacent": (grad_channels_read_as_adjacent, ("backward",)),
    "math_changes_between_calls": (math_changes_between_calls, ("determinism",)),
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "k_grad_batch_by_q_heads": (k_grad_batch_by_q_heads, ("backward",)),
}
