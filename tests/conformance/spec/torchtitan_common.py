"""torchtitan's two RoPE conventions, what they share (torchtitan/models/common/rope.py at pytorch/torchtitan
b5bcd76c66d0acb1a08b176d9639425bc55e0b2a; spec/torchtitan_complex.py, spec/torchtitan_cossin.py):
    fn(query, key, cache, positions=None) -> (query_out, key_out)        RoPE.forward, the module's cache passed in
query [T, N, H], key [T, Nk, H], tokens first (the batch folded into T); cache [rows, width], one row per position;
token t reads row positions[t] ([T] int32/int64), or row t without positions. The result is float32 math on
query.float(), rounded once to each input's dtype (type_as). New tensors; the gradient flows to query and key.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import pairing
from ..compare import assert_bitwise, assert_undone, assert_within
from ..contract import Returned
from ..run import make_case
from ..tensors import DTYPES, Layout, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, small


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    table_dtype: torch.dtype  # the cache's real dtype (complex64's parts: float32)
    t: int
    n: int
    nk: int
    h: int
    rows: int
    positions: bool  # positions given (else omitted: token t reads row t)
    pos_dtype: torch.dtype
    equal_halves: bool  # cos/sin halves equal, as torchtitan builds them (cos/sin cache only)
    q_layout: Layout
    k_layout: Layout
    cache_layout: Layout
    pos_layout: Layout
    explicit_defaults: bool = False  # optional arguments passed where they hold their defaults


def limits():
    if small():
        return dict(t=6, h=(1, 2, 3), dims=(2, 4, 6, 10, 16), extra=3)
    return dict(t=2048, h=(1, 2, 8, 17, 32), dims=(2, 64, 80, 128, 256), extra=64)


class TorchTitan(Convention):
    SIGNATURE = ("query", "key", "cache", "positions")
    DIFFERENTIABLE = ("query", "key")
    INTERLEAVED = True
    CAPS = {
        "dtypes": (DTYPES, "dtypes of query and key"),
        "gqa": (True, "key with another head count than query"),
        "positions": (True, "positions [T] gathering a row per token (else tokens read rows 0 .. T-1)"),
        "int32_positions": (True, "positions as int32 as well as int64"),
        "strides": (True, "views: query, key permuted and padded; cache and positions sliced from wider buffers"),
        "backward": (True, "gradients for query and key"),
        "accuracy": ("float32", "accuracy model (accuracy.py): float32 math and one rounding, or dtype math"),
        "empty": (True, "T = 0: empty query and key"),
    }
    OPTIONAL = {"positions": None}

    def table_dtypes(self, caps, dtype):
        return (torch.float32,)

    def plans(self, caps):
        lim = limits()

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            n = draw(st.sampled_from(lim["h"]))
            nk = draw(st.sampled_from([h for h in lim["h"] if h <= n])) if caps["gqa"] else n
            t = draw(domains.lengths((1, 3, 2, 1, lim["t"] - 1, lim["t"]), caps["empty"], lim["t"], small()))
            positions = draw(st.booleans()) if caps["positions"] else False
            rows = draw(st.integers(1, t + lim["extra"])) if positions else t + draw(st.sampled_from((0, 0, 1, 3)))
            strides = caps["strides"]
            return Plan(
                draw(seeds()), dtype, draw(st.sampled_from(self.table_dtypes(caps, dtype))), t, n, nk,
                draw(st.sampled_from(lim["dims"])), rows, positions,
                draw(st.sampled_from((torch.int32, torch.int64) if caps["int32_positions"] else (torch.int64,))),
                draw(st.booleans()) if caps.get("elementwise_tables") else True,
                draw(layouts(3)) if strides else contiguous(3), draw(layouts(3)) if strides else contiguous(3),
                draw(layouts(2)) if strides else contiguous(2),
                draw(layouts(1, spaced=True)) if strides else contiguous(1))

        return domains.with_explicit(draw(), caps)

    def build(self, p: Plan, arena) -> Case:
        query = arena.randn((p.t, p.n, p.h), p.dtype, p.q_layout)
        key = arena.randn((p.t, p.nk, p.h), p.dtype, p.k_layout)
        args = dict(query=query, key=key, cache=self.cache(arena, p))
        if p.positions:
            args["positions"] = arena.place(arena.integers(0, p.rows, (p.t,), p.pos_dtype), p.pos_layout)
        return self.case(p, args, arena)

    def cache(self, arena, p: Plan) -> torch.Tensor:
        raise NotImplementedError

    def case(self, p, args, arena) -> Case:
        return Case(p, args, 3, arena.buffers)

    def tables64(self, cache64) -> tuple:
        """The cache as given (float64) -> per-channel cos, sin [rows, H]."""
        raise NotImplementedError

    def effects(self, case):
        return (), (Returned("query"), Returned("key"))

    def define(self, case, x64):
        t = case.plan.t
        rows = x64["positions"] if "positions" in x64 else torch.arange(t)
        cos, sin = (tab[rows].unsqueeze(-2) for tab in self.tables64(x64["cache"]))
        return {n: Expect(pairing.rotate(x64[n], cos, sin, self.INTERLEAVED), x64[n], case.plan.h, self.INTERLEAVED,
                          case.plan.dtype) for n in ("query", "key")}

    def inverse_cache(self, cache):
        """The cache whose rows undo the cache's (conj(cache), or cat(cos, -sin)), as the call receives it."""
        raise NotImplementedError


# ---- the conventions' own invariants ---------------------------------------------------------------------


