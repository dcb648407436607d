"""transformers' DeepSeek-V3 convention (spec/hf_deepseek_v3.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch

from . import channels_adjacent, rotate_half


def deinterleave(x):
    """Channel 2i to i, 2i + 1 to i + d/2."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


def interleave(x):
    """Channel i to 2i, i + d/2 to 2i + 1 (the inverse of `deinterleave`)."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).transpose(-1, -2).flatten(-2)


def check(q, k, cos, sin, unsqueeze_dim, whole_head=True):
    """The call's arguments as the convention takes them, each refusal naming the argument at fault."""
    for name, x in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor")
    if unsqueeze_dim not in (1, 2) or isinstance(unsqueeze_dim, bool):
        raise ValueError(f"unsqueeze_dim: expected 1 or 2, got {unsqueeze_dim!r}")
    if q.dim() != 4:
        raise ValueError(f"q: expected a 4-D tensor, got shape {tuple(q.shape)}")
    tokens = 3 - unsqueeze_dim  # the other of dims 1 and 2
    if k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[tokens] != q.shape[tokens] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected q's batch, tokens and head dim (shape {tuple(q.shape)}), got {tuple(k.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin: expected the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    d = q.shape[-1]
    if cos.dim() != 3 or cos.shape[0] not in (1, q.shape[0]) or cos.shape[1] != q.shape[tokens]:
        raise ValueError(f"cos: expected [b or 1, s, d] for q of shape {tuple(q.shape)}, got {tuple(cos.shape)}")
    if whole_head and cos.shape[-1] != d:
        raise ValueError(f"cos: expected the head dim {d} as its width (the whole head is rotated), got "
                         f"{cos.shape[-1]}")
    if d % 2 or cos.shape[-1] % 2:
        raise ValueError(f"q: expected an even head dim (pairs (2i, 2i + 1)), got {d}")


def _embed(x, cos, sin, out_dtype, math_dtype=torch.float32, order=deinterleave):
    """The head reordered by `order`, then transformers' half-split rotation; math in `math_dtype`, one rounding."""
    xm = order(x.to(math_dtype))  # converted once: the backward then rounds the summed gradient once
    return (xm * cos.to(math_dtype) + rotate_half(xm) * sin.to(math_dtype)).to(out_dtype)


