"""transformers' DeepSeek-V3 convention (`modeling_deepseek_v3`):
    apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1) -> (q_embed, k_embed)
    q' = q.view(..., d/2, 2).transpose(-1, -2).reshape(..., d)          (the head de-interleaved)
    q_embed = q' * cos.unsqueeze(unsqueeze_dim) + rotate_half(q') * sin.unsqueeze(unsqueeze_dim)
so out[i] = q[2i] cos[i] - q[2i + 1] sin[i] and out[i + d/2] = q[2i + 1] cos[i + d/2] + q[2i] sin[i + d/2] for
i < d/2: pairs read interleaved (2i, 2i + 1), written half-split (i, i + d/2). The whole head is rotated: cos, sin
[b or 1, s, d] (transformers' rotary module gives cat(freqs, freqs) in the model's dtype), d even. q [b, hq, s, d]
and k [b, hk, s, d] (unsqueeze_dim=1) or [b, s, h, d] (unsqueeze_dim=2: transformers' function views the last dim
alike); DeepSeek's attention (MLA) passes q's rope slice of a wider head (qk_nope_head_dim + qk_rope_head_dim,
192 = 128 + 64) and k_pe, one head sliced from the compressed kv projection (kv_lora_rank + 64). New tensors in
torch's promotion of q's and cos's dtypes; position_ids unused; the gradient flows to q and k (the transpose: q's
channel 2i gets g[i] cos[i] + g[i + d/2] sin[i + d/2], channel 2i + 1 gets g[i + d/2] cos[i + d/2] - g[i] sin[i]).

The accuracy model pairs each output channel with the input pair it comes from: the expectation's source is the
de-interleaved input (its half-split pairs (i, i + d/2) are the input's (2i, 2i + 1)), and the gradient's scale is
the upstream gradient's pairs written back interleaved (`grad_scale`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import pairing
from ..compare import assert_bitwise, assert_undone, assert_within
from ..contract import Returned
from ..run import make_case
from ..tensors import Layout, contiguous, layouts, seeds
from . import Case, Expect, domains, small
from .hf import (
    HF,
    Plan,
    _expression,
    batch_rows_alone,
    call,
    refusing,
    tables_batch_broadcast,
    tables_domain,
    unsqueeze_dim_transposed,
    unsqueeze_domain,
)


class Wide(NamedTuple):
    """A layout of q or k: the last `d` channels of a wider head, [..., nope + d] (DeepSeek's q_rot of the
    [nope | rope] head, its k_rot of the [kv_lora_rank | rope] projection); `order`, the dims outermost first as
    they lie in memory (the last always last), as tensors.Layout's."""
    order: tuple
    nope: int


def deinterleave(x):
    """x [..., d] -> [..., d]: channel 2i to i, 2i + 1 to i + d/2 (transformers' view(d/2, 2).transpose)."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


def interleave(x):
    """The inverse of `deinterleave`: channel i to 2i, i + d/2 to 2i + 1."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).transpose(-1, -2).flatten(-2)


def wide_layouts(nopes) -> st.SearchStrategy:
    return st.builds(Wide, st.permutations(range(3)).map(lambda o: (*o, 3)), st.sampled_from(nopes))


