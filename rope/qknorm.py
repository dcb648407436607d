"""QK-RMSNorm fused with RoPE (Qwen3, Qwen3-MoE, Gemma 3, OLMo 2): y = RoPE(RMSNorm(x) * w) per head of q and k.

RMSNorm over the whole head (d channels) in float32: n = x * rsqrt(mean(x^2) + eps), times w (or Gemma's 1 + w),
then the rotation of the first `rot` channels (partial rotary: the norm still spans the head), one rounding to
x's dtype. q and k in one launch, each with its own weight [d] and head count.
- `apply`: transformers' tables cos, sin [b or 1, s, rot]; differentiable in q, k and both weights.
- `apply_cache`: positions [T] into vLLM's cos_sin_cache [max_position, rot]; q [T, hq, d]; differentiable;
  multimodal positions [3, T] with mrope_section as vLLM's MRotaryEmbedding (each pair its own stream).
- `apply_freqs` (rope/qknorm_te.py): TransformerEngine's layouts and angles freqs (sbhd, bshd, thd with cu_seqlens,
  start_positions, context parallel); differentiable.
- `fused_qk_norm_rope`: vLLM's op, in place on packed qkv [T, (hq + hk + hv) * d], v untouched.
"""
from __future__ import annotations

import torch

from . import reference
from ._backend import Call, call_for, kernel_runs, norm_rotate
from ._checks import Layout, check_cache_call, check_inplace, check_packed, check_positions_in, check_table_call
from ._launch import table_angles
from .qknorm_te import apply_freqs
from .reference import norm_rope as reference_norm_rope


def apply(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False, gemma=False):
    """RoPE(RMSNorm(q) * q_weight) and the same for k, transformers' layouts: q [b, hq, s, d] after the
    attention's transpose (unsqueeze_dim=1) or [b, s, hq, d] before it (unsqueeze_dim=2); cos, sin [b or 1, s,
    rot] as transformers' rotary module returns them (rot <= d even: partial rotary over the first rot channels;
    interleaved: pairs (2i, 2i + 1)). gemma: Gemma's (1 + w). New tensors, in q's layout."""
    qv, kv = check_table_call(q, k, q_weight, k_weight, cos, sin, eps, unsqueeze_dim, interleaved, gemma)
    b, s, hq, d = qv.shape
    rot = cos.shape[-1]
    if not kernel_runs(q):
        c, s_ = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return tuple(reference_norm_rope(x, w, eps, gemma, c, s_, interleaved)
                     for x, w in ((q, q_weight), (k, k_weight)))
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    angles = table_angles(cos, sin, half=False, per_batch=cos.shape[0] > 1)
    key = ("qknorm", qv.shape, qv.stride(), qv.dtype, qv.device, kv.shape[2], rot, interleaved)
    call = call_for(key, lambda: Call(Layout(s, b, hq, d, rot, s, 0), "bshd", interleaved, None, None, 1, 0))
    qo, ko = norm_rotate(qv, kv, q_weight.contiguous(), k_weight.contiguous(), call, angles, norm=1 + gemma, eps=eps)
    return (qo.transpose(1, 2), ko.transpose(1, 2)) if unsqueeze_dim == 1 else (qo, ko)


