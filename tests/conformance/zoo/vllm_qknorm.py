"""vLLM's fused QK norm + RoPE (spec/vllm_qknorm.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch

from . import per_channel, rotate_half, row_rms


def _apply(x, w, cos_sin_cache, positions, eps, is_neox, rms=None, swap=False):
    """x [T, h, d] normalised and rotated (float32), rounded to x's dtype."""
    rot = cos_sin_cache.shape[1]
    rows = cos_sin_cache[positions.long()].float()
    cos, sin = rows[:, :rot // 2], rows[:, rot // 2:]
    if swap:
        cos, sin = sin, cos
    cos, sin = (per_channel(t, not is_neox).unsqueeze(1) for t in (cos, sin))
    xf = x.float()
    r = row_rms(xf, eps) if rms is None else rms(xf)
    a = xf * r * w.float()
    head = a[..., :rot]
    return torch.cat([head * cos + rotate_half(head, not is_neox) * sin, a[..., rot:]], dim=-1).to(x.dtype)


def _heads(qkv, hq, hk, hv, d):
    heads = qkv.unflatten(1, (hq + hk + hv, d))
    return heads[:, :hq], heads[:, hq:hq + hk], heads[:, hq + hk:]


def correct(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox,
            position_ids, _rms=None, _swap=False, _neox=None):
    q, k, _ = _heads(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim)
    neox = is_neox if _neox is None else _neox
    q.copy_(_apply(q, q_weight, cos_sin_cache, position_ids, eps, neox, _rms, _swap))
    k.copy_(_apply(k, k_weight, cos_sin_cache, position_ids, eps, neox, _rms, _swap))


def v_touched(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox,
              position_ids):
    """The v heads normalised with k's weight too (a kernel looping over every head after q's)."""
    correct(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox,
            position_ids)
    _, _, v = _heads(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim)
    xf = v.float()
    v.copy_((xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * k_weight.float()).to(v.dtype))


def k_from_the_end(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache,
                   is_neox, position_ids):
    """k taken as the last num_heads_k heads of the row (right only where there are no v heads)."""
    hq, hk, d = num_heads_q, num_heads_k, head_dim
    heads = qkv.unflatten(1, (hq + hk + num_heads_v, d))
    q, k = heads[:, :hq], heads[:, heads.shape[1] - hk:]
    q.copy_(_apply(q, q_weight, cos_sin_cache, position_ids, eps, is_neox))
    k.copy_(_apply(k, k_weight, cos_sin_cache, position_ids, eps, is_neox))


def neox_inverted(*args):
    """is_neox read the other way round."""
    correct(*args, _neox=not args[9])


def cache_halves_swapped(*args):
    """The sines read from the cache's first half, the cosines from its second."""
    correct(*args, _swap=True)


def norm_over_rotated_only(*args):
    """The mean of x^2 over the rotated channels only."""
    rot = args[8].shape[1]
    correct(*args, _rms=lambda xf: torch.rsqrt(xf[..., :rot].square().mean(-1, keepdim=True) + args[5]))


def eps_outside_sqrt(*args):
    """rsqrt(mean(x^2)) + eps."""
    correct(*args, _rms=lambda xf: torch.rsqrt(xf.square().mean(-1, keepdim=True)) + args[5])


def token_index_as_position(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
                            cos_sin_cache, is_neox, position_ids):
    """Token i at position i (position_ids ignored, as a prefill of one sequence from 0 would pass)."""
    pos = torch.arange(qkv.shape[0], device=qkv.device) % cos_sin_cache.shape[0]
    correct(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox,
            pos)


def empty_returns_qkv(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache,
                      is_neox, position_ids):
    """An early exit for T = 0 that returns qkv, where the in-place op returns None: only an empty qkv exposes it."""
    if not qkv.shape[0]:
        return qkv
    return correct(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache,
                   is_neox, position_ids)


def math_depends_on_batch(*args):
    """One token sums its squares in float64, more in float32 (a decode path and a prefill path): each result within
    the norm's rounding, but a token's result depends on what else is in the call."""
    one, eps = args[0].shape[0] == 1, args[5]

    def rms(xf):
        if not one:
            return torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        return torch.rsqrt(xf.double().square().mean(-1, keepdim=True) + eps).float()

    correct(*args, _rms=rms)


CORRECT = correct
BUGS = {
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "empty_returns_qkv": (empty_returns_qkv, ("forward",)),
    "v_touched": (v_touched, ("forward", "v_untouched")),
    "k_from_the_end": (k_from_the_end, ("forward", "v_untouched")),
    "neox_inverted": (neox_inverted, ("forward",)),
    "cache_halves_swapped": (cache_halves_swapped, ("forward",)),
    "norm_over_rotated_only": (norm_over_rotated_only, ("forward",)),
    "eps_outside_sqrt": (eps_outside_sqrt, ("forward",)),
    "token_index_as_position": (token_index_as_position, ("forward", "tokens_independent")),
}
