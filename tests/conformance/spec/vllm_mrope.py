"""vLLM's multimodal RoPE (its `MRotaryEmbedding`), as a function:
    mrotary_embedding(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                      mrope_interleaved=False) -> (query, key)
positions [3, T] int32/int64 (temporal, height, width), or [T] (text: one stream for all three); query
[T, hq * head_size] or [T, hq, head_size], key likewise with its own head count, or None; cos_sin_cache
[max_position, rot]: row p = cos of the rot/2 angles of position p, then their sin, in any float dtype.
Pair i (channels (i, i + rot/2) with is_neox, else (2i, 2i + 1)) takes the cos/sin of column i of the row of
its stream's position: the stream of its section in mrope_section (pairs per stream, summing to rot/2), or with
mrope_interleaved Qwen3-VL's layout (spec/hf_mrope.py). Channels rot.. are left as they are. The result has
query's dtype. vLLM's custom op writes query and key in place and returns them; its `forward_native` returns
new tensors and leaves them alone: capability `in_place` says which a target does. Forward only.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import pairing
from ..compare import assert_bitwise, assert_within
from ..contract import Returned
from ..run import inputs64, make_case
from ..tensors import DTYPES, Layout, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, small
from .hf_mrope import other_sections, sections, select, stream_of_pair


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    tokens: int
    hq: int
    hk: int  # 0: key is None
    head_size: int
    rot: int
    rows: int  # max_position
    is_neox: bool
    mrope_interleaved: bool
    section: tuple
    text: bool  # positions [T] (one stream for all three)
    positions_dtype: torch.dtype
    q_heads_dim: bool  # query as [T, h, d], else [T, h * d]
    k_heads_dim: bool
    q_layout: Layout
    k_layout: Layout
    cache_layout: Layout
    positions_layout: Layout


def head_count(p: Plan, name: str) -> int:
    """query's or key's head count (a reshape to [T, h, d] names it: with T = 0, -1 could be any)."""
    return p.hq if name == "query" else p.hk


class VLLMMRoPE(Convention):
    NAME = "vllm-mrope"
    SIGNATURE = ("positions", "query", "key", "head_size", "cos_sin_cache", "mrope_section", "is_neox",
                 "mrope_interleaved")
    DIFFERENTIABLE = ()
    CAPS = {
        "dtypes": (DTYPES, "dtypes of query and key"),
        "cache_dtypes": ("any", "cos_sin_cache's dtype: 'any' float dtype, or 'query' (query's only)"),
        "gqa": (True, "key with another head count than query"),
        "key_none": (True, "key=None (query alone)"),
        "partial": (True, "a rotary width below head_size"),
        "is_neox": ((True, False), "the pairings: True half-split (i, i + rot/2), False interleaved (2i, 2i + 1)"),
        "mrope_interleaved": ((False, True), "the section layouts: consecutive (Qwen2-VL), interleaved (Qwen3-VL)"),
        "text_positions": (True, "positions [T]: one stream for all three"),
        "heads_dim": (True, "query and key as [T, h, head_size] as well as [T, h * head_size]"),
        "strides": (True, "views: sliced rows, a slice of a wider cache, transposed positions"),
        "int32_positions": (True, "int32 positions as well as int64"),
        "accuracy": ("float32", "accuracy model (accuracy.py): float32 math and one rounding, or dtype math"),
        "in_place": (True, "query and key written and returned as the same objects (vLLM's op); False: new "
                           "tensors returned, query and key untouched (vLLM's forward_native)"),
        "empty": (True, "no tokens: T = 0 (positions [3, 0] or [0], query and key without elements)"),
    }

    def plans(self, caps):
        lim = dict(t=5, h=3, rows=6, dims=(2, 4, 6, 8, 12, 16)) if small() else \
            dict(t=2048, h=16, rows=8192, dims=(2, 6, 64, 80, 128, 256))

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            cache_dtype = draw(st.sampled_from(DTYPES)) if caps["cache_dtypes"] == "any" else dtype
            hq = draw(st.integers(1, lim["h"]))
            key_none = caps["key_none"] and draw(st.integers(0, 3)) == 0
            hk = 0 if key_none else draw(st.integers(1, hq)) if caps["gqa"] else hq
            d = draw(st.sampled_from(lim["dims"]))
            rot = 2 * draw(st.integers(1, d // 2)) if caps["partial"] and draw(st.booleans()) else d
            mrope_interleaved = draw(st.sampled_from(caps["mrope_interleaved"]))
            strides = caps["strides"]
            pos_layout = draw(st.one_of(layouts(2), st.just(Layout((1, 0), (0, 0))))) if strides else contiguous(2)
            q_heads_dim, k_heads_dim = (caps["heads_dim"] and draw(st.booleans()) for _ in range(2))

            def layout(heads_dim):  # [T, h, d]: heads may be outermost (a head-major buffer)
                return draw(layouts(3 if heads_dim else 2)) if strides else contiguous(3 if heads_dim else 2)

            return Plan(
                draw(seeds()), dtype, cache_dtype, domains.size(draw, 1, lim["t"], caps["empty"]), hq, hk, d, rot,
                draw(st.integers(1, lim["rows"])), draw(st.sampled_from(caps["is_neox"])), mrope_interleaved,
                draw(sections(rot // 2, mrope_interleaved)),
                caps["text_positions"] and draw(st.integers(0, 3)) == 0,
                draw(st.sampled_from((torch.int64, torch.int32))) if caps["int32_positions"] else torch.int64,
                q_heads_dim, k_heads_dim, layout(q_heads_dim), layout(k_heads_dim),
                draw(layouts(2)) if strides else contiguous(2), pos_layout)

        return draw()

    def build(self, p: Plan, arena) -> Case:
        def tokens(h, heads_dim, layout):
            values = torch.randn((p.tokens, h, p.head_size), generator=arena.gen, dtype=torch.float64).to(p.dtype)
            return arena.place(values if heads_dim else values.reshape(p.tokens, h * p.head_size), layout)

        query = tokens(p.hq, p.q_heads_dim, p.q_layout)
        key = tokens(p.hk, p.k_heads_dim, p.k_layout) if p.hk else None
        theta = arena.angles((p.rows, p.rot // 2))
        cache = arena.place(torch.cat([theta.cos(), theta.sin()], dim=-1).to(p.cache_dtype), p.cache_layout)
        shape = (p.tokens,) if p.text else (3, p.tokens)
        layout = Layout((0,), (p.positions_layout.pad[1],)) if p.text else p.positions_layout
        positions = arena.place(arena.integers(0, p.rows, shape, p.positions_dtype), layout)
        args = dict(positions=positions, query=query, key=key, head_size=p.head_size, cos_sin_cache=cache,
                    mrope_section=list(p.section), is_neox=p.is_neox, mrope_interleaved=p.mrope_interleaved)
        return Case(p, args, 6, arena.buffers)

    def effects(self, case):
        """(query, key) returned: in place the arguments themselves, else new tensors; None for a key of None."""
        names = ("query",) if case.args["key"] is None else ("query", "key")
        in_place = case.caps.get("in_place", True)
        returned = tuple(Returned(n, n) if in_place else Returned(n) for n in names)
        return (names if in_place else ()), returned + ((None,) if case.args["key"] is None else ())

    def read(self, case, name, t):
        return t.reshape(case.plan.tokens, head_count(case.plan, name), case.plan.head_size)

    def tables(self, case, x64):
        """Per-channel cos and sin [T, 1, rot] (float64, from the cache as given) at each token's positions."""
        p = case.plan
        half = p.rot // 2
        pos = x64["positions"].expand(3, p.tokens)
        rows = x64["cos_sin_cache"][pos]  # [3, T, rot]
        stream = stream_of_pair(p.section, half, p.mrope_interleaved)
        cos, sin = (select(part, stream) for part in (rows[..., :half], rows[..., half:]))
        return (pairing.per_channel(t, not p.is_neox).unsqueeze(-2) for t in (cos, sin))

    def define(self, case, x64):
        p = case.plan
        cos, sin = self.tables(case, x64)
        out = {}
        for name in ("query", "key"):
            if case.args[name] is not None:
                x = x64[name].reshape(p.tokens, head_count(p, name), p.head_size)
                out[name] = Expect(pairing.rotate(x, cos, sin, not p.is_neox), x, p.rot, not p.is_neox, p.dtype)
        return out