def apply_cache(q, k, q_weight, k_weight, positions, cos_sin_cache, eps=1e-6, is_neox=True, gemma=False,
                mrope_section=None, mrope_interleaved=False):
    """RoPE(RMSNorm(x) * w) of q [T, hq, d] and k [T, hk, d] at `positions` [T] (int32/int64) of vLLM's
    cos_sin_cache [max_position, rot] (row p: the rot/2 cosines, then the sines); is_neox: half-split pairs,
    else interleaved. Multimodal RoPE as vLLM's MRotaryEmbedding: positions [3, T] (temporal, height, width; [T]:
    one stream for all three) and mrope_section (pairs per stream, summing to rot/2); pair i reads its section's
    stream, or, mrope_interleaved (Qwen3-VL), stream i % 3 while i < 3 * mrope_section[i % 3], else stream 0.
    Differentiable in q, k and both weights; new tensors."""
    mrope = None if mrope_section is None and mrope_interleaved is False else (mrope_section, mrope_interleaved)
    cos, sin, rows, streams = check_cache_call(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox,
                                               gemma, mrope=mrope)
    check_positions_in(positions, rows)
    if streams[0] and positions.dim() == 1:
        positions = positions.expand(3, q.shape[0])  # one stream for all three: stream stride 0
    if not kernel_runs(q):
        return _reference_cache(q, k, q_weight, k_weight, positions, cos, sin, eps, is_neox, gemma, streams)
    call, angles = _cache_call(q, k, cos_sin_cache, positions, is_neox, streams)
    return norm_rotate(q, k, q_weight.contiguous(), k_weight.contiguous(), call, angles, norm=1 + gemma, eps=eps,
                       token_index=positions[..., None] if streams[0] else positions, pos_table=True)


def fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache,
                       is_neox, position_ids):
    """vLLM's `fused_qk_norm_rope`: the q and k heads of packed qkv [T, (hq + hk + hv) * head_dim] normalised
    (weights [head_dim]) and rotated in place at `position_ids` [T]; v untouched; returns None. No backward."""
    q, k = check_packed(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim)
    cos, sin, rows, _ = check_cache_call(q, k, q_weight, k_weight, position_ids, cos_sin_cache, eps, is_neox, False,
                                      ("qkv", "position_ids"))
    check_inplace("qkv", qkv)
    if qkv.requires_grad and torch.is_grad_enabled():
        raise ValueError("qkv: vLLM's op writes qkv in place and has no backward; call it under torch.no_grad(), "
                         "or use rope.qknorm.apply_cache")
    check_positions_in(position_ids, rows, "position_ids")
    if not kernel_runs(qkv):
        qo, ko = _reference_cache(q, k, q_weight, k_weight, position_ids, cos, sin, eps, is_neox, False)
        q.copy_(qo)
        k.copy_(ko)
        return None
    call, angles = _cache_call(q, k, cos_sin_cache, position_ids, is_neox)
    norm_rotate(q, k, q_weight.contiguous(), k_weight.contiguous(), call, angles, norm=1, eps=eps,
                token_index=position_ids, pos_table=True, inplace=True)
    return None


def _cache_call(q, k, cache, positions, is_neox, streams=(0, 0, 0, 0)) -> tuple:
    """(the checked signature, the angles) of a call at positions of vLLM's cos_sin_cache; with `streams`, positions
    [3, T] go to the kernel in its [streams, s, b] roles."""
    rows, rot = cache.shape
    t, hq, d = q.shape
    key = ("qknorm-cache", q.shape, q.stride(), q.dtype, q.device, k.shape[1], rot, rows, is_neox, positions.dtype)
    call = call_for(key, lambda: Call(Layout(t, 1, hq, d, rot, rows, 0), "thd", not is_neox, None, None, 1, 0))
    angles = table_angles(cache[:, :rot // 2], cache[:, rot // 2:], half=True, streams=streams)
    return call, angles


def _reference_cache(q, k, q_weight, k_weight, positions, cos, sin, eps, is_neox, gemma, streams=(0, 0, 0, 0)):
    full = [reference.rows_at(reference.full_width(tab, not is_neox), positions.long()) for tab in (cos, sin)]
    if streams[0]:
        stream = reference.section_of_pair(streams[1:], cos.shape[1], streams[0] == 2, q.device)
        full = [reference.select_streams(tab, stream, not is_neox) for tab in full]
    full = [tab.unsqueeze(-2) for tab in full]
    return tuple(reference_norm_rope(x, w, eps, gemma, *full, not is_neox) for x, w in ((q, q_weight), (k, k_weight)))


__all__ = ["apply", "apply_cache", "apply_freqs", "fused_qk_norm_rope", "reference_norm_rope"]