def call(fn, case, drop=(), **overrides):
    args = {n: v for n, v in {**case.args, **overrides}.items() if n not in drop}
    with torch.no_grad():
        return replace(case, args=args).call(fn)


def _close(conv, caps, what, got, want, case):
    for name, g, w in zip(("query", "key"), got, want, strict=True):
        assert_within(f"{what}: {name}", g, w, w, case.plan.h, conv.INTERLEAVED, 2, caps.get("accuracy", "float32"))


def positions_gather(conv, fn, caps, plan):
    """positions read the rows cache[positions]: the call equals the call without positions on those rows,
    gathered (within two roundings: a kernel may contract the products differently in either mode)."""
    if not caps["positions"]:
        return
    case = make_case(conv, caps, plan._replace(positions=True, rows=max(plan.rows, 1)))
    want = call(fn, case)
    gathered = case.args["cache"][case.args["positions"].long()]
    _close(conv, caps, "positions against cache[positions] without them", call(fn, case, drop=("positions",),
                                                                                   cache=gathered), want, case)


def arange_positions(conv, fn, caps, plan):
    """positions = arange(T) equals positions omitted (token t reads row t), within two roundings."""
    if not caps["positions"]:
        return
    case = make_case(conv, caps, plan._replace(positions=False, rows=max(plan.rows, plan.t)))
    want = call(fn, case)
    pos = torch.arange(plan.t, dtype=plan.pos_dtype, device=case.args["query"].device)
    _close(conv, caps, "positions = arange(T) against none", call(fn, case, positions=pos), want, case)


def tokens_independent(conv, fn, caps, plan):
    """Tokens are independent: the call on tokens a .. T-1 (with their positions; without positions, the first
    tokens only, which read the same rows) equals those tokens of the whole call."""
    case = make_case(conv, caps, plan)
    full = call(fn, case)
    a = plan.seed % (plan.t + 1)
    sl = slice(a, plan.t) if plan.positions else slice(0, plan.t - a)
    over = dict(query=case.args["query"][sl], key=case.args["key"][sl])
    if plan.positions:
        over["positions"] = case.args["positions"][sl]
    part = call(fn, case, **over)
    _close(conv, caps, f"tokens {sl.start} .. {sl.stop - 1} alone", part, tuple(x[sl] for x in full), case)


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: each token called alone with its position, and the tokens rolled by one with their
    positions, give bitwise the token's results in the whole call (positions given: without them a token's row is
    its index)."""
    if not caps["positions"]:
        return
    case = make_case(conv, caps, plan._replace(positions=True, t=max(plan.t, 2), rows=max(plan.rows, 1)))
    q, k, pos = case.args["query"], case.args["key"], case.args["positions"]
    full = call(fn, case)
    t = q.shape[0]
    for i in sorted({0, t - 1, plan.seed % t}):
        alone = call(fn, case, query=q[i:i + 1].clone(), key=k[i:i + 1].clone(), positions=pos[i:i + 1].clone())
        for name, a, w in zip(("query", "key"), alone, full, strict=True):
            assert_bitwise(f"batch invariance: {name} of token {i} alone, against among {t}", a[0], w[i])
    rolled = call(fn, case, query=torch.roll(q, 1, 0), key=torch.roll(k, 1, 0), positions=torch.roll(pos, 1, 0))
    for name, r, w in zip(("query", "key"), rolled, full, strict=True):
        assert_bitwise(f"batch invariance: {name} with the tokens rolled by one, against the whole call's rolled", r,
                       torch.roll(w, 1, 0))


def inverse(conv, fn, caps, plan):
    """The call with the inverse cache (conj(cache), or cat(cos, -sin)) on the call's results gives back query and
    key (compare.assert_undone; cos/sin halves equal, so that each pair is rotated)."""
    case = make_case(conv, caps, plan._replace(equal_halves=True))
    once = call(fn, case)
    back = call(fn, case, query=once[0], key=once[1], cache=conv.inverse_cache(case.args["cache"]))
    for name, b in zip(("query", "key"), back, strict=True):
        assert_undone(f"inverse: {name}", b, case.args[name], plan.h, conv.INTERLEAVED, plan.table_dtype,
                      caps.get("accuracy", "float32"))


def swap_q_k(conv, fn, caps, plan):
    """fn(key, query) returns fn(query, key)'s results swapped (equal head counts), within two roundings."""
    case = make_case(conv, caps, plan._replace(nk=plan.n))
    q1, k1 = call(fn, case)
    q2, k2 = call(fn, case, query=case.args["key"], key=case.args["query"])
    _close(conv, caps, "query and key swapped", (k2, q2), (q1, k1), case)


INVARIANTS = {
    "positions_gather": positions_gather,
    "arange_positions": arange_positions,
    "tokens_independent": tokens_independent,
    "inverse": inverse,
    "swap_q_k": swap_q_k,
}


def titan_domain(cache_dtypes: tuple, cache_cap: str = "") -> dict:
    """The domain of torchtitan's two forms; `cache_dtypes`: the cache's classes."""
    return {
        "query": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("query"),
                  *domains.sizes(lambda p: p.t, "empty", "tokens")),
        "key": (*domains.layouts("key"), *domains.head_counts(lambda p: (p.n, p.nk))),
        "cache": (*cache_dtypes, *domains.layouts("cache"),
                  domains.cls("rows past the tokens", lambda p, c: p.rows > p.t)),
        "positions": (*domains.optional("positions", "a tensor [T]", "positions"),
                      *domains.index_dtypes(lambda p: p.pos_dtype, "int32_positions"), domains.spaced("positions")),
    }
