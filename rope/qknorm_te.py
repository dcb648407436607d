"""QK-RMSNorm fused with RoPE in TransformerEngine's layouts (`rope.qknorm.apply_freqs`): q and k as
`rope.apply_rotary_pos_emb_qk` takes them (sbhd, bshd, or thd with cu_seqlens; start_positions; context parallel),
angles `freqs` [s2, 1, 1, rot] or a `rope.RoPECache`; per head y = RoPE(RMSNorm(x) * w) as in `rope.qknorm`.
"""
from __future__ import annotations

from . import reference
from ._backend import checked_call, kernel_runs, norm_rotate
from ._checks import check_freqs_call
from ._launch import angles_for, table_angles, token_index_for
from .cache import RoPECache
from .reference import norm_rope as reference_norm_rope


def apply_freqs(q, k, q_weight, k_weight, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                cu_seqlens=None, cp_size=1, cp_rank=0, eps=1e-6, gemma=False):
    """RoPE(RMSNorm(q) * q_weight) and the same for k, at TransformerEngine's positions (docs/contract.md
    sections 3 and 7e): q [s, b, hq, d] (sbhd), [b, s, hq, d] (bshd) or [t, hq, d] (thd, cu_seqlens [n + 1]),
    k the same with hk heads, any strides; freqs [s2, 1, 1, rot] (rot <= d even, read as float32: the first rot
    channels rotate, the norm spans all d) or a `rope.RoPECache`. Weights [d], any float dtype; gemma: Gemma's
    (1 + w). float32 math, one rounding to q's dtype; new contiguous tensors in q's format; differentiable in q,
    k and both weights (freqs get no gradient, as in TransformerEngine)."""
    cache = freqs if isinstance(freqs, RoPECache) else None
    angles_in = freqs if cache is None else cache.as_freqs
    kernel = kernel_runs(q)
    call = check_freqs_call(q, k, q_weight, k_weight, angles_in, tensor_format, start_positions, interleaved,
                            cu_seqlens, cp_size, cp_rank, eps, gemma, checked_call if kernel else None)
    if not kernel:
        return _reference(q, k, q_weight, k_weight, angles_in, cache, call, tensor_format, start_positions,
                          interleaved, cu_seqlens, cp_size, cp_rank, eps, gemma)
    angles = angles_for(call, angles_in) if cache is None else table_angles(cache.cos, cache.sin, half=False)
    token_index, pos_table = token_index_for(call, cu_seqlens)
    return norm_rotate(q, k, q_weight.contiguous(), k_weight.contiguous(), call, angles, norm=1 + gemma, eps=eps,
                       start_positions=start_positions, token_index=token_index, pos_table=pos_table)


def _reference(q, k, q_weight, k_weight, freqs, cache, layout, tensor_format, start_positions, interleaved,
               cu_seqlens, cp_size, cp_rank, eps, gemma):
    """The PyTorch path: `rope.reference`'s positions and tables (float32 angles, as the kernel reads freqs), then
    `reference_norm_rope` per tensor."""
    pos = reference.token_positions(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, q.device)
    cos, sin = reference.token_tables(freqs, cache, pos, tensor_format)
    return tuple(reference_norm_rope(x, w, eps, gemma, cos, sin, interleaved).contiguous()
                 for x, w in ((q, q_weight), (k, k_weight)))


__all__ = ["apply_freqs"]