# ---- invariants -------------------------------------------------------------------------------------------------


def fresh(case, **changes):
    """The case with new query and key (copies: an in-place target writes them), some arguments replaced."""
    args = {n: (v.detach().clone() if n in ("query", "key") and v is not None else v) for n, v in case.args.items()}
    return Case(case.plan, {**args, **changes}, case.positional, case.buffers, case.caps)


def results(case, fn):
    """{name: result as [T, h, head_size]} of one call on copies of query and key."""
    with torch.no_grad():
        out = fresh(case).call(fn)
    assert isinstance(out, (tuple, list)) and len(out) == 2, "expected (query, key)"
    return {n: CONVENTION.read(case, n, t) for n, t in zip(("query", "key"), out, strict=True) if t is not None}


def text_positions(conv, fn, caps, plan):
    """positions [T] equal [3, T] with three equal rows, bitwise."""
    if not caps["text_positions"]:
        return
    case = make_case(conv, caps, plan)
    pos = case.args["positions"]
    one = pos if pos.dim() == 1 else pos[0]
    a = results(fresh(case, positions=one.contiguous()), fn)
    b = results(fresh(case, positions=one.expand(3, -1).contiguous()), fn)
    for n in a:
        assert_bitwise(f"positions [T] vs [3, T] of equal rows: {n}", a[n], b[n])


