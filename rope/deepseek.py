"""DeepSeek-V4's convention: `apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)` as transformers'
`modeling_deepseek_v4` defines it (docs/contract.md section 7g).

x: [b, h, s, D] (unsqueeze_dim=1) or [b, s, h, D] (2); cos, sin: [b or 1, s, w], one column per rotary pair (the
model's rotary module gives no duplicated half). The trailing r = 2w channels of each head (V4 lays a head out as
[nope | rope]) are rotated with interleaved pairs (2i, 2i + 1), pair i by cos[..., i] and sin[..., i]; the leading
D - r channels pass through. float32 math, one rounding to x's dtype (transformers rotates `rope.float()` and casts
back); a new tensor of x's shape; the gradient flows to x. V4 also rotates the attention output back with `-sin`:
the same call, with the tables negated.
"""
from __future__ import annotations

import torch

from . import reference
from ._backend import Call, check_once, convention, dispatch
from ._checks import Layout, check_tables, heads_views
from ._launch import table_angles


def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1):
    """x's trailing 2 * cos.shape[-1] channels rotated as interleaved pairs by half-width tables; see the module."""
    seen = check_once("deepseek.apply_rotary_pos_emb", _check, (x, cos, sin), (unsqueeze_dim,))
    view = x.transpose(1, 2) if unsqueeze_dim == 1 else x  # [b, s, h, D]: the kernel's bshd roles
    # one pass writes the whole head: the rope slice rotated, the channels before it copied (`Call.tail_first`);
    # the output takes x's memory order where x is dense, so that transformers' contiguous result needs no copy
    (out,) = dispatch(V4, (view,), (cos, sin), (), seen=seen)
    out = out.transpose(1, 2) if unsqueeze_dim == 1 else out
    return out if out.is_contiguous() else out.contiguous()


def _check(x, cos, sin, unsqueeze_dim) -> None:
    (view,) = heads_views((("x", x),), unsqueeze_dim)
    check_tables(cos, sin, view, "x")
    b, s, _, d = view.shape
    if cos.dim() != 3 or cos.shape[-2] != s or cos.shape[-3] not in (1, b) or not 1 <= cos.shape[-1] <= d // 2:
        raise ValueError(f"cos: expected shape [b, s, w] with b = {b} or 1, s = {s} and 1 <= w <= {d // 2} (one "
                         f"column per rotary pair of the {d}-channel head), got {tuple(cos.shape)}")


def _call(views, reads, flags) -> Call:
    b, s, h, d = views[0].shape
    r = 2 * reads[0].shape[-1]
    return Call(Layout(s=s, b=b, h=h, d=d, rot_dim=r, freqs_len=s), tensor_format="bshd", interleaved=True,
                tail_first=r < d)


def _reads(call, reads, flags) -> tuple:
    cos, sin = reads
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return table_angles(cos, sin, half=True, per_batch=cos.shape[0] > 1), None, None, False


def _reference(views, reads, flags, backward) -> tuple:
    """Each head's trailing channels ([b, s, h, D]) rotated by the tables widened to one column per channel (by
    -theta backward), in float32; the channels before them copied."""
    cos, sin = (reference.full_width(t, True).unsqueeze(2) for t in reads)
    sin = -sin if backward else sin
    r = cos.shape[-1]
    return tuple(torch.cat([x[..., :x.shape[-1] - r], reference.rotate(x[..., x.shape[-1] - r:], cos, sin, True)],
                           -1) for x in views)


V4 = convention("deepseek-v4", _call, _reads, _reference, keep_order=True)

__all__ = ["apply_rotary_pos_emb"]