class HFDeepSeekV3(HF):
    NAME = "hf-deepseek-v3"
    CAPS = {
        **{k: v for k, v in HF.CAPS.items() if k not in ("partial", "in_place")},
        "gqa": (True, "k with another head count than q (MLA's k_pe: one head)"),
        "elementwise_tables": (True, "cos/sin whose two halves differ (output channel i + d/2 reads column i + d/2)"),
        "strides": (True, "views: permuted, sliced (the rope slice of a wider head) and expanded tensors"),
        "bad_input": (True, "tables not as wide as the head, an odd head dim, tables of another shape than sin or "
                            "than the call's batch and tokens: refused with a TypeError or ValueError whose message "
                            "starts with the argument at fault, before anything is written"),
    }

    def plans(self, caps):
        # head dims first: one whose de-interleave is not its own inverse (d >= 6), Hypothesis' simplest choice
        lim = dict(b=2, h=4, s=5, dims=(6, 2, 4, 8, 10, 16), nope=(2, 6), kv=(4, 8)) if small() else \
            dict(b=4, h=32, s=512, dims=(64, 2, 6, 32, 48, 80, 96, 128), nope=(128, 2, 64), kv=(512, 32))
        strides = caps["strides"]

        def heads_layout(nopes):
            # channels strided too (`channel_layouts`' classes, in an order that draws each within the CPU budget)
            return st.one_of(layouts(4, spaced=True), layouts(4), wide_layouts(nopes)) if strides \
                else st.just(contiguous(4))

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            table_dtype = draw(st.sampled_from(domains.table_dtypes(dtype, caps)))
            # MLA's one k head beside several of q's (a third of the draws), q's head count, any other
            kind = draw(st.sampled_from(("one", "as q", "any"))) if caps.get("gqa") else "as q"
            hq = draw(st.integers(2 if kind == "one" else 1, lim["h"]))
            hk = {"one": 1, "as q": hq}.get(kind) or draw(st.integers(1, hq))
            d = draw(st.sampled_from(lim["dims"]))
            b = draw(st.integers(1, lim["b"]))
            # decode (s = 1) often; s = 0 where the target takes it
            s = draw(domains.lengths((1, 3, 1, 2, 1, lim["s"], 1), caps.get("empty", False), lim["s"], small()))
            cos_layout = draw(st.one_of(layouts(3, padded_dims=(1, 2)), st.just("expanded"))) if strides \
                else contiguous(3)
            return Plan(
                draw(seeds()), dtype, table_dtype, b, hq, hk, s, d,
                draw(st.sampled_from(caps["unsqueeze_dim"])),
                draw(st.sampled_from((1, b))) if caps["cos_batch"] else 1,
                draw(st.booleans()) if caps["elementwise_tables"] else True,
                draw(heads_layout(lim["nope"])), draw(heads_layout(lim["kv"])),
                cos_layout, draw(st.booleans()) if caps.get("position_ids") else False, d,
                domains.explicit_defaults(draw, caps))

        return draw()

    def build(self, p: Plan, arena) -> Case:
        q = self.heads(arena, self.heads_shape(p, p.hq), p.dtype, p.q_layout)
        k = self.heads(arena, self.heads_shape(p, p.hk), p.dtype, p.k_layout)
        args = dict(q=q, k=k, **self.tables(p, arena))
        if p.position_ids:
            args["position_ids"] = arena.place(torch.arange(p.s).expand(p.b, p.s).clone())
        args["unsqueeze_dim"] = p.unsqueeze_dim
        return Case(p, args, 4, arena.buffers)

    @staticmethod
    def heads(arena, shape, dtype, layout):
        """q or k: N(0, 1) values in `layout`; a Wide one the last channels of a NaN-filled wider head (a read of
        the channels before the slice gives NaN)."""
        if not isinstance(layout, Wide):
            return arena.randn(shape, dtype, layout)
        values = torch.randn(tuple(shape), generator=arena.gen, dtype=torch.float64).to(dtype)
        full = torch.cat([torch.full((*shape[:-1], layout.nope), float("nan"), dtype=dtype), values], dim=-1)
        return arena.place(full, Layout(layout.order, (0,) * 4))[..., layout.nope:]

    def effects(self, case):
        return (), (Returned("q"), Returned("k"))

    def define(self, case, x64):
        p = case.plan
        out_dtype = torch.promote_types(p.dtype, p.table_dtype)
        cos, sin = x64["cos"].unsqueeze(p.unsqueeze_dim), x64["sin"].unsqueeze(p.unsqueeze_dim)
        out = {}
        for name in ("q", "k"):
            source = deinterleave(x64[name])  # the input's pair (2i, 2i + 1) at the output's (i, i + d/2)
            out[name] = Expect(pairing.rotate(source, cos, sin, False), source, source.shape[-1], False, out_dtype)
        return out

    def grad_scale(self, case, arg, up64, expect):
        """The gradient of input channel 2i (and 2i + 1) comes from output channels i and i + d/2: their upstream
        gradients' pair scale, written back interleaved."""
        e = expect[arg]
        scale = interleave(pairing.pair_scale(up64[arg], e.rot, False))
        return scale, pairing.copied_mask(scale.shape[-1], e.rot)

    def outside(self, plan, caps):
        if plan.dtype not in caps["dtypes"] or plan.table_dtype not in domains.table_dtypes(plan.dtype, caps):
            return f"{plan.dtype} q with {plan.table_dtype} tables"
        if plan.hk != plan.hq and not caps["gqa"]:
            return "GQA (gqa)"
        if plan.unsqueeze_dim not in caps["unsqueeze_dim"]:
            return f"unsqueeze_dim={plan.unsqueeze_dim}"
        if plan.cos_batch > 1 and not caps["cos_batch"]:
            return "per-sequence tables (cos_batch)"
        if not caps["strides"] and not all(x == contiguous(n) for x, n in ((plan.q_layout, 4), (plan.k_layout, 4),
                                                                           (plan.cos_layout, 3))):
            return "views (strides)"
        return None


