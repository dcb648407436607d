"""transformers' convention: the `apply_rotary_pos_emb` forms its models call (docs/contract.md section 7a),
and `apply_multimodal_rotary_pos_emb` (Qwen2-VL's multimodal RoPE, section 7b).

q, k (or x): [b, h, s, d] (unsqueeze_dim=1) or [b, s, h, d] (unsqueeze_dim=2); cos, sin: [b or 1, s, r], already
gathered by position. r = cos.shape[-1] is the rotary width (even, r <= d): the first r channels are rotated,
channels r.. pass through unchanged, as GPT-NeoX, Phi, StableLM and Qwen3-Next slice them (`rope._hf_path`).
"""
from __future__ import annotations

from ._hf_path import check_rotary_tables, heads_views, rotate
from ._validate import check_mrope_section


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' `apply_rotary_pos_emb`: q and k rotated over their first r = cos.shape[-1] channels with
    rotate_half pairs (i, i + r/2), `q_rot * cos + rotate_half(q_rot) * sin`, the rest passed through (r = d: the
    whole head, as Llama's). float32 math and one rounding to torch's promotion of q's and cos's dtypes, as
    transformers' expression gives. `position_ids` is unused, as in transformers. New tensors; the gradient flows
    to q and k."""
    views = heads_views((("q", q), ("k", k)), unsqueeze_dim)
    check_rotary_tables(cos, sin, views, "q", 0)
    return rotate((q, k), views, cos, sin, unsqueeze_dim)


def apply_rotary_pos_emb_single(x, cos, sin, unsqueeze_dim=1):
    """The one-tensor form (Gemma 3n and Gemma 4 rotate q alone on the layers that share k): x rotated as
    `apply_rotary_pos_emb` rotates q, bitwise its q result, in one launch. Returns a new tensor; the gradient
    flows to x."""
    views = heads_views((("x", x),), unsqueeze_dim)
    check_rotary_tables(cos, sin, views, "x", 0)
    return rotate((x,), views, cos, sin, unsqueeze_dim)[0]


def apply_rotary_pos_emb_glm(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' GLM and GLM-4 `apply_rotary_pos_emb`: interleaved pairs (2i, 2i + 1) over the first
    r = cos.shape[-1] channels, pair i rotated by cos[..., i] and sin[..., i], i < r/2: the first half of each
    row (GLM's rotary module builds cat(theta, theta); transformers takes `cos[..., :r/2].repeat_interleave(2)`),
    the second half unread. Channels r.. pass through (GLM rotates half the head). Dtypes, results and gradients
    as `apply_rotary_pos_emb`."""
    views = heads_views((("q", q), ("k", k)), unsqueeze_dim)
    check_rotary_tables(cos, sin, views, "q", 0)
    return rotate((q, k), views, cos, sin, unsqueeze_dim, interleaved=True)


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
    return rotate((q, k), views, cos, sin, unsqueeze_dim, streams=streams)


__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_single", "apply_rotary_pos_emb_glm",
           "apply_multimodal_rotary_pos_emb"]
