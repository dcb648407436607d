"""flash-attention's convention (spec/flash.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch

from . import per_channel, rotate_half


def token_rows(x, seqlen_offsets, cu_seqlens, restart=True, first_offset_only=False):
    """The table row of every token: [b, s], or [total] with cu_seqlens (int64)."""
    offsets = seqlen_offsets
    if isinstance(offsets, torch.Tensor):
        offsets = offsets.long().to(x.device)
        if first_offset_only:
            offsets = offsets[:1].expand_as(offsets)
    if cu_seqlens is None:
        n, s = x.shape[:2]
        rows = torch.arange(s, device=x.device).expand(n, s)
        return rows + (offsets[:, None] if isinstance(offsets, torch.Tensor) else offsets)
    cu = cu_seqlens.long().to(x.device)
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1, device=x.device), cu[1:] - cu[:-1])
    rows = torch.arange(len(seq), device=x.device) - (cu[seq] if restart else 0)
    return rows + (offsets[seq] if isinstance(offsets, torch.Tensor) else offsets)


def rotated(x, cos, sin, rows, interleaved, math_dtype=torch.float32, sign=1.0):
    """x's first rotary_dim channels rotated by the rows' angles (sign -1: by -theta), the rest copied; the math
    in `math_dtype`, rounded once to x's dtype."""
    rot = 2 * cos.shape[1]
    c, s = (per_channel(t.to(math_dtype)[rows], interleaved).unsqueeze(-2) for t in (cos, sin))
    xm = x.to(math_dtype)
    head = xm[..., :rot]
    out = head * c + sign * rotate_half(head, interleaved) * s
    return torch.cat([out, xm[..., rot:]], dim=-1).to(x.dtype)


class _WriteLeaf(torch.autograd.Function):
    """In place on a leaf that requires grad, as flash's autograd Function does it: x written and returned unmarked
    (autograd hands back a new tensor over x's memory); the upstream gradient goes on to `out`, whose graph (from x's
    values before the write; it saves none of them) rotates it back to x."""

    @staticmethod
    def forward(ctx, x, out):
        return x.copy_(out)

    @staticmethod
    def backward(ctx, g):
        return None, g


def on_leaf(x, inplace):
    return inplace and torch.is_grad_enabled() and x.requires_grad and x.is_leaf


def finish(x, out, inplace):
    """The result as the convention returns it: x written with inplace=True (itself, or on a leaf that requires grad
    a new tensor over its memory), else the new tensor."""
    if on_leaf(x, inplace):
        return _WriteLeaf.apply(x, out)
    return x.copy_(out) if inplace else out


def correct(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None):
    rows = token_rows(x, seqlen_offsets, cu_seqlens)
    return finish(x, rotated(x, cos, sin, rows, interleaved), inplace)


def math_depends_on_batch(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                          max_seqlen=None):
    """One sequence computes in float64, more in float32 (a kernel picking its path by the batch): each result within
    one rounding, but a sequence's result depends on what else is in the call."""
    rows = token_rows(x, seqlen_offsets, cu_seqlens)
    alone = cu_seqlens.shape[0] <= 2 if cu_seqlens is not None else x.shape[0] <= 1
    return finish(x, rotated(x, cos, sin, rows, interleaved, math_dtype=torch.float64 if alone else torch.float32),
                  inplace)


def inplace_returns_new(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                        max_seqlen=None):
    """inplace=True ignored: a new tensor returned, x left as it was."""
    return rotated(x, cos, sin, token_rows(x, seqlen_offsets, cu_seqlens), interleaved)


def inplace_returns_copy(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                         max_seqlen=None):
    """inplace=True writes x but returns a copy of it (the caller's alias to x is not what came back)."""
    out = correct(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)
    return out.clone() if inplace else out


def tensor_offsets_ignored(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                           max_seqlen=None):
    """A tensor seqlen_offsets read as 0 (only the int path shifts the rows)."""
    offsets = 0 if isinstance(seqlen_offsets, torch.Tensor) else seqlen_offsets
    return correct(x, cos, sin, interleaved, inplace, offsets, cu_seqlens, max_seqlen)


def first_offset_for_all(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                         max_seqlen=None):
    """A tensor seqlen_offsets read without the sequence index: every sequence shifted by seqlen_offsets[0]."""
    rows = token_rows(x, seqlen_offsets, cu_seqlens, first_offset_only=True)
    return finish(x, rotated(x, cos, sin, rows, interleaved), inplace)


