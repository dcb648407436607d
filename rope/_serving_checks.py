"""Argument checks of `rope.serving` (docs/contract.md, serving): everything is checked before anything is written,
each message starting with the argument's name; float64 is refused as on every kernel path. Values (positions,
slots) are checked where rope checks values: once per new or modified tensor, skipped during CUDA-graph capture and
tracing, where the kernel's guards remain (a position outside the table gives NaN, a slot outside the cache is not
stored)."""
from __future__ import annotations

import torch

from ._validate import (
    _PASSED,
    _check_index_tensor,
    _stamp,
    _still,
    check_disjoint,
    check_float_tensor,
    check_inplace,
    check_rotary_width,
    check_tables,
    check_token_positions,
    skip_value_checks,
)
from .vllm import _heads

CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8 = torch.float8_e4m3fn


def check_table(cos_sin_cache, d: int, x, x_name: str, rope_dim: int = 0):
    """cos_sin_cache [max_position, rot] (rot <= d even; SGLang's `rope_dim`: 0 or rot) -> (cos half, sin half,
    max_position)."""
    if not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.dim() != 2:
        raise ValueError(f"cos_sin_cache: expected shape [max_position, rotary_dim], got "
                         f"{getattr(cos_sin_cache, 'shape', type(cos_sin_cache).__name__)}")
    rows, rot = cos_sin_cache.shape
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim not in (0, rot):
        raise ValueError(f"rope_dim: expected 0 or cos_sin_cache's width {rot} (the rotary width), got {rope_dim!r}")
    check_rotary_width(rot, d, "cos_sin_cache")
    cos, sin = cos_sin_cache[:, :rot // 2], cos_sin_cache[:, rot // 2:]
    check_tables(cos, sin, x, x_name, ("cos_sin_cache", "cos_sin_cache"))
    return cos, sin, rows


def check_cache(name: str, cache, shape: tuple, x, fp8: bool, x_name: str = "query"):
    """A cache of `shape` on x's device, in x's dtype (auto) or float8_e4m3fn (uint8 viewed as it); returns it."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cache).__name__}")
    if tuple(cache.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {tuple(cache.shape)}")
    if cache.device != x.device:
        raise ValueError(f"{name}: expected the device of {x_name} ({x.device}), got {cache.device}")
    if fp8:
        if cache.dtype not in (FP8, torch.uint8):
            raise TypeError(f"{name}: an fp8 cache holds float8_e4m3fn (or its bytes as uint8), got {cache.dtype}")
        cache = cache.view(FP8)
    elif cache.dtype != x.dtype:
        raise TypeError(f"{name}: kv_cache_dtype 'auto' stores the model's dtype {x.dtype}, got {cache.dtype}")
    check_inplace(name, cache)
    return cache


def check_scale(name: str, scale, x):
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name}: an fp8 cache needs a float32 tensor of one element, got {type(scale).__name__}")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(f"{name}: expected a float32 tensor of one element, got {scale.dtype} {tuple(scale.shape)}")
    if scale.device != x.device:
        raise ValueError(f"{name}: expected the device of query ({x.device}), got {scale.device}")
    return scale.reshape(1)


def check_no_grad(**tensors) -> None:
    """The op writes in place and has no backward."""
    if torch.is_grad_enabled():
        for name, x in tensors.items():
            if x.requires_grad:
                raise ValueError(f"{name}: the fused op writes in place and has no backward; call it under "
                                 f"torch.no_grad()")


def check_vllm(positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox,
               kv_cache_dtype, k_scale, v_scale):
    """vLLM's form -> (q, k, v as [T, h, d] views, the caches [num_blocks, block_size, hk, d] (fp8 as
    float8_e4m3fn), cos, sin, max_position, fp8, k_scale, v_scale as [1])."""
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of {CACHE_DTYPES}, got {kv_cache_dtype!r}")
    fp8 = kv_cache_dtype != "auto"
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions: expected a torch.Tensor, got {type(positions).__name__}")
    if positions.dim() != 1:
        raise ValueError(f"positions: expected shape [num_tokens], got {tuple(positions.shape)}")
    if not isinstance(key_cache, torch.Tensor) or key_cache.dim() != 4:
        raise ValueError(f"key_cache: expected shape [num_blocks, block_size, num_kv_heads, head_size], got "
                         f"{getattr(key_cache, 'shape', type(key_cache).__name__)}")
    hk, d = key_cache.shape[2], key_cache.shape[3]
    q = _heads("query", query, positions, d)
    k, v = _heads("key", key, positions, d), _heads("value", value, positions, d)
    for name, x in (("key", k), ("value", v)):
        if x.shape[1] != hk:
            raise ValueError(f"{name}: expected num_kv_heads = {hk} heads (key_cache's), got {x.shape[1]}")
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name}: expected the dtype and device of query ({q.dtype}, {q.device}), got "
                             f"{x.dtype}, {x.device}")
    check_no_grad(query=query, key=key, value=value)
    check_token_positions(positions, q.shape[0], q, "query")
    cos, sin, rows = check_table(cos_sin_cache, d, q, "query")
    kc = check_cache("key_cache", key_cache, key_cache.shape, q, fp8)
    vc = check_cache("value_cache", value_cache, key_cache.shape, q, fp8)
    _check_index_tensor("slot_mapping", slot_mapping, q, "query")
    if slot_mapping.shape[0] > q.shape[0]:
        raise ValueError(f"slot_mapping: expected at most num_tokens = {q.shape[0]} slots, got "
                         f"{slot_mapping.shape[0]}")
    ks = check_scale("k_scale", k_scale, q) if fp8 else None
    vs = check_scale("v_scale", v_scale, q) if fp8 else None
    check_inplace("query", q)
    check_inplace("key", k)
    check_disjoint(q, k, ("query", "key"))
    check_disjoint(kc, vc, ("key_cache", "value_cache"))
    return q, k, v, kc, vc, cos, sin, rows, fp8, ks, vs


def check_sglang(q, k, v, k_cache, v_cache, cos_sin_cache, positions, out_loc, is_neox, rope_dim):
    """SGLang's flat pool form -> (q, k, v [T, h, d], the pools as [pool_size, 1, hk, d] (blocks of one slot), cos,
    sin, max_position)."""
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
    for name, x in (("q", q), ("k", k)):
        check_float_tensor(name, x)
        if x.dim() != 3:
            raise ValueError(f"{name}: expected [num_tokens, heads, head_dim], got {tuple(x.shape)}")
    t, hk, d = k.shape
    if q.shape[0] != t or q.shape[2] != d or q.dtype != k.dtype or q.device != k.device:
        raise ValueError(f"k: expected q's tokens, head_dim, dtype and device ({t}, {q.shape[2]}, {q.dtype}, "
                         f"{q.device}), got {tuple(k.shape)} {k.dtype} {k.device}")
    check_float_tensor("v", v)
    if v.dtype != k.dtype or v.device != k.device or tuple(v.shape) not in ((t, hk, d), (t, hk * d)):
        raise ValueError(f"v: expected k's dtype and device and shape [{t}, {hk}, {d}] or [{t}, {hk * d}], got "
                         f"{tuple(v.shape)} {v.dtype} {v.device}")
    v = v.unflatten(1, (hk, d)) if v.dim() == 2 else v
    check_no_grad(q=q, k=k, v=v)
    check_token_positions(positions, t, q, "q")
    cos, sin, rows = check_table(cos_sin_cache, d, q, "q", rope_dim)
    pools = []
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() not in (2, 3) or c.shape[1:] not in ((hk * d,), (hk, d)):
            raise ValueError(f"{name}: expected shape [pool_size, {hk * d}] or [pool_size, {hk}, {d}] (num_kv_heads "
                             f"= {hk}, head_dim = {d}), got {getattr(c, 'shape', type(c).__name__)}")
        c = check_cache(name, c, c.shape, q, False, "q")
        pools.append((c.unflatten(1, (hk, d)) if c.dim() == 2 else c).unsqueeze(1))
    if pools[1].shape != pools[0].shape:
        raise ValueError(f"v_cache: expected k_cache's pool size {pools[0].shape[0]}, got {pools[1].shape[0]}")
    _check_index_tensor("out_loc", out_loc, q, "q")
    if out_loc.shape[0] != t:
        raise ValueError(f"out_loc: expected one slot per token ({t}), got {out_loc.shape[0]}")
    check_inplace("q", q)
    check_inplace("k", k)
    check_disjoint(q, k, ("q", "k"))
    check_disjoint(*pools, ("k_cache", "v_cache"))
    return q, k, v, pools[0], pools[1], cos, sin, rows


def check_slots_in(slots, n_slots: int, low: int, name: str) -> None:
    """Every slot in [low, n_slots) (low -1: vLLM's padding, not stored); as `check_positions_in`, one
    device-to-host copy per new or modified tensor, skipped where that would break a capture or trace."""
    key = (id(slots), n_slots, low, name)
    seen = _PASSED.get(key)
    if (seen is not None and _still(seen[0], slots)) or slots.numel() == 0 or skip_value_checks(slots):
        return
    lo, hi = torch.stack(torch.aminmax(slots)).tolist()
    if lo < low or hi >= n_slots:
        raise ValueError(f"{name}: expected slots in [{low}, {n_slots}) (the cache's slots"
                         f"{', -1: not stored' if low < 0 else ''}), got values in [{lo}, {hi}]")
    stamp = _stamp(slots)
    if stamp is not False:
        _PASSED.put(key, (stamp,))
