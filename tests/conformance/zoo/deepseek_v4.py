"""DeepSeek-V4's convention (spec/deepseek_v4.py): a correct implementation and planted bugs, each a mistake a port
of transformers' `modeling_deepseek_v4` to a kernel makes."""
from __future__ import annotations

import torch

from . import rotate_half


def _check(x, cos, sin, unsqueeze_dim):
    """transformers' shapes, refused by the argument at fault (the spec's refuses_bad_input)."""
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim: expected 1 or 2, got {unsqueeze_dim!r}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin: expected cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    b, s, d = x.shape[0], x.shape[3 - unsqueeze_dim], x.shape[-1]
    if cos.dim() != 3 or cos.shape[0] not in (1, b) or cos.shape[1] != s or not 1 <= cos.shape[-1] <= d // 2:
        raise ValueError(f"cos: expected [b or 1, s, w] with b = {b}, s = {s}, 1 <= w <= {d // 2}, got "
                         f"{tuple(cos.shape)}")


def _tables(cos, sin, unsqueeze_dim, interleave=True):
    """The tables widened to one column per channel: each pair's column repeated for both its channels."""
    return tuple(t.unsqueeze(unsqueeze_dim).repeat_interleave(2, -1) if interleave else
                 torch.cat([t, t], -1).unsqueeze(unsqueeze_dim) for t in (cos, sin))


def _rotate(x, c, s, math=torch.float32, out=None, interleaved=True, leading=False):
    """x's trailing r = c.shape[-1] channels (the leading ones with `leading`) rotated by per-channel tables in
    `math`, rounded once to `out` (x's dtype by default); the others passed through."""
    r = c.shape[-1]
    n = x.shape[-1] - r
    out = out or x.dtype
    if leading:
        y = x[..., :r].to(math)
        rot = (y * c.to(math) + rotate_half(y, interleaved) * s.to(math)).to(out)
        return torch.cat([rot, x[..., r:].to(out)], -1)
    y = x[..., n:].to(math)  # converted once: the backward rounds the summed gradient once
    rot = (y * c.to(math) + rotate_half(y, interleaved) * s.to(math)).to(out)
    return torch.cat([x[..., :n].to(out), rot], -1)


def correct(x, cos, sin, unsqueeze_dim=1):
    _check(x, cos, sin, unsqueeze_dim)
    return _rotate(x, *_tables(cos, sin, unsqueeze_dim))


def leading_channels_rotated(x, cos, sin, unsqueeze_dim=1):
    """Llama's partial-rotary layout [rope | nope]: the leading r channels rotated, the trailing passed through."""
    _check(x, cos, sin, unsqueeze_dim)
    return _rotate(x, *_tables(cos, sin, unsqueeze_dim), leading=True)


def half_split_pairs(x, cos, sin, unsqueeze_dim=1):
    """Llama's rotate_half on the rope slice: pairs (i, i + w) with the tables cat(cos, cos), not (2i, 2i + 1)."""
    _check(x, cos, sin, unsqueeze_dim)
    return _rotate(x, *_tables(cos, sin, unsqueeze_dim, interleave=False), interleaved=False)


def tables_cat_not_interleaved(x, cos, sin, unsqueeze_dim=1):
    """The tables widened as cat(cos, cos) (Llama's rotary module) for interleaved pairs: channel c reads column
    c % w, not c // 2."""
    _check(x, cos, sin, unsqueeze_dim)
    return _rotate(x, *_tables(cos, sin, unsqueeze_dim, interleave=False))


def promoted_result(x, cos, sin, unsqueeze_dim=1):
    """transformers' Llama form: the result in torch's promotion of x's and the tables' dtypes (float32 with float32
    tables, or with 16-bit tables of the other kind)."""
    _check(x, cos, sin, unsqueeze_dim)
    return _rotate(x, *_tables(cos, sin, unsqueeze_dim), out=torch.promote_types(x.dtype, cos.dtype))


def result_in_tables_dtype(x, cos, sin, unsqueeze_dim=1):
    """The result cast to the tables' dtype (an output allocated like cos)."""
    _check(x, cos, sin, unsqueeze_dim)
    return _rotate(x, *_tables(cos, sin, unsqueeze_dim), out=cos.dtype)


def tables_cast_to_x(x, cos, sin, unsqueeze_dim=1):
    """The tables cast to x's dtype before the math: float32 tables rounded to 16 bits (one rounding more)."""
    _check(x, cos, sin, unsqueeze_dim)
    return _rotate(x, *_tables(cos.to(x.dtype), sin.to(x.dtype), unsqueeze_dim))


