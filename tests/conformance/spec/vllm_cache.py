"""RoPE fused with the KV-cache write, vLLM's form (its `rotary_embedding` then `reshape_and_cache_flash`):
    rope_and_cache(positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox,
                   kv_cache_dtype="auto", k_scale=None, v_scale=None) -> None
positions [T] int64 (or int32); query [T, hq * d] or [T, hq, d], key and value [T, hk(, d)] (views: head slices of
one packed qkv); key_cache, value_cache [num_blocks, block_size, hk, d], any strides (vLLM's packed layout [nb, hk,
bs, 2d] transposed, FlashAttention's [nb, 2, bs, hk, d] unbound: views of one buffer); slot_mapping [<= T] int64
(or int32), slot = block * block_size + offset. query and key are rotated IN PLACE at their rows of cos_sin_cache
[max_position, rot] (cos half, then sin half; is_neox: pairs (i, i + rot/2), else (2i, 2i + 1); channels rot.. d
untouched); token t with slot_mapping[t] >= 0 has the rotated key and the value (as given) stored at its slot, a
token with -1 or past a short slot_mapping is rotated and not stored; nothing else in the caches changes.
kv_cache_dtype "auto": the caches hold the model's dtype (v bit for bit); "fp8": float8_e4m3fn, x / scale
(kv_cache_common.py). Inference only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

from ..tensors import DTYPES, Layout, contiguous, layouts, seeds
from . import Case, domains, small
from . import kv_cache_common as kvc
from .kv_cache_invariants import INVARIANTS


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    fp8: bool
    table_dtype: torch.dtype
    index_dtypes: tuple  # (positions, slot_mapping)
    t: int
    hq: int
    hk: int
    d: int
    rot: int
    rows: int
    is_neox: bool
    heads_dim: bool  # query, key, value as [T, h, d], else [T, h * d]
    packed: bool  # query, key, value head slices of one qkv buffer [T, hq + 2 hk, d]
    qkv_layout: Layout
    n_blocks: int
    block_size: int
    cache_layout: str  # "nhd" (own buffers, maybe strided), "packed" [nb, hk, bs, 2d], "flash" [nb, 2, bs, hk, d]
    nhd_layout: Layout
    n_given: int  # slot_mapping's length (<= t)
    n_padded: int  # of them -1
    scales: tuple  # (k_scale, v_scale), fp8 only
    explicit_defaults: bool = False  # optional arguments passed where they hold their defaults

    @property
    def n_slots(self) -> int:
        return self.n_blocks * self.block_size


def no_tokens(plan, names):
    """The plan with T = 0 (with_empty): no slot given, none padded."""
    return plan._replace(t=0, n_given=0, n_padded=0)


class VLLMCache(kvc.KVCacheConvention):
    NAME = "vllm-cache"
    SIGNATURE = ("positions", "query", "key", "value", "key_cache", "value_cache", "slot_mapping", "cos_sin_cache",
                 "is_neox", "kv_cache_dtype", "k_scale", "v_scale")
    DIFFERENTIABLE = ()
    ARGS = dict(q="query", k="key", v="value", kc="key_cache", vc="value_cache", slots="slot_mapping")
    CAPS = {
        "dtypes": (DTYPES, "dtypes of query, key and value"),
        "fp8": (True, "kv_cache_dtype 'fp8' (float8_e4m3fn caches, per-tensor float32 scales) as well as 'auto'"),
        "table_dtypes": ("any", "cos_sin_cache's dtype: 'any' float dtype, or 'query'"),
        "gqa": (True, "fewer key/value heads than query heads"),
        "partial": (True, "rot < head size (channels past it untouched in q and k, stored in the cache)"),
        "is_neox": ((True, False), "the pairings"),
        "heads_dim": (True, "query, key, value as [T, h, d] as well as [T, h * d]"),
        "strides": (True, "query, key, value as head slices of one packed qkv, with padded rows"),
        "cache_layouts": (("nhd", "packed", "flash"), "the caches' layouts: own buffers (padded or permuted views "
                          "too), vLLM's packed [nb, hk, bs, 2d], FlashAttention's [nb, 2, bs, hk, d]"),
        "short_slot_mapping": (True, "slot_mapping shorter than the tokens (the rest rotated, not stored)"),
        "padded_slots": (True, "slot -1 (rotated, not stored)"),
        "int32_indices": (True, "int32 positions and slot_mapping as well as int64"),
        "accuracy": ("float32", "accuracy model (accuracy.py)"),
        "npot_block_size": (True, "a block_size that is not a power of two (the caches' block dim: 3, 24)"),
        "empty": (True, "no tokens: T = 0 (positions, query, key, value and slot_mapping without elements)"),
    }
    OPTIONAL = {"kv_cache_dtype": "auto", "k_scale": None, "v_scale": None}

    def plans(self, caps):
        lim = dict(t=5, h=3, rows=8, blocks=4, bs=(1, 2, 4), npot=(3,), dims=(2, 4, 6, 7, 8, 16)) if small() else \
            dict(t=1024, h=17, rows=8192, blocks=64, bs=(1, 16, 32), npot=(24,), dims=(2, 64, 80, 128, 256))

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            decode = draw(st.booleans())  # one token per sequence (s = 1), or a prefill chunk
            t = draw(st.integers(1, lim["t"] if not decode or small() else 256))
            hk = draw(st.integers(1, lim["h"]))
            hq = hk * draw(st.integers(1, 4)) if caps["gqa"] else hk
            d = draw(st.sampled_from(lim["dims"]))
            rot = 2 * draw(st.integers(1, d // 2)) if caps["partial"] and draw(st.booleans()) else d - d % 2
            bs = draw(st.sampled_from(lim["npot"] * caps["npot_block_size"] + lim["bs"]))
            n_blocks = -(-t // bs) + draw(st.integers(0, lim["blocks"]))
            n_given = draw(st.integers(0, t)) if caps["short_slot_mapping"] and draw(st.booleans()) else t
            n_padded = draw(st.integers(0, n_given)) if caps["padded_slots"] and draw(st.booleans()) else 0
            fp8 = caps["fp8"] and draw(st.integers(0, 2)) == 0
            packed = caps["strides"] and draw(st.booleans())
            int32 = caps["int32_indices"]
            return Plan(
                draw(seeds()), dtype, fp8,
                draw(st.sampled_from(DTYPES)) if caps["table_dtypes"] == "any" else dtype,
                tuple(draw(st.sampled_from((torch.int64, torch.int32))) if int32 else torch.int64 for _ in "ps"),
                t, hq, hk, d, rot, draw(st.integers(1, lim["rows"])), draw(st.sampled_from(caps["is_neox"])),
                caps["heads_dim"] and draw(st.booleans()), packed,
                Layout((0, 1, 2), (0, draw(st.sampled_from((0, 1, 4))), 0)) if packed else contiguous(3),
                n_blocks, bs, draw(st.sampled_from(caps["cache_layouts"])), draw(layouts(4)), n_given, n_padded,
                (draw(st.sampled_from(kvc.SCALES)), draw(st.sampled_from(kvc.SCALES))) if fp8 else (1.0, 1.0))

        return domains.with_explicit(domains.with_empty(draw(), caps, no_tokens, ("t",)), caps)

    def with_tokens(self, p: Plan, t: int) -> Plan:
        n_given = p.n_given + t - p.t
        return p._replace(t=t, n_given=n_given, n_blocks=max(p.n_blocks, -(-n_given // p.block_size)))

    def build(self, p: Plan, arena) -> Case:
        positions = arena.place(arena.integers(0, p.rows, (p.t,), p.index_dtypes[0]))
        theta = arena.angles((p.rows, p.rot // 2))
        table = arena.place(torch.cat([theta.cos(), theta.sin()], dim=-1).to(p.table_dtype))

        def form(x):
            return x if p.heads_dim else x.flatten(-2)

        if p.packed:
            qkv = arena.randn((p.t, p.hq + 2 * p.hk, p.d), p.dtype, p.qkv_layout)
            query, key, value = (form(qkv[:, a:b]) for a, b in ((0, p.hq), (p.hq, p.hq + p.hk),
                                                                (p.hq + p.hk, p.hq + 2 * p.hk)))
        else:
            query, key, value = (arena.place(form(torch.randn((p.t, h, p.d), generator=arena.gen,
                                                              dtype=torch.float64).to(p.dtype)))
                                 for h in (p.hq, p.hk, p.hk))
        cdt = kvc.FP8 if p.fp8 else p.dtype
        nb, bs, hk, d = p.n_blocks, p.block_size, p.hk, p.d
        if p.cache_layout == "packed":
            kv = arena.randn((nb, hk, bs, 2 * d), cdt)
            key_cache, value_cache = kv[..., :d].transpose(1, 2), kv[..., d:].transpose(1, 2)
        elif p.cache_layout == "flash":
            key_cache, value_cache = arena.randn((nb, 2, bs, hk, d), cdt).unbind(1)
        else:
            key_cache, value_cache = (arena.randn((nb, bs, hk, d), cdt, p.nhd_layout) for _ in range(2))
        slots = arena.place(kvc.slots_for(arena.gen, p.n_given, p.n_slots, p.n_padded, p.index_dtypes[1]))
        scales = [arena.place(torch.tensor([s], dtype=torch.float32)) for s in p.scales] if p.fp8 else [None, None]
        args = dict(positions=positions, query=query, key=key, value=value, key_cache=key_cache,
                    value_cache=value_cache, slot_mapping=slots, cos_sin_cache=table, is_neox=p.is_neox,
                    kv_cache_dtype="fp8" if p.fp8 else "auto", k_scale=scales[0], v_scale=scales[1])
        return Case(p, args, 9, arena.buffers)


VLLMCache.INVARIANTS = INVARIANTS
CONVENTION = VLLMCache()


def _cache_domain() -> tuple:
    return (domains.cls("the inputs' dtype ('auto')", lambda p, c: not p.fp8),
            domains.cls("float8_e4m3fn ('fp8')", lambda p, c: p.fp8, "fp8"),
            *domains.flags(lambda p: p.cache_layout, ("nhd", "packed", "flash"),
                           ("[nb, bs, hk, d], its own buffer", "vLLM's packed [nb, hk, bs, 2d]",
                            "FlashAttention's [nb, 2, bs, hk, d]"), allowed=lambda caps: caps["cache_layouts"]),
            *domains.layouts("key_cache"),
            domains.cls("block_size 1", lambda p, c: p.block_size == 1),
            domains.cls("block_size a power of two > 1", lambda p, c: p.block_size > 1 and
                        p.block_size & (p.block_size - 1) == 0),
            domains.cls("block_size not a power of two", lambda p, c: p.block_size & (p.block_size - 1) != 0,
                        "npot_block_size"))


def _tokens_domain() -> tuple:
    return (domains.cls("[T, h, d]", lambda p, c: p.heads_dim, "heads_dim"),
            domains.cls("[T, h * d]", lambda p, c: not p.heads_dim),
            domains.cls("a head slice of a packed qkv", lambda p, c: p.packed, "strides"),
            domains.cls("its own buffer", lambda p, c: not p.packed))


VLLMCache.DOMAIN = {
    "positions": (*domains.index_dtypes(lambda p: p.index_dtypes[0], "int32_indices"),
                  *domains.sizes(lambda p: p.t, "empty", "tokens")),
    "query": (*domains.dtypes(lambda p: p.dtype), *_tokens_domain()),
    "key": domains.head_counts(lambda p: (p.hq, p.hk)),
    "value": (domains.cls("key's form", lambda p, c: True),),
    "key_cache": _cache_domain(),
    "value_cache": (domains.cls("key_cache's layout", lambda p, c: True),),
    "slot_mapping": (*domains.index_dtypes(lambda p: p.index_dtypes[1], "int32_indices"),
                     domains.cls("a slot per token", lambda p, c: p.n_given == p.t),
                     domains.cls("shorter than the tokens", lambda p, c: p.n_given < p.t, "short_slot_mapping"),
                     domains.cls("slots -1 (padding)", lambda p, c: p.n_padded > 0, "padded_slots")),
    "cos_sin_cache": (*domains.cache_dtype_classes(lambda p: (p.dtype, p.table_dtype),
                                                   lambda caps: caps["table_dtypes"] == "any"),
                      *domains.widths(lambda p: (p.rot, p.d))),
    "is_neox": domains.flags(lambda p: p.is_neox, (True, False), ("half-split (True)", "interleaved (False)"),
                             allowed=lambda caps: caps["is_neox"]),
    "kv_cache_dtype": domains.optional("kv_cache_dtype", "'fp8'", "fp8"),
    "k_scale": domains.optional("k_scale", "a float32 tensor", "fp8"),
    "v_scale": domains.optional("v_scale", "a float32 tensor", "fp8"),
}
