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
Inference only (no backward). Under torch.compile each is an opaque custom op (the caches are written in place).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._backend import rotate_and_cache
from ._checks import check_positions_in, check_sglang, check_slots_in, check_vllm


def rope_and_cache(positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox,
                   kv_cache_dtype="auto", k_scale=None, v_scale=None):
    """vLLM's rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox) then
    reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale), in
    one launch (head_size: the caches'); returns None."""
    q, k, v, kc, vc, cos, sin, rows, fp8, ks, vs = check_vllm(positions, query, key, value, key_cache, value_cache,
                                                              slot_mapping, cos_sin_cache, is_neox, kv_cache_dtype,
                                                              k_scale, v_scale)
    if torch.compiler.is_compiling():
        return torch.ops.rope.rope_and_cache(positions, query, key, value, key_cache, value_cache, slot_mapping,
                                             cos_sin_cache, is_neox, kv_cache_dtype, k_scale, v_scale)
    check_positions_in(positions, rows)
    check_slots_in(slot_mapping, kc.shape[0] * kc.shape[1], -1, "slot_mapping")
    rotate_and_cache(q, k, v, kc, vc, slot_mapping, positions, cos, sin, rows, not is_neox, fp8, ks, vs)
    return None


def apply_rope_inplace_with_kvcache(q, k, v, k_cache, v_cache, cos_sin_cache, positions, out_loc, *, is_neox,
                                   rope_dim=0):
    """SGLang's fused op: q [T, hq, d] and k [T, hk, d] rotated in place at positions [T] of cos_sin_cache
    [max_position, rot] (rope_dim: 0 or rot), the rotated k and v [T, hk, d] (or [T, hk * d])
    stored at row out_loc[t] of the pools k_cache, v_cache in q's dtype; returns None."""
    qv, kv, vv, kc, vc, cos, sin, rows = check_sglang(q, k, v, k_cache, v_cache, cos_sin_cache, positions, out_loc,
                                                      is_neox, rope_dim)
    if torch.compiler.is_compiling():
        return torch.ops.rope.apply_rope_inplace_with_kvcache(q, k, v, k_cache, v_cache, cos_sin_cache, positions,
                                                              out_loc, is_neox, rope_dim)
    check_positions_in(positions, rows)
    check_slots_in(out_loc, kc.shape[0], 0, "out_loc")
    rotate_and_cache(qv, kv, vv, kc, vc, out_loc, positions, cos, sin, rows, not is_neox)
    return None


@torch.library.custom_op("rope::rope_and_cache", mutates_args=("query", "key", "key_cache", "value_cache"))
def _rope_and_cache_op(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       cos_sin_cache: torch.Tensor, is_neox: bool, kv_cache_dtype: str,
                       k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> None:
    rope_and_cache(positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox,
                   kv_cache_dtype, k_scale, v_scale)


@_rope_and_cache_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("rope::apply_rope_inplace_with_kvcache", mutates_args=("q", "k", "k_cache", "v_cache"))
def _sglang_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               cos_sin_cache: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor, is_neox: bool,
               rope_dim: int) -> None:
    apply_rope_inplace_with_kvcache(q, k, v, k_cache, v_cache, cos_sin_cache, positions, out_loc, is_neox=is_neox,
                                    rope_dim=rope_dim)


@_sglang_op.register_fake
def _(*args):
    return None


__all__ = ["apply_rope_inplace_with_kvcache", "rope_and_cache"]
