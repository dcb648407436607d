"""RoPE fused with the KV-cache write, vLLM's form (spec/vllm_cache.py): a correct implementation and planted bugs.

Written as a kernel addresses memory: query and key rotated through their storage (zoo/vllm.py), the caches
written through theirs at block * stride_0 + offset * stride_1 + head * stride_2 + channel * stride_3, so that
stride and slot bugs are what they would be in a kernel.
"""
from __future__ import annotations

import torch

from .vllm import addressed, rotate_all, storage_of

FP8_MAX = 448.0


def as_cache(x, cache, scale, fp8, multiply=False):
    """x (the model's dtype) as the cache stores it: itself, or e4m3(x / scale) computed in float32, saturated."""
    if not fp8:
        return x.to(cache.dtype)
    s = scale.float().reshape(())
    y = x.float() * s if multiply else x.float() / s
    return y.clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)


def cache_index(cache, slots, strides=None, swap=False, by_shift=False):
    """Storage index of each slot's [h, d] rows in `cache` [nb, bs, h, d] (strides: its own unless given).
    by_shift: block and offset by a shift and a mask, right for a power-of-two block_size only."""
    nb, bs, h, d = cache.shape
    s0, s1, s2, s3 = strides or cache.stride()
    block, offset = (slots % bs, slots // bs) if swap else (slots // bs, slots % bs)
    if by_shift:
        block, offset = slots >> (bs.bit_length() - 1), slots & (bs - 1)
    dev = cache.device
    return (cache.storage_offset() + block[:, None, None] * s0 + offset[:, None, None] * s1
            + torch.arange(h, device=dev)[None, :, None] * s2 + torch.arange(d, device=dev) * s3)


def write(cache, rows, slots, strides=None, swap=False, minus_one_last=False, by_shift=False):
    """rows [n, h, d] stored at `slots` (tokens with slot -1 skipped, or, minus_one_last, written at the last slot
    as Python's negative index reads it); indices past the storage masked, as a kernel's bounds check."""
    n_slots = cache.shape[0] * cache.shape[1]
    slots = slots.long()
    if minus_one_last:
        slots = torch.where(slots < 0, slots + n_slots, slots)
    keep = (slots >= 0) & (slots < n_slots)
    store = storage_of(cache)
    idx = cache_index(cache, slots[keep], strides, swap, by_shift)
    vals = rows[keep]
    inside = idx < store.numel()
    store[idx[inside]] = vals[inside]


def run(positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox,
        kv_cache_dtype="auto", k_scale=None, v_scale=None, *, rotate_k=True, tokens=None, rotate_v=False,
        cache_strides=None, swap=False, multiply=False, minus_one_last=False, store_before=False, by_shift=False,
        math_dtype=torch.float32):
    t = positions.shape[0]
    d = key_cache.shape[-1]
    fp8 = kv_cache_dtype != "auto"
    kc, vc = (c.view(torch.float8_e4m3fn) if fp8 and c.dtype == torch.uint8 else c for c in (key_cache, value_cache))
    store, idx = addressed(key, 1, d)
    k_before = store[idx].clone()
    n = t if tokens is None else tokens  # tokens rotated: all, or (a grid over the slots) the first n
    rotate_all(positions[:n], query[:n], key[:n] if rotate_k else None, d, cos_sin_cache, is_neox,
               math_dtype=math_dtype)
    if rotate_k:
        k_rows = store[idx].clone()
    else:  # the rotated k computed for the cache only
        k_rows = k_before.clone()
        rotate_all(positions, k_rows, None, d, cos_sin_cache, is_neox, math_dtype=math_dtype)
    if store_before:
        k_rows = k_before
    vstore, vidx = addressed(value, 1, d)
    v_rows = vstore[vidx].clone()
    if rotate_v:
        rotate_all(positions, v_rows, None, d, cos_sin_cache, is_neox)
    slots = slot_mapping.long()
    m = slots.shape[0]
    write(kc, as_cache(k_rows[:m], kc, k_scale, fp8, multiply), slots, cache_strides, swap, minus_one_last, by_shift)
    write(vc, as_cache(v_rows[:m], vc, v_scale, fp8, multiply), slots, cache_strides, swap, minus_one_last, by_shift)


def correct(*args, **kw):
    run(*args, **kw)


def k_not_written_back(*args, **kw):
    """The rotated k stored in the cache but not written back to the live key (sglang #19636)."""
    run(*args, rotate_k=False, **kw)


def unstored_not_rotated(positions, query, key, value, key_cache, value_cache, slot_mapping, *rest, **kw):
    """A token with slot -1 skipped whole (the kernel returns before rotating it)."""
    keep = slot_mapping.long() >= 0
    m = slot_mapping.shape[0]
    keep = torch.cat([keep, torch.ones(positions.shape[0] - m, dtype=torch.bool, device=keep.device)])
    q0, k0 = query.clone(), key.clone()
    run(positions, query, key, value, key_cache, value_cache, slot_mapping, *rest, **kw)
    query[~keep] = q0[~keep]
    key[~keep] = k0[~keep]


def short_mapping_not_rotated(positions, query, key, value, key_cache, value_cache, slot_mapping, *rest, **kw):
    """The grid runs over slot_mapping: tokens past a short one are not rotated."""
    run(positions, query, key, value, key_cache, value_cache, slot_mapping, *rest, tokens=slot_mapping.shape[0],
        **kw)


def v_rotated(*args, **kw):
    """v rotated as k is before it is stored."""
    run(*args, rotate_v=True, **kw)


def strided_cache_as_contiguous(*args, **kw):
    """The caches addressed as contiguous [nb, bs, h, d] from their first element (their strides ignored)."""
    nb, bs, h, d = args[4].shape
    run(*args, cache_strides=(bs * h * d, h * d, d, 1), **kw)


def block_offset_swapped(*args, **kw):
    """slot % block_size taken as the block and slot // block_size as the offset."""
    run(*args, swap=True, **kw)


def fp8_scale_multiplied(*args, **kw):
    """fp8: x * scale stored instead of x / scale."""
    run(*args, multiply=True, **kw)


def minus_one_written_last(*args, **kw):
    """slot -1 used as an index: written at the cache's last slot."""
    run(*args, minus_one_last=True, **kw)


def unrotated_k_stored(*args, **kw):
    """The cache written from k before the rotation (the store issued ahead of RoPE)."""
    run(*args, store_before=True, **kw)


def block_by_shift(*args, **kw):
    """slot -> (block, offset) by a shift and a mask (slot >> log2(block_size), slot & (block_size - 1)), as a
    kernel written for power-of-two block sizes computes them: other block sizes store k and v in wrong rows."""
    run(*args, **kw, by_shift=True)


def math_depends_on_batch(*args, **kw):
    """A single token computes in float64, more in float32 (a kernel picking its path by the token count, as decode
    and prefill paths do): each result within one rounding, but a token's rotated q and k, and the k its slot holds,
    depend on what else is in the call."""
    run(*args, math_dtype=torch.float64 if args[0].shape[0] == 1 else torch.float32, **kw)


CORRECT = correct
BUGS = {
    "k_not_written_back": (k_not_written_back, ("forward", "equals_rope_then_write")),
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "unstored_not_rotated": (unstored_not_rotated, ("forward", "unstored_tokens_rotated")),
    "short_mapping_not_rotated": (short_mapping_not_rotated, ("forward", "unstored_tokens_rotated")),
    "v_rotated": (v_rotated, ("forward", "equals_rope_then_write")),
    "strided_cache_as_contiguous": (strided_cache_as_contiguous, ("forward",)),
    "block_offset_swapped": (block_offset_swapped, ("forward", "equals_rope_then_write")),
    "fp8_scale_multiplied": (fp8_scale_multiplied, ("forward", "equals_rope_then_write")),
    "minus_one_written_last": (minus_one_written_last, ("forward",)),
    "unrotated_k_stored": (unrotated_k_stored, ("forward", "equals_rope_then_write")),
    # a block_size that is not a power of two
    "block_by_shift": (block_by_shift, ("forward",)),
}