def equal_streams(conv, fn, caps, plan):
    """Three equal position streams: any section split gives the same result, bitwise, and it is plain RoPE
    (vLLM's `rotary_embedding`) at those positions."""
    case = make_case(conv, caps, plan)
    p = case.plan
    pos = case.args["positions"]
    equal = (pos if pos.dim() == 1 else pos[0]).expand(3, -1).contiguous()
    base = fresh(case, positions=equal)
    got = results(base, fn)
    other = list(other_sections(p.section, p.mrope_interleaved))
    again = results(fresh(base, mrope_section=other), fn)
    x64 = inputs64(base)
    half = p.rot // 2
    rows = x64["cos_sin_cache"][x64["positions"][0]]
    cos, sin = (pairing.per_channel(t, not p.is_neox).unsqueeze(-2) for t in (rows[..., :half], rows[..., half:]))
    for n in got:
        assert_bitwise(f"equal streams, sections {list(p.section)} vs {other}: {n}", again[n], got[n])
        x = x64[n].reshape(p.tokens, head_count(p, n), p.head_size)
        assert_within(f"equal streams vs plain RoPE: {n}", got[n], pairing.rotate(x, cos, sin, not p.is_neox), x,
                      p.rot, not p.is_neox, 1, caps.get("accuracy", "float32"))


def key_none(conv, fn, caps, plan):
    """key=None rotates query as the call with a key does (bitwise); the key's result does not depend on query."""
    case = make_case(conv, caps, plan)
    if case.args["key"] is None or not caps["key_none"]:
        return
    both = results(case, fn)
    alone = results(fresh(case, key=None), fn)
    assert_bitwise("query with key=None vs with a key", alone["query"], both["query"])
    other = torch.randn(case.args["query"].shape, generator=torch.Generator().manual_seed(plan.seed + 5))
    moved = results(fresh(case, query=other.to(case.args["query"].dtype).to(case.args["query"].device)), fn)
    assert_bitwise("key independent of query", moved["key"], both["key"])


def is_neox_equivalent(conv, fn, caps, plan):
    """is_neox=False on channels rearranged (2i, 2i + 1) <- (i, i + rot/2) equals is_neox=True, rearranged
    alike, bitwise: the pairing flag moves channels, nothing else."""
    if set(caps["is_neox"]) != {True, False}:
        return
    case = make_case(conv, caps, plan)
    p = case.plan
    half = p.rot // 2
    neox = torch.cat([torch.arange(0, p.rot, 2), torch.arange(1, p.rot, 2), torch.arange(p.rot, p.head_size)])
    to_gptj = torch.argsort(neox)  # channel c of the GPT-J form is channel neox-order index of the NeoX form

    def arranged(n, x, order):  # [T, h * d] or [T, h, d] with its channels in `order`, in x's own form
        heads = x.reshape(p.tokens, head_count(p, n), p.head_size)[..., order.to(x.device)]
        return heads.reshape(x.shape).contiguous()

    base = fresh(case, is_neox=True)
    neox_out = results(base, fn)
    gptj = {n: arranged(n, case.args[n], to_gptj) for n in ("query", "key") if case.args[n] is not None}
    gptj_out = results(fresh(base, is_neox=False, **gptj), fn)
    for n in neox_out:
        assert_bitwise(f"is_neox=False on rearranged channels (rot {p.rot} of {p.head_size}, {half} pairs): {n}",
                    gptj_out[n][..., neox.to(gptj_out[n].device)], neox_out[n])