# ---------------------------------------------------------------------------------------------- invariants

def _quarter_tables(case, seed):
    """cos/sin of the case's shape whose every entry is a quarter turn, (cos, sin) one of (1, 0), (0, 1), (-1, 0),
    (0, -1), drawn per element (the halves alike where the target reads no elementwise tables)."""
    cos = case.args["cos"]
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(cos.shape)
    if case.caps["elementwise_tables"]:
        turn = torch.randint(0, 4, shape, generator=gen)
    else:
        turn = torch.randint(0, 4, (*shape[:-1], shape[-1] // 2), generator=gen).repeat(1, 1, 2)
    c = torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=torch.float64)[turn]
    s = torch.tensor([0.0, 1.0, 0.0, -1.0], dtype=torch.float64)[turn]
    return c.to(cos.dtype).to(cos.device), s.to(cos.dtype).to(cos.device)


def equals_hf_of_deinterleaved(conv, fn, caps, plan):
    """The call is transformers' plain half-split form (`apply_rotary_pos_emb`, spec/hf.py) on the de-interleaved
    q and k. Bitwise on tables of quarter turns drawn per element (each product is then exactly an input, its
    negation or zero, so every output is one input channel exactly, in any order of evaluation, fused multiply-adds
    and 16-bit math included): this pins the permutation, the sign and the table column of every channel. On the
    case's tables within two roundings of that form in float32 math with one rounding (`dtype` model: as transformers
    evaluates it eagerly): not bitwise, since a target may contract its products or round otherwise within its
    accuracy model, and the one exact statement for drawn angles is a named schedule (`--rope-schedule`)."""
    case = make_case(conv, caps, plan)
    names = ("q", "k")
    p = case.plan
    dim = p.unsqueeze_dim
    c, s = _quarter_tables(case, plan.seed + 4)
    got = call(fn, case, cos=c, sin=s)
    for name, g in zip(names, got, strict=True):
        x = deinterleave(case.args[name].detach().cpu().double())
        c64, s64 = c.cpu().double().unsqueeze(dim), s.cpu().double().unsqueeze(dim)
        want = (x * c64 + torch.cat([-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]], -1) * s64)
        assert_bitwise(f"{name} on quarter-turn tables, against transformers' half-split form of the de-interleaved "
                       f"{name}", g, want.to(torch.promote_types(case.args[name].dtype, c.dtype)))
    model = caps.get("accuracy", "float32")
    got = call(fn, case)
    cos, sin = case.args["cos"].unsqueeze(dim), case.args["sin"].unsqueeze(dim)
    with torch.no_grad():
        for name, g in zip(names, got, strict=True):
            x = deinterleave(case.args[name])
            want = _expression(x, cos, sin, torch.float32 if model == "float32" else None)
            assert_within(f"{name}, against transformers' half-split form of the de-interleaved {name}", g, want, x,
                          x.shape[-1], False, 2, model)


