"""RoPE fused with the KV-cache write, in one kernel (serving: one launch per layer and step instead of two).

q and k are rotated in place; the rotated k (all its channels) and the unrotated v are stored at each token's cache
slot; nothing else in the caches is touched. A token without a slot is rotated and not stored.
- `rope_and_cache`: vLLM's form, its `rotary_embedding` followed by `reshape_and_cache_flash`: positions [T],
  query [T, hq * d] or [T, hq, d], key and value [T, hk(, d)], caches [num_blocks, block_size, hk, d] (any strides:
  views of one packed buffer too), slot_mapping [<= T] (slot = block * block_size + offset; -1, or a token past it:
  not stored), kv_cache_dtype "auto" (the model's dtype, v stored bit for bit) or "fp8"/"fp8_e4m3" (float8_e4m3fn,
  x / scale rounded to nearest even and saturated, with per-tensor float32 k_scale, v_scale).
- `apply_rope_inplace_with_kvcache`: SGLang's flat token pool: k_cache, v_cache [pool_size, hk * d] or [pool_size,
  hk, d], out_loc [T] (a slot per token).
Inference only (no backward). Under torch.compile each is rope's one in-place custom op, `torch.ops.rope.rotate_`
(q, k and the caches written).
"""
from __future__ import annotations

from . import _launch, reference
from ._backend import convention, dispatch
from ._checks import check_positions_in, check_sglang, check_slots_in, check_vllm


def rope_and_cache(positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox,
                   kv_cache_dtype="auto", k_scale=None, v_scale=None):
    """vLLM's rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox) then
    reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale), in
    one launch (head_size: the caches'); returns None."""
    q, k, v, kc, vc, cos, sin, rows, fp8, ks, vs = check_vllm(positions, query, key, value, key_cache, value_cache,
                                                              slot_mapping, cos_sin_cache, is_neox, kv_cache_dtype,
                                                              k_scale, v_scale)
    check_positions_in(positions, rows)
    check_slots_in(slot_mapping, kc.shape[0] * kc.shape[1], -1, "slot_mapping")
    dispatch(KV_CACHE, (q, k, kc, vc), (v, slot_mapping, positions, cos, sin, ks, vs), (not is_neox, fp8),
             inplace=True)
    return None


def apply_rope_inplace_with_kvcache(q, k, v, k_cache, v_cache, cos_sin_cache, positions, out_loc, *, is_neox,
                                   rope_dim=0):
    """SGLang's fused op: q [T, hq, d] and k [T, hk, d] rotated in place at positions [T] of cos_sin_cache
    [max_position, rot] (rope_dim: 0 or rot), the rotated k and v [T, hk, d] (or [T, hk * d])
    stored at row out_loc[t] of the pools k_cache, v_cache in q's dtype; returns None."""
    qv, kv, vv, kc, vc, cos, sin, rows = check_sglang(q, k, v, k_cache, v_cache, cos_sin_cache, positions, out_loc,
                                                      is_neox, rope_dim)
    check_positions_in(positions, rows)
    check_slots_in(out_loc, kc.shape[0], 0, "out_loc")
    dispatch(KV_CACHE, (qv, kv, kc, vc), (vv, out_loc, positions, cos, sin, None, None), (not is_neox, False),
             inplace=True)
    return None


# ts: q, k and the two caches, written; reads: v, the slots, the positions, the half tables cos and sin [rows, rot/2]
# and the fp8 scales; flags: (interleaved, fp8).
def _launch_kv_cache(ts, reads, flags) -> None:
    q, k, key_cache, value_cache = ts
    v, slots, positions, cos, sin, k_scale, v_scale = reads
    _launch.rotate_and_cache(q, k, v, key_cache, value_cache, slots, positions, cos, sin, cos.shape[0], *flags,
                             k_scale, v_scale)


def _reference_kv_cache(ts, reads, flags, backward) -> tuple:
    q, k, key_cache, value_cache = ts
    v, slots, positions, cos, sin, k_scale, v_scale = reads
    reference.rotate_and_cache(q, k, v, key_cache, value_cache, slots, positions, cos, sin, *flags, k_scale, v_scale)
    return ts


KV_CACHE = convention("kv-cache", None, None, _reference_kv_cache, launch=_launch_kv_cache)


__all__ = ["apply_rope_inplace_with_kvcache", "rope_and_cache"]
