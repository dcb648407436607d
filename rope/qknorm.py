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
from ._backend import Call, check_once, convention, dispatch
from ._checks import Layout, check_cache_call, check_inplace, check_packed, check_positions_in, check_table_call
from ._launch import table_angles
from .qknorm_te import apply_freqs
from .reference import norm_rope as reference_norm_rope


def apply(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False, gemma=False, *,
          schedule=None):
    """RoPE(RMSNorm(q) * q_weight) and the same for k, transformers' layouts: q [b, hq, s, d] after the
    attention's transpose (unsqueeze_dim=1) or [b, s, hq, d] before it (unsqueeze_dim=2); cos, sin [b or 1, s,
    rot] as transformers' rotary module returns them (rot <= d even: partial rotary over the first rot channels;
    interleaved: pairs (2i, 2i + 1)). gemma: Gemma's (1 + w). New tensors, in q's layout. `schedule="eager"`: the
    forward bitwise Qwen3RMSNorm (Gemma3RMSNorm with gemma) and transformers' rotation run eagerly by PyTorch's CUDA
    kernels, the norm's mean reduced in their order (docs/contract.md, "Schedules"); the backward is the
    default's."""
    seen = check_once("qknorm.apply", check_table_call, (q, k, q_weight, k_weight, cos, sin),
                      (eps, unsqueeze_dim, interleaved, gemma, schedule))
    qv, kv = (q.transpose(1, 2), k.transpose(1, 2)) if unsqueeze_dim == 1 else (q, k)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    qo, ko = dispatch(QKNORM, (qv, kv, q_weight.contiguous(), k_weight.contiguous()), (cos, sin),
                      (interleaved, gemma, eps, schedule), seen=seen)
    return (qo.transpose(1, 2), ko.transpose(1, 2)) if unsqueeze_dim == 1 else (qo, ko)


def _call(ts, reads, flags) -> Call:
    b, s, hq, d = ts[0].shape
    return Call(Layout(s=s, b=b, h=hq, d=d, rot_dim=reads[0].shape[-1], freqs_len=s), tensor_format="bshd",
                interleaved=flags[0], schedule=flags[3])


def _reads(call, reads, flags) -> tuple:
    cos, sin = reads
    interleaved, gemma, eps, _ = flags
    return table_angles(cos, sin, half=False, per_batch=cos.shape[0] > 1), None, None, False, 1 + gemma, eps


def _reference(ts, reads, flags, backward) -> tuple:
    qv, kv, q_weight, k_weight = ts
    interleaved, gemma, eps, schedule = flags
    c, s = reads[0].unsqueeze(2), reads[1].unsqueeze(2)
    if schedule == "eager" and not backward:
        return tuple(reference.norm_rope_eager(x, w, eps, gemma, c, s, interleaved)
                     for x, w in ((qv, q_weight), (kv, k_weight)))
    return tuple(reference_norm_rope(x, w, eps, gemma, c, s, interleaved) for x, w in ((qv, q_weight), (kv, k_weight)))


QKNORM = convention("qknorm", _call, _reads, _reference, norm=True)


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
    return dispatch(QKNORM_CACHE, (q, k, q_weight.contiguous(), k_weight.contiguous()), (cos, sin, positions),
                    (not is_neox, gemma, eps, streams))


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
    dispatch(QKNORM_CACHE, (q, k, q_weight.contiguous(), k_weight.contiguous()), (cos, sin, position_ids),
             (not is_neox, False, eps, (0, 0, 0, 0)), inplace=True)
    return None


def _cache_call(ts, reads, flags) -> Call:
    """A call at positions of vLLM's cos_sin_cache (cos, sin: its halves [max_position, rot / 2])."""
    t, hq, d = ts[0].shape
    cos = reads[0]
    return Call(Layout(s=t, b=1, h=hq, d=d, rot_dim=2 * cos.shape[1], freqs_len=cos.shape[0]), tensor_format="thd",
                interleaved=flags[0])


def _cache_reads(call, reads, flags) -> tuple:
    """With multimodal `streams`, positions [3, T] go to the kernel in its [streams, s, b] roles."""
    cos, sin, positions = reads
    interleaved, gemma, eps, streams = flags
    return (table_angles(cos, sin, half=True, streams=streams), None,
            positions[..., None] if streams[0] else positions, True, 1 + gemma, eps)


def _reference_cache(ts, reads, flags, backward) -> tuple:
    q, k, q_weight, k_weight = ts
    cos, sin, positions = reads
    interleaved, gemma, eps, streams = flags
    full = [reference.rows_at(reference.full_width(tab, interleaved), positions.long()) for tab in (cos, sin)]
    if streams[0]:
        stream = reference.section_of_pair(streams[1:], cos.shape[1], streams[0] == 2, q.device)
        full = [reference.select_streams(tab, stream, interleaved) for tab in full]
    full = [tab.unsqueeze(-2) for tab in full]
    return tuple(reference_norm_rope(x, w, eps, gemma, *full, interleaved) for x, w in ((q, q_weight), (k, k_weight)))


QKNORM_CACHE = convention("qknorm-cache", _cache_call, _cache_reads, _reference_cache, norm=True)


__all__ = ["apply", "apply_cache", "apply_freqs", "fused_qk_norm_rope", "reference_norm_rope"]
