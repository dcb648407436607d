"""RoPE fused with the KV-cache write, SGLang's flat token pool (its `apply_rope_inplace_with_kvcache`):
    apply_rope_inplace_with_kvcache(q, k, v, k_cache, v_cache, cos_sin_cache, positions, out_loc, *, is_neox,
                                    rope_dim=0) -> None
q [T, hq, d], k and v [T, hk, d] (v also [T, hk * d]; views: head slices of one packed qkv); k_cache, v_cache
[pool_size, hk * d] or [pool_size, hk, d] in q's dtype (any row stride); positions and out_loc [T] int64 (or int32),
out_loc a distinct pool row per token. q and k are rotated IN PLACE at their rows of cos_sin_cache [max_position,
rot] (cos half, sin half; rope_dim 0 or rot), the rotated k and v (as given) stored at row out_loc[t] of the pools;
nothing else in the pools changes. Inference only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

from ..tensors import DTYPES, Layout, contiguous, seeds
from . import Case, domains, small
from . import kv_cache_common as kvc
from .kv_cache_invariants import INVARIANTS


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    table_dtype: torch.dtype
    index_dtypes: tuple  # (positions, out_loc)
    t: int
    hq: int
    hk: int
    d: int
    rot: int
    rows: int
    is_neox: bool
    packed: bool  # q, k, v head slices of one qkv buffer
    qkv_layout: Layout
    v_flat: bool  # v as [T, hk * d]
    pool: int
    pool_flat: bool  # pools [pool, hk * d], else [pool, hk, d]
    pool_pad: int  # extra elements per pool row (a strided view)
    fp8: bool = False
    scales: tuple = (1.0, 1.0)
    n_padded: int = 0
    explicit_defaults: bool = False  # optional arguments passed where they hold their defaults
    rope_dim_given: bool = False  # rope_dim passed as the rotary width (the cache's), not its default 0

    @property
    def n_given(self) -> int:
        return self.t

    @property
    def n_slots(self) -> int:
        return self.pool


class SGLangCache(kvc.KVCacheConvention):
    NAME = "sglang-cache"
    SIGNATURE = ("q", "k", "v", "k_cache", "v_cache", "cos_sin_cache", "positions", "out_loc", "is_neox",
                 "rope_dim")
    DIFFERENTIABLE = ()
    ARGS = dict(q="q", k="k", v="v", kc="k_cache", vc="v_cache", slots="out_loc")
    CAPS = {
        "dtypes": (DTYPES, "dtypes of q, k, v and the pools"),
        "table_dtypes": ("any", "cos_sin_cache's dtype: 'any' float dtype, or 'float32' (SGLang's)"),
        "gqa": (True, "fewer k/v heads than q heads"),
        "partial": (True, "rot < head_dim (channels past it untouched in q and k, stored in the pool)"),
        "is_neox": ((True, False), "the pairings"),
        "strides": (True, "q, k, v head slices of one packed qkv with padded rows; pools with padded rows"),
        "pool_forms": (True, "pools [pool, hk, d] as well as [pool, hk * d], v as [T, hk * d] too"),
        "int32_indices": (True, "int32 positions and out_loc as well as int64"),
        "accuracy": ("float32", "accuracy model (accuracy.py)"),
        "empty": (True, "no tokens: T = 0 (q, k, v, positions and out_loc without elements)"),
    }
    OPTIONAL = {"rope_dim": 0}

    def plans(self, caps):
        lim = dict(t=5, h=3, rows=8, pool=6, dims=(2, 4, 6, 7, 8, 16)) if small() else \
            dict(t=1024, h=17, rows=8192, pool=4096, dims=(2, 64, 80, 128, 256))

        @st.composite
        def draw(draw):
            # on the device, a decode batch of 1, 3 or 8 tokens half the time, else up to 1024 (a prefill chunk)
            t = draw(st.integers(1, lim["t"]) if small() else st.sampled_from((1, 3, 8)) | st.integers(1, lim["t"]))
            hk = draw(st.integers(1, lim["h"]))
            d = draw(st.sampled_from(lim["dims"]))
            rot = 2 * draw(st.integers(1, d // 2)) if caps["partial"] and draw(st.booleans()) else d - d % 2
            strides, forms = caps["strides"], caps["pool_forms"]
            packed = strides and draw(st.booleans())
            table = caps["table_dtypes"]
            return Plan(
                draw(seeds()), draw(st.sampled_from(caps["dtypes"])),
                draw(st.sampled_from(DTYPES)) if table == "any" else torch.float32,
                tuple(draw(st.sampled_from((torch.int64, torch.int32))) if caps["int32_indices"] else torch.int64
                      for _ in "po"),
                t, hk * draw(st.integers(1, 4)) if caps["gqa"] else hk, hk, d, rot, draw(st.integers(1, lim["rows"])),
                draw(st.sampled_from(caps["is_neox"])), packed,
                Layout((0, 1, 2), (0, draw(st.sampled_from((0, 1, 4))), 0)) if packed else contiguous(3),
                forms and draw(st.booleans()), t + draw(st.integers(0, lim["pool"])), forms and draw(st.booleans()),
                draw(st.sampled_from((0, 0, 3))) if strides else 0, rope_dim_given=draw(st.booleans()))

        return domains.with_explicit(domains.with_empty(draw(), caps, domains.zeroed, ("t",)), caps)

    def with_tokens(self, p: Plan, t: int) -> Plan:
        return p._replace(t=t, pool=p.pool + t - p.t)

    def build(self, p: Plan, arena) -> Case:
        positions = arena.place(arena.integers(0, p.rows, (p.t,), p.index_dtypes[0]))
        theta = arena.angles((p.rows, p.rot // 2))
        table = arena.place(torch.cat([theta.cos(), theta.sin()], dim=-1).to(p.table_dtype))
        if p.packed:
            qkv = arena.randn((p.t, p.hq + 2 * p.hk, p.d), p.dtype, p.qkv_layout)
            q, k, v = qkv[:, :p.hq], qkv[:, p.hq:p.hq + p.hk], qkv[:, p.hq + p.hk:]
        else:
            q, k, v = (arena.randn((p.t, h, p.d), p.dtype) for h in (p.hq, p.hk, p.hk))
        if p.v_flat:
            v = v.flatten(1) if v.is_contiguous() else v.reshape(p.t, p.hk * p.d)
        width = p.hk * p.d

        def pool():
            buf = arena.randn((p.pool, width + p.pool_pad), p.dtype)[:, :width]
            return buf if p.pool_flat else buf.unflatten(1, (p.hk, p.d))

        k_cache, v_cache = pool(), pool()
        out_loc = arena.place(kvc.slots_for(arena.gen, p.t, p.pool, 0, p.index_dtypes[1]))
        args = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, cos_sin_cache=table, positions=positions,
                    out_loc=out_loc, is_neox=p.is_neox, rope_dim=p.rot if p.rope_dim_given else 0)
        return Case(p, args, 8, arena.buffers)


SGLangCache.INVARIANTS = INVARIANTS
CONVENTION = SGLangCache()


def _pool_domain() -> tuple:
    return (domains.cls("[pool, hk * d]", lambda p, c: p.pool_flat),
            domains.cls("[pool, hk, d]", lambda p, c: not p.pool_flat, "pool_forms"),
            domains.cls("dense rows", lambda p, c: p.pool_pad == 0),
            domains.cls("padded rows", lambda p, c: p.pool_pad > 0, "strides"))


SGLangCache.DOMAIN = {
    "q": (*domains.dtypes(lambda p: p.dtype), domains.cls("its own buffer", lambda p, c: not p.packed),
          domains.cls("a head slice of a packed qkv", lambda p, c: p.packed, "strides"),
          *domains.sizes(lambda p: p.t, "empty", "tokens")),
    "k": domains.head_counts(lambda p: (p.hq, p.hk)),
    "v": (domains.cls("[T, hk, d]", lambda p, c: not p.v_flat),
          domains.cls("[T, hk * d]", lambda p, c: p.v_flat, "pool_forms")),
    "k_cache": _pool_domain(),
    "v_cache": _pool_domain(),
    "cos_sin_cache": (*domains.cache_dtype_classes(lambda p: (p.dtype, p.table_dtype),
                                                   lambda caps: caps["table_dtypes"] == "any"),
                      *domains.widths(lambda p: (p.rot, p.d))),
    "positions": domains.index_dtypes(lambda p: p.index_dtypes[0], "int32_indices"),
    "out_loc": domains.index_dtypes(lambda p: p.index_dtypes[1], "int32_indices"),
    "is_neox": domains.flags(lambda p: p.is_neox, (True, False), ("half-split (True)", "interleaved (False)"),
                             allowed=lambda caps: caps["is_neox"]),
    "rope_dim": domains.optional("rope_dim", "the rotary width"),
}