def nope_zeroed(x, cos, sin, unsqueeze_dim=1):
    """Only the rotated channels written into a zeroed output: the leading D - r channels are 0."""
    out = correct(x, cos, sin, unsqueeze_dim)
    n = x.shape[-1] - 2 * cos.shape[-1]
    return torch.cat([torch.zeros_like(out[..., :n]), out[..., n:]], -1)


def sign_flipped(x, cos, sin, unsqueeze_dim=1):
    """The partner's sign on the second member of each pair (stack((x2, -x1))): a rotation by -theta. The inverse
    property cannot see it (the call with -sin still undoes it)."""
    _check(x, cos, sin, unsqueeze_dim)
    c, s = _tables(cos, sin, unsqueeze_dim)
    return _rotate(x, c, -s)


def unsqueeze_dim_ignored(x, cos, sin, unsqueeze_dim=1):
    """The tables broadcast over dim 1 whatever unsqueeze_dim says: [b, s, h, D] read as [b, h, s, D]."""
    _check(x, cos, sin, unsqueeze_dim)
    if unsqueeze_dim == 1:
        return correct(x, cos, sin, 1)
    as_bhsd = x.reshape(x.shape[0], x.shape[2], x.shape[1], x.shape[3])
    return _rotate(as_bhsd, *_tables(cos, sin, 1)).reshape(x.shape)


class _ForwardInBackward(torch.autograd.Function):
    """The trailing channels rotated; the backward applies the same rotation to the upstream gradient instead of
    its transpose (the inverse rotation)."""

    @staticmethod
    def forward(ctx, x, c, s):
        ctx.save_for_backward(c, s)
        ctx.x_dtype = x.dtype
        return _rotate(x, c, s)

    @staticmethod
    def backward(ctx, g):
        c, s = ctx.saved_tensors
        return _rotate(g, c, s, out=ctx.x_dtype), None, None


def backward_not_transposed(x, cos, sin, unsqueeze_dim=1):
    _check(x, cos, sin, unsqueeze_dim)
    return _ForwardInBackward.apply(x, *_tables(cos, sin, unsqueeze_dim))


def math_depends_on_batch(x, cos, sin, unsqueeze_dim=1):
    """A call of one sequence computes in float64, a batch in float32 (a kernel picking its path by the batch
    size): each result within the accuracy model, but a sequence's bits depend on what else is in the batch."""
    _check(x, cos, sin, unsqueeze_dim)
    return _rotate(x, *_tables(cos, sin, unsqueeze_dim), math=torch.float64 if x.shape[0] == 1 else torch.float32)


def narrow_tables_unchecked(x, cos, sin, unsqueeze_dim=1):
    """No check of the tables' width: w = 0 returns x as it is, 2w > D rotates the whole head with columns past it
    unread (transformers' own expression broadcasts or fails later, not naming cos)."""
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim: expected 1 or 2, got {unsqueeze_dim!r}")
    d = x.shape[-1]
    w = min(cos.shape[-1], d // 2)
    if w == 0:
        return x.clone()
    return correct(x, cos[..., :w], sin[..., :w], unsqueeze_dim)


CORRECT = correct
# the bug the command-line test runs: every draw with a token exposes it, on both sets of draws
CLI_BUG = "sign_flipped"
BUGS = {
    "leading_channels_rotated": (leading_channels_rotated, ("forward", "backward", "nope_untouched", "inverse",
                                                            "equals_glm_on_slice")),
    "half_split_pairs": (half_split_pairs, ("forward", "backward", "equals_glm_on_slice")),
    "tables_cat_not_interleaved": (tables_cat_not_interleaved, ("forward", "backward", "inverse",
                                                                "equals_glm_on_slice")),
    "promoted_result": (promoted_result, ("forward", "nope_untouched", "equals_glm_on_slice")),
    "result_in_tables_dtype": (result_in_tables_dtype, ("forward", "nope_untouched", "equals_glm_on_slice")),
    "tables_cast_to_x": (tables_cast_to_x, ("forward", "backward", "equals_glm_on_slice")),
    "nope_zeroed": (nope_zeroed, ("forward", "backward", "nope_untouched", "inverse", "equals_glm_on_slice")),
    # a rotation by -theta: the call with -sin still undoes it, so the inverse property cannot see it
    "sign_flipped": (sign_flipped, ("forward", "backward", "equals_glm_on_slice")),
    "unsqueeze_dim_ignored": (unsqueeze_dim_ignored, ("forward", "backward", "unsqueeze_transposed",
                                                      "equals_glm_on_slice", "heads_together")),
    "backward_not_transposed": (backward_not_transposed, ("backward",)),
    "narrow_tables_unchecked": (narrow_tables_unchecked, ("refuses_bad_input",)),
    # within the accuracy model: only batch invariance sees it
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
}