def heads_independent(conv, fn, caps, plan):
    """Each head is rotated alone: k with one head (MLA's k_pe) gives bitwise every head of the call with it
    repeated over q's head count, expanded (stride 0) and repeated in memory, and q's result stays as it was; where
    the target has a backward, the gradients of the repeated k's heads (and q's) from the same upstream gradients
    are bitwise the one-head call's. Without GQA q has one head too, repeated alike."""
    n = max(plan.hq, 2)
    gqa = caps["gqa"]
    case = make_case(conv, caps, plan._replace(hq=n if gqa else 1, hk=1))
    dim = plan.unsqueeze_dim
    q, k = case.args["q"], case.args["k"]

    def spread(x):
        return x.expand(*(n if i == dim else -1 for i in range(x.dim())))

    grads = caps.get("backward", True)
    gen = torch.Generator().manual_seed(plan.seed + 5)

    def run(qx, kx, ups=None):
        """fn on (qx, kx) as given; with upstream gradients `ups`, on leaves copied from them, and their gradients."""
        if ups is None:
            with torch.no_grad():
                return call(fn, case, q=qx, k=kx), ()
        leaves = [x.detach().clone().requires_grad_() for x in (qx, kx)]
        outs = call(fn, case, q=leaves[0], k=leaves[1])
        torch.autograd.backward(outs, list(ups))
        return outs, tuple(leaf.grad for leaf in leaves)

    want, _ = run(q, k)
    ups = tuple(torch.randn(tuple(o.shape), generator=gen, dtype=torch.float64).to(o.dtype).to(o.device)
                for o in want) if grads else None
    variants = [("repeated in memory", spread(k).contiguous())]
    if caps["strides"]:
        variants.append(("expanded (stride 0)", spread(k)))
    for what, kn in variants:
        qn = q if gqa else (spread(q).contiguous() if what.startswith("repeated") else spread(q))
        got, _ = run(qn, kn)
        for name, g, w in zip(("q", "k"), got, want, strict=True):
            for j in range(g.shape[dim] if name == "k" or not gqa else 0):
                assert_bitwise(f"{name} head {j} of {n}, {what}, against the call on one head", g.narrow(dim, j, 1), w)
        if gqa:
            assert_bitwise(f"q beside k {what}, against beside one k head", got[0], want[0])
    if not grads:
        return
    _, want_grads = run(q, k, ups)
    qn = q if gqa else spread(q).contiguous()
    _, got_grads = run(qn, spread(k).contiguous(), (ups[0] if gqa else spread(ups[0]), spread(ups[1])))
    for name, g, w in zip(("q", "k"), got_grads, want_grads, strict=True):
        for j in range(g.shape[dim] if name == "k" or not gqa else 0):
            assert_bitwise(f"the gradient of {name} head {j} of {n} (repeated), against the call on one head",
                           g.narrow(dim, j, 1), w)
        if gqa and name == "q":
            assert_bitwise("the gradient of q beside k repeated, against beside one k head", g, w)


def inverse(conv, fn, caps, plan):
    """The call by (cos, -sin) on the result written back interleaved (channel i to 2i, i + d/2 to 2i + 1) gives
    back the de-interleaved input, within two roundings and the tables' rounding (compare.assert_undone): the second
    call reads the first's pairs where it wrote them and rotates them back. Equal halves only: with elementwise
    tables the call is no rotation."""
    case = make_case(conv, caps, plan._replace(equal_halves=True))
    once = call(fn, case)
    twice = call(fn, case, sin=-case.args["sin"], q=interleave(once[0]), k=interleave(once[1]))
    for name, back in zip(("q", "k"), twice, strict=True):
        x0 = deinterleave(case.args[name]).to(back.dtype)  # promoted: an exact conversion
        assert_undone(f"inverse: {name}", back, x0, x0.shape[-1], False, case.args["cos"].dtype,
                      caps.get("accuracy", "float32"))


def bad_inputs(case) -> list:
    """(names a message may start with, argument overrides) for each bad call the case gives: tables narrower and
    wider than the head (no pass-through channels: the whole head is de-interleaved), an odd head dim (with tables
    as wide), sin of another shape than cos, tables for another sequence length, for a batch neither 1 nor b."""
    p, a = case.plan, case.args
    cos, sin = a["cos"], a["sin"]
    cb, d = cos.shape[0], p.d

    def wider(x, n):
        return torch.cat([x, x.new_full((*x.shape[:-1], n), 0.5)], dim=-1)

    def full(shape, v):
        return cos.new_full(shape, v)

    bad = [(("cos",), dict(cos=wider(cos, 2), sin=wider(sin, 2))),
           (("q", "k", "cos", "sin"), dict(q=wider(a["q"], 1), k=wider(a["k"], 1), cos=wider(cos, 1),
                                           sin=wider(sin, 1))),
           (("sin", "cos"), dict(sin=wider(sin, 2))),
           (("cos", "sin"), dict(cos=full((cb, p.s + 1, d), 0.6), sin=full((cb, p.s + 1, d), 0.8))),
           (("cos", "sin"), dict(cos=full((p.b + 1, p.s, d), 0.6), sin=full((p.b + 1, p.s, d), 0.8)))]
    if d > 2:
        bad.insert(0, (("cos",), dict(cos=cos[..., :d - 2], sin=sin[..., :d - 2])))
    return bad


