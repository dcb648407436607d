"""vLLM's convention (its custom op `vllm._custom_ops.rotary_embedding`):
    rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False)
        -> None
positions [T] or [b, s], int64 (or int32); query [*positions.shape, hq * head_size] or [*positions.shape, hq,
head_size], key likewise with its own form, strides and head count (GQA: hk divides hq), or None. The tokens of a
[b, s] call are the flattened b * s (vLLM steps through them with one token stride). query and key may be head
slices of one packed qkv buffer. cos_sin_cache [max_position, rot]: row p = cos of the rot / 2 angles of position
p, then their sin (one angle per pair). The rotated channels of each head are rope_dim_offset .. rope_dim_offset +
rot (0 <= rope_dim_offset <= head_size - rot; DeepSeek-V4 passes whole heads with the rope slice last); is_neox:
within that slice half-split pairs (i, i + rot / 2), else interleaved (2i, 2i + 1); every other channel of the head
untouched. inverse: rotation by -theta (sin negated: V4's inverse rotation of the attention output). query and key
are rotated IN PLACE (in their dtype); nothing is returned. Forward only: vLLM serves inference, its op has no
autograd.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import pairing
from ..compare import assert_bitwise, assert_undone, assert_within
from ..run import make_case
from ..tensors import DTYPES, Layout, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, head_and_rotary, small


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    lead: tuple  # positions' shape: (T,) or (b, s)
    positions_dtype: torch.dtype
    hq: int
    hk: int  # 0: key is None
    d: int  # head_size
    rot: int
    rows: int  # max_position
    is_neox: bool
    q_heads_dim: bool  # query as [..., h, d], else [..., h * d]
    k_heads_dim: bool
    packed: bool  # query and key: head slices of one qkv buffer [..., hq + 2 hk, d] (then in one form)
    q_layout: Layout  # query's buffer (the qkv buffer when packed)
    k_layout: Layout
    cache_layout: Layout
    positions_layout: Layout
    offset: int = 0  # rope_dim_offset: the first rotated channel of each head
    inverse: bool = False  # rotation by -theta
    explicit_defaults: bool = False  # rope_dim_offset and inverse passed where they hold their defaults

    @property
    def tokens(self) -> int:
        return int(torch.tensor(self.lead).prod())


def slice_first(p: Plan) -> torch.Tensor:
    """The head's channels with the rotated slice first: offset .. offset + rot, then those before it, then those
    after it (the order `read` and `define` give, so that an Expect's first rot channels are the rotated ones and
    the rest the untouched copies)."""
    return torch.cat([torch.arange(p.offset, p.offset + p.rot), torch.arange(p.offset),
                      torch.arange(p.offset + p.rot, p.d)])


def offsets(draw, caps, d: int, rot: int) -> int:
    """rope_dim_offset, drawn where the capability allows it: 0 and head_size - rot (the rope slice last, as
    DeepSeek-V4 passes its heads) each about one draw in three, any offset between them the rest."""
    top = d - rot
    if not caps["rope_dim_offset"] or top == 0:
        return 0
    return draw(st.one_of(st.just(0), st.just(top), st.integers(0, top)))


def limits():
    if small():
        return dict(t=6, b=2, s=3, h=4, rows=8, dims=(2, 4, 6, 7, 8, 12, 16))
    return dict(t=4096, b=4, s=1024, h=32, rows=8192, dims=(2, 6, 64, 80, 81, 96, 128, 256))


def max_positions(lim):
    """The cache's rows: up to lim["rows"]; on a device, one plan in ten a long context (a 128K model's table,
    positions past 2^16), where positions narrowed to 16 bits or passed through float16 go wrong."""
    if small():
        return st.integers(1, lim["rows"])
    return st.one_of(*[st.integers(1, lim["rows"])] * 9, st.integers(65537, 131072))


@st.composite
def token_layouts(draw, lead_ndim: int, heads_dim: bool) -> Layout:
    """A layout of [*lead, (h,) channels] whose tokens stay evenly strided (vLLM steps through the flattened
    b * s tokens with one stride): b and s adjacent in memory, s not padded; the heads may lie outside the tokens
    (a head-major buffer); the channels padded (a head slice of a wider row) or, per head, strided."""
    ndim = lead_ndim + heads_dim + 1
    if draw(st.booleans()):
        return contiguous(ndim)
    groups = [tuple(range(lead_ndim))] + ([(lead_ndim,)] if heads_dim else [])
    order = sum(draw(st.permutations(groups)), ()) + (ndim - 1,)
    pad = tuple(0 if lead_ndim == 2 and i == 1 else draw(st.sampled_from((0, 0, 1, 3))) for i in range(ndim))
    return Layout(order, pad)


def positions_layouts(ndim: int):
    """Padded, or for [b, s] also transposed (an [s, b] tensor's .t())."""
    return st.one_of(layouts(ndim), st.just(Layout((1, 0), (0, 0)))) if ndim == 2 else layouts(ndim)


def head_count(p: Plan, name: str) -> int:
    """query's or key's head count (a reshape to [T, h, d] names it: with T = 0, -1 could be any)."""
    return p.hq if name == "query" else p.hk


def heads_of(p: Plan, name: str, t: torch.Tensor) -> torch.Tensor:
    """query or key as [T, h, head_size], its channels as they lie in the head."""
    return t.reshape(p.tokens, head_count(p, name), p.d)


def divisors(n: int) -> tuple:
    return tuple(k for k in range(1, n + 1) if n % k == 0)


class VLLM(Convention):
    NAME = "vllm"
    PARAMETER_CAPS = {"rope_dim_offset": {"rope_dim_offset": False}, "inverse": {"inverse": False}}
    SIGNATURE = ("positions", "query", "key", "head_size", "cos_sin_cache", "is_neox", "rope_dim_offset", "inverse")
    OPTIONAL = {"rope_dim_offset": 0, "inverse": False}
    DIFFERENTIABLE = ()
    CAPS = {
        "dtypes": (DTYPES, "dtypes of query and key"),
        "cache_dtypes": ("any", "cos_sin_cache's dtype: 'any' float dtype (float32 with 16-bit query), or "
                                "'query' (query's only: vLLM casts its cache to query's dtype before the op)"),
        "gqa": (True, "key with fewer heads than query (hk divides hq)"),
        "key_none": (True, "key=None (query alone)"),
        "partial": (True, "rot < head_size: the channels past it untouched (and odd head_size)"),
        "is_neox": ((True, False), "the pairings: True half-split (i, i + rot/2), False interleaved (2i, 2i + 1)"),
        "heads_dim": (True, "query and key as [..., h, head_size] as well as [..., h * head_size]"),
        "batched_positions": (True, "positions [b, s] with query [b, s, ...], as well as [T]"),
        "strides": (True, "query and key as views: head slices of a packed qkv, padded rows, head-major, strided "
                          "heads, each with its own strides"),
        "strided_cache": (True, "cos_sin_cache as a slice of a wider table (vLLM reads rows of rot contiguous)"),
        "strided_positions": (True, "positions as a view (vLLM reads them contiguous)"),
        "int32_positions": (True, "int32 positions as well as int64"),
        "accuracy": ("float32", "accuracy model (accuracy.py): float32 math and one rounding, or dtype math "
                                "(vLLM's kernel multiplies in the query's dtype)"),
        "empty": (True, "no tokens: positions [0] (or [b, s] with b or s 0), query and key without elements"),
        "rope_dim_offset": (True, "rope_dim_offset > 0: the rotated channels rope_dim_offset .. + rot of each head, "
                                  "the others untouched (with partial: rot < head_size)"),
        "inverse": (True, "inverse=True: the rotation by -theta (the cache's sin negated)"),
    }

    def plans(self, caps):
        lim = limits()

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            cache_dtype = draw(st.sampled_from(DTYPES)) if caps["cache_dtypes"] == "any" else dtype
            batched = caps["batched_positions"] and draw(st.booleans())
            zero = domains.empty_dims(draw, caps["empty"], ("b", "s") if batched else ("t",))
            lead = tuple(0 if n in zero else draw(st.integers(1, lim[n])) for n in (("b", "s") if batched else ("t",)))
            hq = draw(st.integers(1, lim["h"]))
            key_none = caps["key_none"] and draw(st.integers(0, 3)) == 0
            hk = 0 if key_none else draw(st.sampled_from(divisors(hq))) if caps["gqa"] else hq
            d, rot = head_and_rotary(draw, lim["dims"], caps["partial"])
            strides = caps["strides"]
            packed = strides and draw(st.booleans())
            q_heads_dim = caps["heads_dim"] and draw(st.booleans())
            k_heads_dim = q_heads_dim if packed else caps["heads_dim"] and draw(st.booleans())
            q_layout = draw(token_layouts(len(lead), q_heads_dim)) if strides else \
                contiguous(len(lead) + q_heads_dim + 1)
            k_layout = q_layout if packed else draw(token_layouts(len(lead), k_heads_dim)) if strides else \
                contiguous(len(lead) + k_heads_dim + 1)
            plan = Plan(
                draw(seeds()), dtype, cache_dtype, lead,
                draw(st.sampled_from((torch.int64, torch.int32))) if caps["int32_positions"] else torch.int64,
                hq, hk, d, rot, draw(max_positions(lim)), draw(st.sampled_from(caps["is_neox"])),
                q_heads_dim, k_heads_dim, packed, q_layout, k_layout,
                draw(layouts(2)) if caps["strided_cache"] else contiguous(2),
                draw(positions_layouts(len(lead))) if caps["strided_positions"] else contiguous(len(lead)))
            # drawn last, once the head and its rotary width are known
            return plan._replace(offset=offsets(draw, caps, d, rot), inverse=caps["inverse"] and draw(st.booleans()),
                                 explicit_defaults=domains.explicit_defaults(draw, caps))

        return draw()

    def build(self, p: Plan, arena) -> Case:
        positions = arena.place(arena.integers(0, p.rows, p.lead, p.positions_dtype), p.positions_layout)
        theta = arena.angles((p.rows, p.rot // 2))
        cache = arena.place(torch.cat([theta.cos(), theta.sin()], dim=-1).to(p.cache_dtype), p.cache_layout)

        def values(h):  # drawn as [*lead, h, d] whatever the form: the forms of one seed hold the same values
            return torch.randn((*p.lead, h, p.d), generator=arena.gen, dtype=torch.float64).to(p.dtype)

        def form(v, heads_dim):
            return v if heads_dim else v.flatten(-2)

        if p.packed:  # [..., hq | hk | hk (the value heads, never written), d]
            qkv = arena.place(form(values(p.hq + 2 * p.hk), p.q_heads_dim), p.q_layout)
            heads = qkv if p.q_heads_dim else qkv.unflatten(-1, (p.hq + 2 * p.hk, p.d))
            query = form(heads[..., :p.hq, :], p.q_heads_dim)
            key = form(heads[..., p.hq:p.hq + p.hk, :], p.k_heads_dim) if p.hk else None
        else:
            query = arena.place(form(values(p.hq), p.q_heads_dim), p.q_layout)
            key = arena.place(form(values(p.hk), p.k_heads_dim), p.k_layout) if p.hk else None
        args = dict(positions=positions, query=query, key=key, head_size=p.d, cos_sin_cache=cache,
                    is_neox=p.is_neox)
        # by keyword where they differ from the defaults (settle_defaults passes the defaults where the plan says)
        if p.offset:
            args["rope_dim_offset"] = p.offset
        if p.inverse:
            args["inverse"] = True
        return Case(p, args, 6, arena.buffers)

    def effects(self, case):
        return ("query", "key"), None

    def read(self, case, name, t):
        """[T, h, head_size], each head's rotated slice first (slice_first)."""
        return heads_of(case.plan, name, t)[..., slice_first(case.plan).to(t.device)]

    def define(self, case, x64):
        p = case.plan
        half = p.rot // 2
        rows = x64["cos_sin_cache"][x64["positions"].reshape(-1)]  # [T, rot]
        sign = -1.0 if p.inverse else 1.0  # R(-theta): cos(-theta) = cos, sin(-theta) = -sin
        cos, sin = (pairing.per_channel(t, not p.is_neox).unsqueeze(-2)
                    for t in (rows[:, :half], sign * rows[:, half:]))
        out = {}
        for name in ("query", "key"):
            if case.args[name] is not None:
                x = heads_of(p, name, x64[name])[..., slice_first(p)]
                out[name] = Expect(pairing.rotate(x, cos, sin, not p.is_neox), x, p.rot, not p.is_neox, p.dtype)
        return out


# ---- the convention's own invariants ---------------------------------------------------------------------


def rotated(fn, caps, plan, change=None) -> dict:
    """{name: query/key after the call, as [T, h, d] (copies)} for `plan`; `change(case)` edits the case first."""
    case = make_case(CONVENTION, caps, plan)
    if change is not None:
        change(case)
    with torch.no_grad():
        result = case.call(fn)
    assert result is None, f"expected None (query and key are written in place), got {type(result).__name__}"
    return {n: CONVENTION.read(case, n, case.args[n]).clone() for n in ("query", "key") if case.args[n] is not None}


def plain(plan, **changes):
    """The plan in separate, contiguous buffers (for calls whose forms or shapes differ)."""
    plan = plan._replace(**changes)
    return plan._replace(q_layout=contiguous(len(plan.lead) + plan.q_heads_dim + 1),
                         k_layout=contiguous(len(plan.lead) + plan.k_heads_dim + 1),
                         positions_layout=contiguous(len(plan.lead)))


def flat_equals_heads(conv, fn, caps, plan):
    """query/key as [..., h * d] and as [..., h, d] (the same memory, viewed two ways): the same result, bitwise."""
    if not caps["heads_dim"]:
        return
    flat = rotated(fn, caps, plain(plan, q_heads_dim=False, k_heads_dim=False))
    heads = rotated(fn, caps, plain(plan, q_heads_dim=True, k_heads_dim=True))
    for n in flat:
        assert_bitwise(f"{n} as [..., h * d] against [..., h, d]", flat[n], heads[n])


def batched_positions_equal_flat(conv, fn, caps, plan):
    """positions [b, s] with query/key [b, s, ...] equal the flattened call, positions [b * s], bitwise."""
    if not caps["batched_positions"]:
        return
    lead = plan.lead if len(plan.lead) == 2 else (1, plan.lead[0])
    batched = rotated(fn, caps, plain(plan, lead=lead, packed=False))
    flat = rotated(fn, caps, plain(plan, lead=(lead[0] * lead[1],), packed=False))
    for n in flat:
        assert_bitwise(f"{n} with positions {list(lead)} against [{lead[0] * lead[1]}]", batched[n], flat[n])


def key_none_leaves_query(conv, fn, caps, plan):
    """key=None rotates query exactly as the call with a key does."""
    if not caps["key_none"]:
        return
    with_key = plan._replace(packed=False, hk=plan.hk or plan.hq)
    alone = rotated(fn, caps, with_key._replace(hk=0))
    both = rotated(fn, caps, with_key)
    assert_bitwise("query with key=None against with a key", alone["query"], both["query"])


def query_key_independent(conv, fn, caps, plan):
    """Other key values leave query's result as it was, and other query values key's (bitwise)."""
    if not plan.hk:
        return
    gen = torch.Generator().manual_seed(plan.seed + 7)

    def redraw(name):
        def change(case):
            x = case.args[name]
            x.copy_(torch.randn(tuple(x.shape), generator=gen, dtype=torch.float64).to(x.dtype))
        return change

    base = rotated(fn, caps, plan)
    assert_bitwise("query after other key values", rotated(fn, caps, plan, redraw("key"))["query"], base["query"])
    assert_bitwise("key after other query values", rotated(fn, caps, plan, redraw("query"))["key"], base["key"])


def inverse(conv, fn, caps, plan):
    """The call with the cache's sin half negated undoes the call (R(-theta) R(theta) = I), within two
    roundings and the cache's (|cos^2 + sin^2 - 1| up to EPS of its dtype); untouched channels bitwise. With
    inverse=True both calls rotate the other way: the second still undoes the first."""
    case = make_case(conv, caps, plan)
    names = [n for n in ("query", "key") if case.args[n] is not None]
    before = {n: conv.read(case, n, case.args[n]).clone() for n in names}
    cache = case.args["cos_sin_cache"]
    half = plan.rot // 2
    with torch.no_grad():
        case.call(fn)
        case.args["cos_sin_cache"] = torch.cat([cache[:, :half], -cache[:, half:]], dim=-1)
        case.call(fn)
    for n in names:
        assert_undone(f"inverse: {n}", conv.read(case, n, case.args[n]), before[n], plan.rot, not plan.is_neox,
                      plan.cache_dtype, caps.get("accuracy", "float32"))


def is_neox_moves_channels(conv, fn, caps, plan):
    """is_neox=False on channels rearranged (i, i + rot/2) -> (2i, 2i + 1) within the rotated slice equals
    is_neox=True, rearranged back: the flag moves channels, nothing else (within two roundings: a kernel may
    contract either product). Compared slice first (`read`); the rearranged heads are written back with the slice at
    its offset."""
    if set(caps["is_neox"]) != {True, False}:
        return
    neox = torch.cat([torch.arange(0, plan.rot, 2), torch.arange(1, plan.rot, 2), torch.arange(plan.rot, plan.d)])
    to_interleaved = torch.argsort(neox)
    order = slice_first(plan)

    def rearrange(case):
        for n in ("query", "key"):
            x = case.args[n]
            if x is not None:
                first = CONVENTION.read(case, n, x)[..., to_interleaved.to(x.device)]
                heads = torch.empty_like(first)
                heads[..., order.to(x.device)] = first
                case.args[n] = heads.reshape(x.shape).contiguous()

    want = rotated(fn, caps, plan._replace(is_neox=True))
    got = rotated(fn, caps, plan._replace(is_neox=False), rearrange)
    for n in want:
        assert_within(f"{n}: is_neox=False on rearranged channels against is_neox=True",
                      got[n][..., neox.to(got[n].device)], want[n], want[n], plan.rot, False, 3,
                      caps.get("accuracy", "float32"))


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: each token called alone (its own position, query and key) and the tokens rolled by
    one give bitwise the token's results in the whole call (flat positions, query and key in buffers of their own)."""
    p = plain(plan, lead=(max(plan.tokens, 2),), packed=False)
    case = make_case(conv, caps, p)
    names = [n for n in ("query", "key") if case.args[n] is not None]
    given = {n: case.args[n].clone() for n in ("positions", *names)}

    def call_on(args):
        """{name: result as [tokens, h, d]}: fn on new tensors `args` (positions, query, key) in the case's form."""
        one = Case(p._replace(lead=tuple(args["positions"].shape)), {**case.args, **args}, case.positional)
        with torch.no_grad():
            one.call(fn)
        return {n: conv.read(one, n, args[n]) for n in names}

    whole = call_on({n: x.clone() for n, x in given.items()})
    tokens = p.tokens
    for i in sorted({0, tokens - 1, plan.seed % tokens}):
        alone = call_on({n: x[i:i + 1].clone() for n, x in given.items()})
        for n in names:
            assert_bitwise(f"batch invariance: {n} of token {i} alone, against among {tokens}", alone[n][0],
                           whole[n][i])
    rolled = call_on({n: torch.roll(x, 1, 0) for n, x in given.items()})
    for n in names:
        assert_bitwise(f"batch invariance: {n} with the tokens rolled by one, against the whole call's rolled",
                       rolled[n], torch.roll(whole[n], 1, 0))


def offset_is_a_slice(conv, fn, caps, plan):
    """rope_dim_offset = o (the plan's, else head_size - rot: DeepSeek-V4's) on whole heads: channels o .. o + rot of
    each head are bitwise the call with offset 0 on those channels as a tensor of their own (head_size = rot, in the
    plan's form, contiguous): the offset moves addresses, not the arithmetic. Every other channel bitwise as given
    (neither rotated nor rounded)."""
    if not caps["rope_dim_offset"] or plan.d == plan.rot:
        return
    o = plan.offset or plan.d - plan.rot
    p = plan._replace(offset=o)
    case = make_case(conv, caps, p)
    names = [n for n in ("query", "key") if case.args[n] is not None]
    given = {n: heads_of(p, n, case.args[n]).clone() for n in names}
    with torch.no_grad():
        case.call(fn)
    # the slice alone: [*lead, h, rot] or [*lead, h * rot], as the plan's form of each
    alone = plain(p, d=p.rot, offset=0, packed=False)
    own = {}
    for n in names:
        t = given[n][..., o:o + p.rot].reshape(*p.lead, head_count(p, n), p.rot).contiguous()
        own[n] = t if (p.q_heads_dim if n == "query" else p.k_heads_dim) else t.flatten(-2)
    args = {k: v for k, v in case.args.items() if k != "rope_dim_offset"}
    args.update(own, head_size=p.rot)
    with torch.no_grad():
        Case(alone, args, case.positional).call(fn)
    outside = torch.cat([torch.arange(o), torch.arange(o + p.rot, p.d)])
    for n in names:
        got = heads_of(p, n, case.args[n])
        assert_bitwise(f"{n}[..., {o}:{o + p.rot}] with rope_dim_offset={o}, against the call on those channels "
                       f"alone", got[..., o:o + p.rot], heads_of(alone, n, own[n]))
        assert_bitwise(f"{n}: the channels outside {o}..{o + p.rot} with rope_dim_offset={o}, against as given",
                       got[..., outside.to(got.device)], given[n][..., outside.to(got.device)])


def inverse_undoes(conv, fn, caps, plan):
    """The call with `inverse` flipped undoes the call (R(-theta) R(theta) = I), within compare.assert_undone's bound
    (two roundings and the cache's); the channels outside the rotated slice bitwise."""
    if not caps["inverse"]:
        return
    case = make_case(conv, caps, plan)
    names = [n for n in ("query", "key") if case.args[n] is not None]
    before = {n: conv.read(case, n, case.args[n]).clone() for n in names}
    with torch.no_grad():
        case.call(fn)
        case.args["inverse"] = not plan.inverse
        case.call(fn)
    for n in names:
        assert_undone(f"inverse={not plan.inverse} after inverse={plan.inverse}: {n}", conv.read(case, n, case.args[n]),
                      before[n], plan.rot, not plan.is_neox, plan.cache_dtype, caps.get("accuracy", "float32"))


def inverse_is_negated_sin(conv, fn, caps, plan):
    """inverse=True equals inverse=False with the cache's sin half negated, bitwise: sin(-theta) = -sin(theta), and
    negation is exact (x1 cos - x2 (-sin) and x1 cos + x2 sin round the same sum)."""
    if not caps["inverse"]:
        return
    half = plan.rot // 2

    def negate_sin(case):
        cache = case.args["cos_sin_cache"]
        case.args["cos_sin_cache"] = torch.cat([cache[:, :half], -cache[:, half:]], dim=-1)

    want = rotated(fn, caps, plan._replace(inverse=False), negate_sin)
    got = rotated(fn, caps, plan._replace(inverse=True))
    for n in want:
        assert_bitwise(f"{n} with inverse=True, against inverse=False with the cache's sin negated", got[n], want[n])


VLLM.INVARIANTS = {
    "batch_rows_alone": batch_rows_alone,
    "is_neox_moves_channels": is_neox_moves_channels,
    "flat_equals_heads": flat_equals_heads,
    "batched_positions_equal_flat": batched_positions_equal_flat,
    "key_none_leaves_query": key_none_leaves_query,
    "query_key_independent": query_key_independent,
    "inverse": inverse,
    "offset_is_a_slice": offset_is_a_slice,
    "inverse_undoes": inverse_undoes,
    "inverse_is_negated_sin": inverse_is_negated_sin,
}
CONVENTION = VLLM()


def _forward_native(case, math):
    """vLLM's `forward_native` on the case's arguments (before the call writes them): the cache's rows gathered at
    the positions and chunked into cos and sin (sin negated for inverse=True), both cast to `math` (None: the query's
    dtype, as vLLM casts them), x1 cos - x2 sin and x2 cos + x1 sin in that dtype on each head's channels
    rope_dim_offset .. + rot, each operation rounded to it, the result in the query's dtype; the other channels
    copied. {name: tensor of the argument's shape}."""
    p, args = case.plan, case.args
    rows = args["cos_sin_cache"].index_select(0, args["positions"].reshape(-1).long())
    cos, sin = rows.chunk(2, dim=-1)
    if p.inverse:
        sin = -sin
    start, end = p.offset, p.offset + p.rot
    out = {}
    with torch.no_grad():
        for name in ("query", "key"):
            x = args[name]
            if x is None:
                continue
            heads = x.reshape(p.tokens, head_count(p, name), p.d)
            dtype = math or x.dtype
            c, s = cos.unsqueeze(-2).to(dtype), sin.unsqueeze(-2).to(dtype)
            x_rot = heads[..., start:end].to(dtype)
            x1, x2 = x_rot.chunk(2, dim=-1) if p.is_neox else (x_rot[..., ::2], x_rot[..., 1::2])
            o1 = x1 * c - x2 * s
            o2 = x2 * c + x1 * s
            rot = torch.cat((o1, o2), dim=-1) if p.is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)
            out[name] = torch.cat([heads[..., :start], rot.to(x.dtype), heads[..., end:]], dim=-1).reshape(x.shape)
    return out


# --rope-schedule: `eager`, vLLM's forward_native (its PyTorch path, in the query's dtype); `float32`, the same
# operations in float32 and one rounding to the query's dtype
VLLM.SCHEDULES = {"eager": lambda case: _forward_native(case, None),
                  "float32": lambda case: _forward_native(case, torch.float32)}


def _is_neox_domain() -> tuple:
    return domains.flags(lambda p: p.is_neox, (True, False), ("half-split (True)", "interleaved (False)"),
                         allowed=lambda caps: caps["is_neox"])


def _no_offset(caps) -> bool:
    """No offset but 0 is drawn: the target has no rope_dim_offset, or rotates whole heads only (no room for one)."""
    return not caps.get("rope_dim_offset", True) or not caps.get("partial", True)


VLLM.DOMAIN = {
    "positions": (*domains.index_dtypes(lambda p: p.positions_dtype, "int32_positions"),
                  domains.cls("[T]", lambda p, c: len(p.lead) == 1),
                  domains.cls("[b, s]", lambda p, c: len(p.lead) == 2, "batched_positions"),
                  *domains.layouts("positions", "strided_positions"),
                  *domains.sizes(lambda p: p.tokens, "empty", "tokens")),
    "query": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("query"),
              domains.cls("[..., h, head_size]", lambda p, c: p.q_heads_dim, "heads_dim"),
              domains.cls("[..., h * head_size]", lambda p, c: not p.q_heads_dim),
              domains.cls("a head slice of a packed qkv", lambda p, c: p.packed, "strides")),
    "key": (*domains.head_counts(lambda p: (p.hq, p.hk), none=lambda p: p.hk == 0, none_cap="key_none"),
            domains.cls("[..., h, head_size]", lambda p, c: p.hk and p.k_heads_dim, "heads_dim"),
            domains.cls("[..., h * head_size]", lambda p, c: p.hk and not p.k_heads_dim)),
    "head_size": (*domains.odd_heads(lambda p: p.d), *domains.sizes(lambda p: p.d, "", empty=False, one=False)),
    "cos_sin_cache": (*domains.cache_dtype_classes(lambda p: (p.dtype, p.cache_dtype),
                                                   lambda caps: caps["cache_dtypes"] == "any"),
                      *domains.layouts("cos_sin_cache", "strided_cache"),
                      *domains.widths(lambda p: (p.rot, p.d))),
    "is_neox": _is_neox_domain(),
    "rope_dim_offset": (*domains.optional("rope_dim_offset", "another offset (> 0)", cap="rope_dim_offset",
                                          other_off=_no_offset),
                        domains.cls("0", lambda p, c: p.offset == 0),
                        domains.cls("between 0 and head_size - rotary_dim", lambda p, c: 0 < p.offset < p.d - p.rot,
                                    "rope_dim_offset", _no_offset),
                        domains.cls("head_size - rotary_dim (the rope slice last, DeepSeek-V4's)",
                                    lambda p, c: 0 < p.offset == p.d - p.rot, "rope_dim_offset", _no_offset)),
    "inverse": domains.optional("inverse", "True (the rotation by -theta)", cap="inverse"),
}