def offsets_read_dense(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                       max_seqlen=None):
    """A tensor seqlen_offsets read from its data pointer at stride 1 (a kernel given no stride for it): a strided
    view's offsets come from the elements between (kept within the tables, so that values show it, not an index
    error)."""
    if isinstance(seqlen_offsets, torch.Tensor) and seqlen_offsets.numel() > 1 and seqlen_offsets.stride(0) != 1:
        longest = x.shape[1] if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        dense = torch.as_strided(seqlen_offsets, seqlen_offsets.shape, (1,))
        seqlen_offsets = dense.clamp(0, max(cos.shape[0] - longest, 0))
    return correct(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


def int_offset_twice(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """An int offset both slices the tables (cos[k:]) and shifts the rows: row j + 2k."""
    if not isinstance(seqlen_offsets, torch.Tensor) and seqlen_offsets:
        k = seqlen_offsets
        rows = token_rows(x, seqlen_offsets, cu_seqlens)
        rows = torch.minimum(rows, torch.tensor(cos.shape[0] - 1 - k))  # the kernel's clamp at the table's end
        return finish(x, rotated(x, cos[k:], sin[k:], rows, interleaved), inplace)
    return correct(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


def varlen_positions_global(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                            max_seqlen=None):
    """Varlen tokens read row t (their index in the packed batch), not their index in their own sequence."""
    rows = token_rows(x, seqlen_offsets, cu_seqlens, restart=False)
    rows = rows.clamp(max=cos.shape[0] - 1)
    return finish(x, rotated(x, cos, sin, rows, interleaved), inplace)


def partial_pairs_at_half_head(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                               max_seqlen=None):
    """Half-split partial rotary pairs channel i with i + d/2 (the head's half) instead of i + rotary_dim/2."""
    rot, d = 2 * cos.shape[1], x.shape[-1]
    if interleaved or rot == d:
        return correct(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)
    half, far = rot // 2, d // 2
    rows = token_rows(x, seqlen_offsets, cu_seqlens)
    c, s = (t.float()[rows].unsqueeze(-2) for t in (cos, sin))
    xf = x.float()
    x0, x1 = xf[..., :half], xf[..., far:far + half]
    out = torch.cat([x0 * c - x1 * s, x0 * s + x1 * c, xf[..., rot:]], dim=-1).to(x.dtype)
    return finish(x, out, inplace)


def interleaved_sign_flipped(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                             max_seqlen=None):
    """The interleaved path rotates by -theta (the partner's sign swapped)."""
    rows = token_rows(x, seqlen_offsets, cu_seqlens)
    return finish(x, rotated(x, cos, sin, rows, interleaved, sign=-1.0 if interleaved else 1.0), inplace)


def tail_not_copied(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                    max_seqlen=None):
    """Out of place, the channels past rotary_dim are left as the new tensor was allocated (zeros)."""
    out = correct(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)
    if not inplace:
        out = torch.cat([out[..., :2 * cos.shape[1]], torch.zeros_like(out[..., 2 * cos.shape[1]:])], dim=-1)
    return out


def math_in_x_dtype(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                    max_seqlen=None):
    """The products and the sum in x's dtype (bf16/fp16 roundings at every step)."""
    rows = token_rows(x, seqlen_offsets, cu_seqlens)
    return finish(x, rotated(x, cos, sin, rows, interleaved, math_dtype=x.dtype), inplace)


def tables_rounded_to_x_dtype(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                              max_seqlen=None):
    """float32 tables cast to x's dtype before the math (flash's own assert, turned into a silent cast)."""
    return correct(x, cos.to(x.dtype), sin.to(x.dtype), interleaved, inplace, seqlen_offsets, cu_seqlens,
                   max_seqlen)


class _NotConjugated(torch.autograd.Function):
    """The backward rotates the upstream gradient by +theta (conjugate=False) instead of -theta."""

    @staticmethod
    def forward(ctx, x, cos, sin, rows, interleaved):
        ctx.save_for_backward(cos, sin, rows)
        ctx.interleaved = interleaved
        return rotated(x, cos, sin, rows, interleaved)

    @staticmethod
    def backward(ctx, g):
        cos, sin, rows = ctx.saved_tensors
        return rotated(g, cos, sin, rows, ctx.interleaved), None, None, None, None


def backward_not_conjugated(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                            max_seqlen=None):
    rows = token_rows(x, seqlen_offsets, cu_seqlens)
    return finish(x, _NotConjugated.apply(x, cos, sin, rows, interleaved), inplace)


# ---- in place on a leaf that requires grad (the backward property draws x as one) ----------------------------


def leaf_returns_new(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """In place on a leaf that requires grad: x left as it was, a new tensor returned (the write skipped where
    autograd would refuse it)."""
    out = rotated(x, cos, sin, token_rows(x, seqlen_offsets, cu_seqlens), interleaved)
    return out if on_leaf(x, inplace) else finish(x, out, inplace)


def leaf_refused(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None):
    """In place on a leaf that requires grad refused, as autograd refuses an in-place op on one."""
    if on_leaf(x, inplace):
        raise ValueError("x: in-place rotation of a leaf tensor that requires grad")
    return correct(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


def leaf_outside_graph(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                       max_seqlen=None):
    """In place on a leaf that requires grad: x written under no_grad and returned detached (no gradient reaches x)."""
    if on_leaf(x, inplace):
        with torch.no_grad():
            return correct(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen).detach()
    return correct(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


class _FlashInPlace(torch.autograd.Function):
    """flash-attention's own autograd Function: x written and returned unmarked with inplace=True; its backward
    rotates the upstream gradient by `sign` * theta (-1: the inverse), with `write_grad` into the upstream gradient
    itself."""

    @staticmethod
    def forward(ctx, x, cos, sin, rows, interleaved, inplace, sign, write_grad):
        ctx.save_for_backward(cos, sin, rows)
        ctx.interleaved, ctx.sign, ctx.write_grad = interleaved, sign, write_grad
        out = rotated(x, cos, sin, rows, interleaved)
        return x.copy_(out) if inplace else out

    @staticmethod
    def backward(ctx, g):
        cos, sin, rows = ctx.saved_tensors
        dx = rotated(g, cos, sin, rows, ctx.interleaved, sign=ctx.sign)
        return (g.copy_(dx) if ctx.write_grad else dx), *(None,) * 7


def backward_writes_upstream(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                             max_seqlen=None):
    """With inplace=True the backward writes the rotated gradient into the upstream gradient (flash's own
    `apply_rotary(do, ..., inplace=ctx.inplace)`): the caller's gradient tensor changes."""
    rows = token_rows(x, seqlen_offsets, cu_seqlens)
    return _FlashInPlace.apply(x, cos, sin, rows, interleaved, inplace, -1.0, inplace)


def leaf_backward_forward_rotation(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                                   max_seqlen=None):
    """In place on a leaf that requires grad (its own backward), the gradient rotated by +theta, not -theta."""
    if on_leaf(x, inplace):
        rows = token_rows(x, seqlen_offsets, cu_seqlens)
        return _FlashInPlace.apply(x, cos, sin, rows, interleaved, True, 1.0, False)
    return correct(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


def empty_returns_flattened(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                            max_seqlen=None):
    """The tokens flattened for the kernel ([b * s, h, d]), and the early exit for an empty x returning them so, not
    reshaped back to [b, s, h, d] (nor x itself with inplace=True): only an empty [b, s, h, d] exposes it."""
    if not x.numel():
        return x.new_empty((0, *x.shape[-2:]))
    return correct(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


CORRECT = correct
BUGS = {
    "empty_returns_flattened": (empty_returns_flattened, ("forward",)),
    "inplace_returns_new": (inplace_returns_new, ("forward", "inplace_equals_out_of_place")),
    "inplace_returns_copy": (inplace_returns_copy, ("forward", "inplace_equals_out_of_place")),
    "tensor_offsets_ignored": (tensor_offsets_ignored, ("forward", "int_offset_equals_tensor")),
    "first_offset_for_all": (first_offset_for_all, ("forward",)),
    "offsets_read_dense": (offsets_read_dense, ("forward",)),
    "int_offset_twice": (int_offset_twice, ("forward", "int_offset_equals_tensor", "offset_is_table_shift")),
    "varlen_positions_global": (varlen_positions_global, ("forward",)),
    "partial_pairs_at_half_head": (partial_pairs_at_half_head, ("forward", "interleaved_moves_channels")),
    "interleaved_sign_flipped": (interleaved_sign_flipped, ("forward", "interleaved_moves_channels")),
    "tail_not_copied": (tail_not_copied, ("forward", "inplace_equals_out_of_place")),
    "math_in_x_dtype": (math_in_x_dtype, ("forward",)),
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "tables_rounded_to_x_dtype": (tables_rounded_to_x_dtype, ("forward",)),
    "backward_not_conjugated": (backward_not_conjugated, ("backward",)),
    "leaf_returns_new": (leaf_returns_new, ("backward",)),
    "leaf_refused": (leaf_refused, ("backward",)),
    "leaf_outside_graph": (leaf_outside_graph, ("backward",)),
    "backward_writes_upstream": (backward_writes_upstream, ("backward",)),
    "leaf_backward_forward_rotation": (leaf_backward_forward_rotation, ("backward",)),
}
