"""transformers' convention: the `apply_rotary_pos_emb` forms its models call (docs/contract.md section 7a),
and `apply_multimodal_rotary_pos_emb` (Qwen2-VL's multimodal RoPE, section 7b).

q, k (or x): [b, h, s, d] (unsqueeze_dim=1) or [b, s, h, d] (unsqueeze_dim=2); cos, sin: [b or 1, s, r], already
gathered by position. r = cos.shape[-1] is the rotary width (even, r <= d): the first r channels are rotated,
channels r.. pass through unchanged, as GPT-NeoX, Phi, StableLM and Qwen3-Next slice them.

The kernel reads transformers' tables as they are: one column per channel of the rotary width r = cos.shape[-1]
(rotate_half pairs (i, i + r/2) read columns i and i + r/2), or, for GLM's interleaved pairs (2i, 2i + 1), one
column per pair, column i of the first half (`Angles.half`). Channels r.. are the kernel's pass-through tail.
"""
from __future__ import annotations

import torch

from . import reference
from ._backend import Call, check_once, convention, dispatch
from ._checks import Layout, check_mrope_section, check_rotary_tables, check_schedule, heads_views
from ._launch import table_angles


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, *, schedule=None):
    """transformers' `apply_rotary_pos_emb`: q and k rotated over their first r = cos.shape[-1] channels with
    rotate_half pairs (i, i + r/2), `q_rot * cos + rotate_half(q_rot) * sin`, the rest passed through (r = d: the
    whole head, as Llama's). float32 math and one rounding to torch's promotion of q's and cos's dtypes, as
    transformers' expression gives. `position_ids` is unused, as in transformers. New tensors; the gradient flows
    to q and k. `schedule` (not in transformers): "eager", the forward bitwise transformers' expression run eagerly
    (each operation rounded to the dtype of its result); "float32", each operation rounded to float32, then the
    result once (docs/contract.md, "Schedules"); the backward is the default's."""
    seen = check_once("hf.apply_rotary_pos_emb", _check_pair, (q, k, cos, sin), (unsqueeze_dim, schedule))
    return _rotate((q, k), cos, sin, unsqueeze_dim, schedule=schedule, seen=seen)


def apply_rotary_pos_emb_single(x, cos, sin, unsqueeze_dim=1, *, schedule=None):
    """The one-tensor form (Gemma 3n and Gemma 4 rotate q alone on the layers that share k): x rotated as
    `apply_rotary_pos_emb` rotates q, bitwise its q result, in one launch. Returns a new tensor; the gradient
    flows to x. `schedule` as `apply_rotary_pos_emb`'s."""
    seen = check_once("hf.apply_rotary_pos_emb_single", _check_single, (x, cos, sin), (unsqueeze_dim, schedule))
    return _rotate((x,), cos, sin, unsqueeze_dim, schedule=schedule, seen=seen)[0]


def apply_rotary_pos_emb_glm(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, *, schedule=None):
    """transformers' GLM and GLM-4 `apply_rotary_pos_emb`: interleaved pairs (2i, 2i + 1) over the first
    r = cos.shape[-1] channels, pair i rotated by cos[..., i] and sin[..., i], i < r/2: the first half of each
    row (GLM's rotary module builds cat(theta, theta); transformers takes `cos[..., :r/2].repeat_interleave(2)`),
    the second half unread. Channels r.. pass through (GLM rotates half the head). Dtypes, results, gradients and
    `schedule` (GLM's expression: "eager" its operations as its models run them) as `apply_rotary_pos_emb`."""
    seen = check_once("hf.apply_rotary_pos_emb_glm", _check_pair, (q, k, cos, sin), (unsqueeze_dim, schedule))
    return _rotate((q, k), cos, sin, unsqueeze_dim, interleaved=True, schedule=schedule, seen=seen)


