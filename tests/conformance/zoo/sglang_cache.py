"""RoPE fused with the KV-cache write, SGLang's flat pool (spec/sglang_cache.py): a correct implementation and
planted bugs, written as a kernel addresses memory (zoo/vllm.py's storage addressing; a pool row at
out_loc * row stride)."""
from __future__ import annotations

import torch

from .vllm import addressed, rotate_all, storage_of


def write(pool, rows, loc, row_stride=None):
    """rows [T, hk, d] stored at pool rows `loc`; indices past the storage masked, as a kernel's bounds check."""
    t, hk, d = rows.shape
    store = storage_of(pool)
    stride = pool.stride(0) if row_stride is None else row_stride
    chan = pool.stride(-1)
    head = pool.stride(1) if pool.dim() == 3 else d * chan
    idx = (pool.storage_offset() + loc.long()[:, None, None] * stride + torch.arange(hk, device=pool.device)[:, None]
           * head + torch.arange(d, device=pool.device) * chan)
    inside = idx < store.numel()
    store[idx[inside]] = rows[inside].to(pool.dtype)


def run(q, k, v, k_cache, v_cache, cos_sin_cache, positions, out_loc, *, is_neox, rope_dim=0, rotate_k=True,
        rotate_v=False, loc=None, row_stride=None, swap=False, tokens=None, store_before=False,
        math_dtype=torch.float32):
    d = q.shape[-1]
    kstore, kidx = addressed(k, 1, d)
    k_before = kstore[kidx].clone()
    n = q.shape[0] if tokens is None else tokens
    rotate_all(positions[:n], q[:n], k[:n] if rotate_k else None, d, cos_sin_cache, is_neox, math_dtype=math_dtype)
    if rotate_k:
        k_rows = kstore[kidx].clone()
    else:  # the rotated k computed for the pool only
        k_rows = k_before.clone()
        rotate_all(positions, k_rows, None, d, cos_sin_cache, is_neox, math_dtype=math_dtype)
    if store_before:
        k_rows = k_before
    vstore, vidx = addressed(v.reshape(k.shape) if v.dim() == 2 else v, 1, d)
    v_rows = vstore[vidx].clone()
    if rotate_v:
        rotate_all(positions, v_rows, None, d, cos_sin_cache, is_neox)
    loc = out_loc if loc is None else loc
    kc, vc = (v_cache, k_cache) if swap else (k_cache, v_cache)
    write(kc, k_rows[:n], loc[:n], row_stride)
    write(vc, v_rows[:n], loc[:n], row_stride)


def correct(*args, **kw):
    run(*args, **kw)


def k_not_written_back(*args, **kw):
    """The rotated k stored in k_cache but not written back to k (sglang #19636)."""
    run(*args, rotate_k=False, **kw)


def v_rotated(*args, **kw):
    """v rotated as k is before it is stored."""
    run(*args, rotate_v=True, **kw)


def positions_as_locations(*args, **kw):
    """Each token stored at its position's row (out_loc ignored)."""
    run(*args, loc=args[6], **kw)


def pool_rows_as_contiguous(*args, **kw):
    """The pools addressed with a row stride of hk * d (a padded pool's stride ignored)."""
    run(*args, row_stride=args[1].shape[1] * args[1].shape[2], **kw)


def caches_swapped(*args, **kw):
    """k stored in v_cache and v in k_cache."""
    run(*args, swap=True, **kw)


def last_token_dropped(*args, **kw):
    """A grid of T - 1 programs: the last token neither rotated nor stored."""
    run(*args, tokens=max(args[0].shape[0] - 1, 0), **kw)


def unrotated_k_stored(*args, **kw):
    """The pool written from k before the rotation."""
    run(*args, store_before=True, **kw)


def math_depends_on_batch(*args, **kw):
    """A single token computes in float64, more in float32 (a kernel picking its path by the token count, as decode
    and prefill paths do): each result within one rounding, but a token's rotated q and k, and the k its pool row
    holds, depend on what else is in the call."""
    run(*args, math_dtype=torch.float64 if args[0].shape[0] == 1 else torch.float32, **kw)


CORRECT = correct
BUGS = {
    "k_not_written_back": (k_not_written_back, ("forward", "equals_rope_then_write")),
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "v_rotated": (v_rotated, ("forward", "equals_rope_then_write")),
    "positions_as_locations": (positions_as_locations, ("forward",)),
    "pool_rows_as_contiguous": (pool_rows_as_contiguous, ("forward",)),
    "caches_swapped": (caches_swapped, ("forward", "equals_rope_then_write")),
    "last_token_dropped": (last_token_dropped, ("forward", "equals_rope_then_write")),
    "unrotated_k_stored": (unrotated_k_stored, ("forward", "equals_rope_then_write")),
}