refuses_bad_input = refusing(bad_inputs)


HFDeepSeekV3.INVARIANTS = {
    "equals_hf_of_deinterleaved": equals_hf_of_deinterleaved,
    "batch_rows_alone": batch_rows_alone,
    "heads_independent": heads_independent,
    "inverse": inverse,
    "unsqueeze_transposed": unsqueeze_dim_transposed,
    "tables_batch_broadcast": tables_batch_broadcast,
    "refuses_bad_input": refuses_bad_input,
}


def _schedule(math_dtype):
    def schedule(case):
        p = case.plan
        cos, sin = case.args["cos"].unsqueeze(p.unsqueeze_dim), case.args["sin"].unsqueeze(p.unsqueeze_dim)
        with torch.no_grad():
            return {n: _expression(deinterleave(case.args[n]), cos, sin, math_dtype) for n in ("q", "k")}
    return schedule


# --rope-schedule: `eager`, transformers' function as its model runs it (the de-interleave, then each operation
# rounded to torch's promotion of its operands); `float32`, float32 math and one rounding
HFDeepSeekV3.SCHEDULES = {"eager": _schedule(None), "float32": _schedule(torch.float32)}


def _is_wide(get):
    return lambda p, c: isinstance(get(p), Wide)


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


HFDeepSeekV3.DOMAIN = {
    "q": (*domains.dtypes(lambda p: p.dtype),
          *domains.sizes(lambda p: p.s, "empty", "s"),
          *domains.layouts("q"), domains.spaced("q"),
          domains.cls("the rope slice of a wider head", _is_wide(lambda p: p.q_layout), "strides"),
          domains.cls("head dim 2 (one pair)", lambda p, c: p.d == 2),
          domains.cls("head dim a power of two > 2", lambda p, c: p.d > 2 and _pow2(p.d)),
          domains.cls("head dim not a power of two", lambda p, c: not _pow2(p.d))),
    "k": (*domains.layouts("k"), domains.spaced("k"),
          domains.cls("a slice of a wider projection", _is_wide(lambda p: p.k_layout), "strides"),
          domains.cls("as many heads as q", lambda p, c: p.hk == p.hq),
          domains.cls("fewer heads than q (GQA)", lambda p, c: p.hk < p.hq, "gqa"),
          domains.cls("one head, q with more (MLA's k_pe)", lambda p, c: p.hk == 1 < p.hq, "gqa")),
    "cos": tuple(c for c in tables_domain() if c.name not in ("whole head", "narrower than the head")),
    "sin": tuple(c for c in tables_domain("sin") if c.name not in ("whole head", "narrower than the head")),
    "position_ids": domains.optional("position_ids", "a tensor", cap="position_ids"),
    "unsqueeze_dim": unsqueeze_domain(),
}

# DeepSeek-V3's attention at decode: q the rope slice (64) of 192-channel heads laid out [b, s, h, 192], k_pe one
# head sliced from the 576-channel compressed kv projection, bfloat16 with bfloat16 tables, one table per sequence
PINS = (Plan(seed=3, dtype=torch.bfloat16, table_dtype=torch.bfloat16, b=2, hq=4, hk=1, s=1, d=64, unsqueeze_dim=1,
             cos_batch=2, equal_halves=True, q_layout=Wide((0, 2, 1, 3), 128), k_layout=Wide((0, 2, 1, 3), 512),
             cos_layout=contiguous(3), position_ids=False, rotary=64),)
HFDeepSeekV3.PINS = PINS

CONVENTION = HFDeepSeekV3()