def _both(q, k, cos, sin, unsqueeze_dim, **kw):
    out = torch.promote_types(q.dtype, cos.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _embed(q, cos, sin, out, **kw), _embed(k, cos, sin, out, **kw)


def correct(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    check(q, k, cos, sin, unsqueeze_dim)
    return _both(q, k, cos, sin, unsqueeze_dim)


# ---- the permutation

def no_deinterleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' plain apply_rotary_pos_emb: pairs (i, i + d/2) read as well as written half-split."""
    check(q, k, cos, sin, unsqueeze_dim)
    return _both(q, k, cos, sin, unsqueeze_dim, order=lambda x: x)


def written_interleaved(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The result written back to the pairs it was read from (2i, 2i + 1), as GLM's form writes it, not half-split."""
    return tuple(interleave(o) for o in correct(q, k, cos, sin, position_ids, unsqueeze_dim))


def permutation_inverted(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """`view(2, d/2)` for `view(d/2, 2)` before the transpose: the inverse permutation (channel i read at 2i),
    the same as the right one for d <= 4."""
    check(q, k, cos, sin, unsqueeze_dim)
    return _both(q, k, cos, sin, unsqueeze_dim, order=interleave)


# ---- the tables

def second_channel_reads_first_half(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Both outputs of pair i rotated by column i (one angle per pair, GLM's reading): output i + d/2 should read
    column i + d/2."""
    h = cos.shape[-1] // 2
    return correct(q, k, torch.cat([cos[..., :h]] * 2, -1), torch.cat([sin[..., :h]] * 2, -1), position_ids,
                   unsqueeze_dim)


def tables_read_at_input_channel(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Each term reads the tables at its input channel (2i, 2i + 1) instead of its output channel (i, i + d/2): the
    de-interleave applied to the tables as well."""
    check(q, k, cos, sin, unsqueeze_dim)
    return correct(q, k, deinterleave(cos), deinterleave(sin), position_ids, unsqueeze_dim)


def tables_cast_to_q_dtype(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """cos/sin loaded in q's dtype (a kernel with one element type): float32 tables rounded to 16 bits, the result
    still in the promoted float32."""
    check(q, k, cos, sin, unsqueeze_dim)
    return correct(q, k, cos.to(q.dtype).to(cos.dtype), sin.to(q.dtype).to(sin.dtype), position_ids, unsqueeze_dim)


# ---- gradients

class _KGradPerQHead(torch.autograd.Function):
    """k's rotation, whose backward adds k's gradient once per q head that shares the k head (a GQA kernel's grid
    over q's heads reused for k's rows): hq / hk times too large; right where hk = hq."""

    @staticmethod
    def forward(ctx, k, cos, sin, out_dtype, hq, dim):
        ctx.save_for_backward(k, cos, sin)
        ctx.out_dtype, ctx.hq, ctx.dim = out_dtype, hq, dim
        return _embed(k, cos, sin, out_dtype)

    @staticmethod
    def backward(ctx, g):
        k, cos, sin = ctx.saved_tensors
        hk = k.shape[ctx.dim]
        with torch.enable_grad():
            leaf = k.detach().requires_grad_()
            (grad,) = torch.autograd.grad(_embed(leaf, cos, sin, ctx.out_dtype), leaf, g)
        shares = torch.bincount(torch.arange(ctx.hq) * hk // ctx.hq, minlength=hk).to(grad.dtype).to(grad.device)
        shape = [1] * grad.dim()
        shape[ctx.dim] = hk
        return grad * shares.view(shape), None, None, None, None, None


def k_grad_per_q_head(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """k's gradient counted once per q head sharing each k head: wrong under GQA (MLA's one k head: hq times)."""
    check(q, k, cos, sin, unsqueeze_dim)
    out = torch.promote_types(q.dtype, cos.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (_embed(q, cos, sin, out),
            _KGradPerQHead.apply(k, cos, sin, out, q.shape[unsqueeze_dim], unsqueeze_dim))


class _BackwardOrder(torch.autograd.Function):
    """The rotation, whose backward computes the gradient of the de-interleaved head right and writes it back with
    `order` (the inverse of the forward's permutation is `interleave`)."""

    @staticmethod
    def forward(ctx, x, cos, sin, order, rotate_back):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype, ctx.order, ctx.rotate_back = x.dtype, order, rotate_back
        return _embed(x, cos, sin, torch.promote_types(x.dtype, cos.dtype))

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        gm, c, s = g.float(), cos.float(), sin.float()
        if ctx.rotate_back:  # the transpose: g cos - rotate_half(g sin)
            gx = gm * c - rotate_half(gm * s)
        else:  # the rotation itself
            gx = gm * c + rotate_half(gm) * s
        return ctx.order(gx).to(ctx.x_dtype), None, None, None, None


def _ordered_backward(q, k, cos, sin, unsqueeze_dim, order, rotate_back):
    check(q, k, cos, sin, unsqueeze_dim)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return tuple(_BackwardOrder.apply(x, cos, sin, order, rotate_back) for x in (q, k))


def backward_permutes_forward(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The backward writes the gradient with the forward's permutation again (de-interleaved) instead of its inverse:
    the same for d <= 4."""
    return _ordered_backward(q, k, cos, sin, unsqueeze_dim, deinterleave, True)


def backward_not_transposed(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The backward applies the rotation itself instead of its transpose (the inverse)."""
    return _ordered_backward(q, k, cos, sin, unsqueeze_dim, interleave, False)


# ---- layouts, bad input, batch and determinism

def wide_head_read_as_dense(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """q's memory read through dense strides from its data pointer (a kernel that assumes rows of d channels): wrong
    for every view, the rope slice of a wider head among them."""
    qc = q.detach().as_strided(q.shape, torch.empty(q.shape).stride(), q.storage_offset()) \
        if not q.is_contiguous() else q
    return correct(qc, k, cos, sin, position_ids, unsqueeze_dim)


def narrow_tables_as_partial(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Tables narrower than the head taken as partial rotary (apply_rotary_pos_emb's q[..., :r] rotated, the rest
    passed through) instead of refused: the form de-interleaves the whole head."""
    check(q, k, cos, sin, unsqueeze_dim, whole_head=False)
    r = cos.shape[-1]
    out = torch.promote_types(q.dtype, cos.dtype)
    rot = _both(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim)
    return tuple(torch.cat([o, x[..., r:].to(out)], -1) for o, x in zip(rot, (q, k), strict=True))


def math_depends_on_batch(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """A single sequence computes in float64, a batch in float32 (a kernel picking its path by the batch size): each
    result within one rounding, but a sequence's result depends on what else is in the batch."""
    check(q, k, cos, sin, unsqueeze_dim)
    return _both(q, k, cos, sin, unsqueeze_dim, math_dtype=torch.float64 if q.shape[0] == 1 else torch.float32)


_CALLS = [0]


def math_changes_between_calls(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Every other call computes in float64 instead of float32: each result within one rounding, but two identical
    calls may differ in the last bit."""
    check(q, k, cos, sin, unsqueeze_dim)
    _CALLS[0] += 1
    return _both(q, k, cos, sin, unsqueeze_dim, math_dtype=torch.float64 if _CALLS[0] % 2 else torch.float32)


def channels_read_as_adjacent(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Reads q's and k's channels as adjacent (a kernel that takes the row strides and assumes dense channels):
    right wherever the channels are adjacent, wrong for a head whose last dim has another stride."""
    return correct(channels_adjacent(q), channels_adjacent(k), cos, sin, position_ids, unsqueeze_dim)


CORRECT = correct
CLI_BUG = "no_deinterleave"
BUGS = {
    "no_deinterleave": (no_deinterleave, ("forward", "equals_hf_of_deinterleaved", "inverse")),
    "written_interleaved": (written_interleaved, ("forward", "equals_hf_of_deinterleaved", "inverse")),
    "permutation_inverted": (permutation_inverted, ("forward", "equals_hf_of_deinterleaved", "inverse")),
    "second_channel_reads_first_half": (second_channel_reads_first_half, ("forward", "equals_hf_of_deinterleaved")),
    "tables_read_at_input_channel": (tables_read_at_input_channel,
                                     ("forward", "equals_hf_of_deinterleaved", "inverse")),
    "tables_cast_to_q_dtype": (tables_cast_to_q_dtype, ("forward", "equals_hf_of_deinterleaved")),
    "k_grad_per_q_head": (k_grad_per_q_head, ("backward", "heads_independent")),
    "backward_permutes_forward": (backward_permutes_forward, ("backward",)),
    "backward_not_transposed": (backward_not_transposed, ("backward",)),
    "wide_head_read_as_dense": (wide_head_read_as_dense, ("forward",)),
    "channels_read_as_adjacent": (channels_read_as_adjacent, ("forward",)),
    "narrow_tables_as_partial": (narrow_tables_as_partial, ("refuses_bad_input",)),
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "math_changes_between_calls": (math_changes_between_calls, ("determinism",)),
}