def inverse(conv, fn, caps, plan):
    """The call with the cache's sin negated, on the call's result, gives query and key back within three
    roundings of the float64 composition (scaled by cos^2 + sin^2 of the cache as rounded)."""
    case = make_case(conv, caps, plan)
    p = case.plan
    cache = case.args["cos_sin_cache"]
    flipped = torch.cat([cache[:, :p.rot // 2], -cache[:, p.rot // 2:]], dim=-1)
    there = results(case, fn)
    back = fresh(case, cos_sin_cache=flipped,
                 **{n: there[n].reshape(case.args[n].shape) for n in there})
    again = results(back, fn)
    x64 = inputs64(case)
    ref = conv.define(case, x64)
    composed = conv.define(back, {**x64, "cos_sin_cache": flipped.double().cpu(),
                                  **{n: ref[n].value.reshape(x64[n].shape) for n in ref}})
    for n in again:
        assert_within(f"inverse: {n}", again[n], composed[n].value, ref[n].source, p.rot, not p.is_neox, 3, "dtype")


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise, forward (the convention has no backward): each token called alone (its own query and
    key rows, its positions [3, 1] or [1]) and the tokens rolled by one with their positions give bitwise the token's
    results in the whole call (vLLM packs the sequences of a step into one call: what one returns must not depend on
    the others). At least two tokens."""
    case = make_case(conv, caps, plan._replace(tokens=max(plan.tokens, 2)))
    tokens = case.plan.tokens
    per_token = [n for n in ("query", "key") if case.args[n] is not None]

    def run(take):
        """{name: result as [T, h, head_size]} of one call on take(x, dim) of query and key (dim 0) and positions
        (its last dim)."""
        rows = {n: take(case.args[n], 0) for n in per_token}
        positions = take(case.args["positions"], -1)
        one = dataclasses.replace(case, plan=case.plan._replace(tokens=positions.shape[-1]),
                                  args={**case.args, **rows, "positions": positions})
        return results(one, fn)

    whole = run(lambda x, dim: x)
    for i in sorted({0, tokens - 1, plan.seed % tokens}):
        alone = run(lambda x, dim, i=i: x.narrow(dim, i, 1).clone())
        for n in per_token:
            assert_bitwise(f"batch invariance: {n} of token {i} alone, against among {tokens}", alone[n][0],
                           whole[n][i])
    rolled = run(lambda x, dim: torch.roll(x, 1, dim))
    for n in per_token:
        assert_bitwise(f"batch invariance: {n} with the tokens rolled by one, against the whole call's rolled",
                       rolled[n], torch.roll(whole[n], 1, 0))


CONVENTION = VLLMMRoPE()
VLLMMRoPE.INVARIANTS = {"batch_rows_alone": batch_rows_alone,
                        "text_positions": text_positions, "equal_streams": equal_streams, "key_none": key_none,
                        "is_neox": is_neox_equivalent, "inverse": inverse}


VLLMMRoPE.DOMAIN = {
    "positions": (*domains.index_dtypes(lambda p: p.positions_dtype, "int32_positions"),
                  domains.cls("[3, T]", lambda p, c: not p.text),
                  domains.cls("[T] (text)", lambda p, c: p.text, "text_positions"),
                  *domains.layouts("positions"),
                  *domains.sizes(lambda p: p.tokens, "empty", "tokens")),
    "query": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("query"),
              domains.cls("[T, h, head_size]", lambda p, c: p.q_heads_dim, "heads_dim"),
              domains.cls("[T, h * head_size]", lambda p, c: not p.q_heads_dim)),
    "key": (*domains.head_counts(lambda p: (p.hq, p.hk), none=lambda p: p.hk == 0, none_cap="key_none"),
            *domains.layouts("key")),
    "head_size": domains.sizes(lambda p: p.head_size, "", empty=False, one=False),
    "cos_sin_cache": (*domains.cache_dtype_classes(lambda p: (p.dtype, p.cache_dtype),
                                                   lambda caps: caps["cache_dtypes"] == "any"),
                      *domains.layouts("cos_sin_cache"),
                      *domains.widths(lambda p: (p.rot, p.head_size))),
    "mrope_section": (domains.cls("every stream a section", lambda p, c: all(p.section)),
                      domains.cls("a stream with no pairs", lambda p, c: not all(p.section))),
    "is_neox": domains.flags(lambda p: p.is_neox, (True, False), ("half-split (True)", "interleaved (False)"),
                             allowed=lambda caps: caps["is_neox"]),
    "mrope_interleaved": domains.flags(lambda p: p.mrope_interleaved, allowed=lambda caps: caps["mrope_interleaved"]),
}
