"""QK-RMSNorm fused with RoPE in TransformerEngine's layouts (`rope.qknorm.apply_freqs`): q and k as
`rope.apply_rotary_pos_emb_qk` takes them (sbhd, bshd, or thd with cu_seqlens; start_positions; context parallel),
angles `freqs` [s2, 1, 1, rot] or a `rope.RoPECache`; per head y = RoPE(RMSNorm(x) * w) as in `rope.qknorm`.
"""
from __future__ import annotations

from . import reference
from ._backend import Call, checked_call, convention, dispatch
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
    check_freqs_call(q, k, q_weight, k_weight, angles_in, tensor_format, start_positions, interleaved, cu_seqlens,
                     cp_size, cp_rank, eps, gemma, checked_call)
    cos, sin = (None, None) if cache is None else (cache.cos, cache.sin)
    return dispatch(QKNORM_TE, (q, k, q_weight.contiguous(), k_weight.contiguous()),
                    (angles_in, cos, sin, start_positions, cu_seqlens),
                    (tensor_format, interleaved, cp_size, cp_rank, gemma, eps))


def _call(ts, reads, flags) -> Call:
    tensor_format, interleaved, cp_size, cp_rank = flags[:4]
    return checked_call(ts[0], reads[0], tensor_format, reads[3], interleaved, reads[4], cp_size, cp_rank, "q")


def _reads(call, reads, flags) -> tuple:
    freqs, cos, sin, start_positions, cu_seqlens = reads
    angles = angles_for(call, freqs) if cos is None else table_angles(cos, sin, half=False)
    return (angles, start_positions, *token_index_for(call, cu_seqlens), 1 + flags[4], flags[5])


def _reference(ts, reads, flags, backward) -> tuple:
    """The PyTorch path: `rope.reference`'s positions and tables (float32 angles, as the kernel reads freqs), then
    `reference_norm_rope` per tensor."""
    q, k, q_weight, k_weight = ts
    freqs, cos, sin, start_positions, cu_seqlens = reads
    tensor_format, interleaved, cp_size, cp_rank, gemma, eps = flags
    layout = _call(ts, reads, flags).layout
    pos = reference.token_positions(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, q.device)
    if cos is None:
        cos, sin = reference.token_tables(freqs, None, pos, tensor_format)
    else:
        cos, sin = reference.token_tables(None, reference.Tables(cos, sin), pos, tensor_format)
    return tuple(reference_norm_rope(x, w, eps, gemma, cos, sin, interleaved).contiguous()
                 for x, w in ((q, q_weight), (k, k_weight)))


QKNORM_TE = convention("qknorm-te", _call, _reads, _reference, norm=True)


__all__ = ["apply_freqs"]