def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' DeepSeek-V3 form: each head's channels read as interleaved pairs (2i, 2i + 1), rotated by
    columns i and i + d/2 of cos and sin (transformers' half-split tables, r = d: the whole head, DeepSeek's rope
    slice), and written half-split: out[i] = x[2i] cos[i] - x[2i + 1] sin[i], out[i + d/2] = x[2i + 1] cos[i + d/2]
    + x[2i] sin[i + d/2], as its function de-interleaves the head before `apply_rotary_pos_emb`. k may have one head
    (MLA's shared k_pe). Dtypes as `apply_rotary_pos_emb`; new tensors; the gradient flows to q and k (the inverse
    rotation, written back interleaved). `position_ids` is unused, as in transformers."""
    seen = check_once("hf.apply_rotary_pos_emb_interleave", _check_whole_head, (q, k, cos, sin), (unsqueeze_dim,))
    return _rotate((q, k), cos, sin, unsqueeze_dim, permute=True, seen=seen)


def apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1, mrope_interleaved=False):
    """transformers' `apply_multimodal_rotary_pos_emb` (Qwen2-VL, Qwen2.5-VL): cos, sin [3, b, s, r], one table
    per position stream (temporal, height, width) as the model's rotary module returns them; pair (i, i + r/2)
    takes stream m's cos/sin where i lies in section m of `mrope_section` (pairs per stream, summing to r/2;
    transformers doubles the list over both halves); channels r.. pass through. mrope_interleaved=True (not in
    transformers' function): Qwen3-VL's layout, pair i reads stream i % 3 while i < 3 * mrope_section[i % 3],
    else stream 0, which Qwen3-VL's rotary module applies while it builds cos/sin. New tensors."""
    views = heads_views((("q", q), ("k", k)), unsqueeze_dim)
    check_rotary_tables(cos, sin, views, "q", 1)
    streams = check_mrope_section(mrope_section, cos.shape[-1] // 2, mrope_interleaved)
    return _rotate((q, k), cos, sin, unsqueeze_dim, streams=streams)


def _check_pair(q, k, cos, sin, unsqueeze_dim, schedule=None) -> None:
    check_rotary_tables(cos, sin, heads_views((("q", q), ("k", k)), unsqueeze_dim), "q", 0)
    check_schedule(schedule)


def _check_whole_head(q, k, cos, sin, unsqueeze_dim) -> None:
    """`_check_pair`, and tables as wide as the head: the de-interleaving spans the whole head."""
    _check_pair(q, k, cos, sin, unsqueeze_dim)
    d = q.shape[-1]
    if cos.shape[-1] != d:
        raise ValueError(f"cos: expected the head dim {d} as its last size (the form rotates the whole head), got "
                         f"shape {tuple(cos.shape)}")


def _check_single(x, cos, sin, unsqueeze_dim, schedule) -> None:
    check_rotary_tables(cos, sin, heads_views((("x", x),), unsqueeze_dim), "x", 0)
    check_schedule(schedule)


def _rotate(xs, cos, sin, unsqueeze_dim, interleaved=False, streams=None, schedule=None, permute=False,
            seen=None) -> tuple:
    """xs (q and k, or x; checked) rotated over the first r = cos.shape[-1] channels in one launch, as [b, s, h, d]
    views (the kernel's bshd roles); `streams` as `rope._launch.Angles` holds them for tables per stream (cos [3, b,
    s, r]); `seen`: the front end's checked signature (`check_once`). The kernel writes q's dtype: a wider result of
    transformers' promotion is the reference's."""
    views = tuple(x.transpose(1, 2) for x in xs) if unsqueeze_dim == 1 else xs
    fits = torch.promote_types(xs[0].dtype, cos.dtype) == xs[0].dtype
    outs = dispatch(HF, views, (cos, sin), (interleaved, streams, schedule, permute), fits=fits, seen=seen)
    return tuple(o.transpose(1, 2) for o in outs) if unsqueeze_dim == 1 else tuple(outs)


def _call(views, reads, flags) -> Call:
    b, s, h, d = views[0].shape
    return Call(Layout(s=s, b=b, h=h, d=d, rot_dim=reads[0].shape[-1], freqs_len=s), tensor_format="bshd",
                interleaved=flags[0], schedule=flags[2], permute=flags[3])


def _reads(call, reads, flags) -> tuple:
    cos, sin = reads
    interleaved, streams = flags[:2]
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    per_batch = cos.shape[0 if streams is None else 1] > 1
    angles = table_angles(cos, sin, half=interleaved, per_batch=per_batch, per_stream=streams is not None,
                          streams=streams or (0, 0, 0, 0))
    return angles, None, None, False


def _reference(views, reads, flags, backward) -> tuple:
    """transformers' expression on the [b, s, h, d] views, in the promoted dtype of q's and cos's."""
    cos, sin = reads
    interleaved, streams, schedule, permute = flags
    out_dtype = torch.promote_types(views[0].dtype, cos.dtype)
    if permute:  # DeepSeek-V3: the head de-interleaved, (2i, 2i + 1) -> (i, i + d/2), before the half-split rotation
        views = tuple(x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2) for x in views)
    rot = cos.shape[-1]
    if streams is not None:
        stream = reference.section_of_pair(streams[1:], rot // 2, streams[0] == 2, cos.device)
        cos, sin = (reference.select_streams(tab, stream, False) for tab in (cos, sin))
    if interleaved:  # GLM: column i of the first half for both channels of pair i
        cos, sin = (reference.full_width(tab[..., :rot // 2], True) for tab in (cos, sin))
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return tuple(reference.rotate_scheduled(x.to(out_dtype), cos, sin, interleaved, schedule) for x in views)


HF = convention("hf", _call, _reads, _reference, keep_order=True)


__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_single", "apply_rotary_pos_emb_glm",
           "apply_rotary_pos_emb_interleave", "apply_multimodal_rotary_pos_emb"]
