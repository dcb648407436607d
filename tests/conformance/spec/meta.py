"""Meta's Llama convention (meta-llama/llama and llama-models, Llama 2 to 4; transformers' Llama 4):
    apply_rotary_emb(xq, xk, freqs_cis) -> (xq_out, xk_out)
    xq_ = view_as_complex(xq.float().reshape(..., -1, 2)); xq_out = view_as_real(xq_ * freqs_cis).flatten(3)
xq [b, s, hq, d], xk [b, s, hk, d], d even; freqs_cis complex64 [s, d/2] (broadcast as reshape_for_broadcast does)
or [b or 1, s, d/2] (one row per token, gathered from position ids). Pairs (2i, 2i + 1) are the real and imaginary
parts; the product is float32, rounded once to each input's dtype (type_as). New tensors; the gradient flows to xq
and xk (multiplication by conj(freqs_cis)).

The suite passes freqs_cis to the call as complex64 (ComplexCase.call) and holds it in the case as its
`view_as_real` float32 view, so that the oracle reads the table's float32 parts as given.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import pairing
from ..accuracy import bound
from ..compare import assert_bitwise, assert_undone, assert_within
from ..contract import Returned
from ..run import make_case
from ..tensors import DTYPES, Layout, channel_layouts, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, small


@dataclass
class ComplexCase(Case):
    """A case whose arguments named in `complex_args` are held as float32 [..., 2] views and passed to the call
    as complex64 (`view_as_complex`: the same memory)."""
    complex_args: tuple = ()

    def call(self, fn):
        args = {n: torch.view_as_complex(v) if n in self.complex_args and v is not None else v
                for n, v in self.args.items()}
        return Case.call(replace(self, args=args), fn)


def complex_table(arena, theta: torch.Tensor, layout: Layout, expanded_to: int = 0) -> torch.Tensor:
    """polar(1, theta) of float32 angles, as precompute_freqs_cis builds it, placed as its float32 [..., 2] view
    (`layout` over the leading dims; the pair dim stays innermost and unpadded, as view_as_complex needs).
    `expanded_to`: a [1, ...] table expanded over that many batch entries (stride 0)."""
    theta = theta.float()
    parts = torch.stack([torch.cos(theta), torch.sin(theta)], dim=-1)  # torch.polar's float32 parts
    view = arena.place(parts, Layout((*layout.order, parts.dim() - 1), (*layout.pad, 0)))
    return view.expand(expanded_to, *view.shape[1:]) if expanded_to else view


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    b: int
    s: int
    hq: int
    hk: int
    d: int
    table: str  # "seq": [s, d/2]; "one": [1, s, d/2]; "batch": [b, s, d/2]; "expanded": [1, s, d/2] expanded to b
    q_layout: Layout
    k_layout: Layout
    f_layout: Layout


def limits():
    if small():
        return dict(b=2, s=5, h=(1, 2, 3), dims=(2, 4, 6, 10, 16))
    return dict(b=4, s=512, h=(1, 2, 8, 17, 32), dims=(2, 64, 80, 128, 256))


class Meta(Convention):
    NAME = "meta"
    SIGNATURE = ("xq", "xk", "freqs_cis")
    DIFFERENTIABLE = ("xq", "xk")
    CAPS = {
        "dtypes": (DTYPES, "dtypes of xq and xk"),
        "gqa": (True, "xk with another head count than xq"),
        "per_token": (True, "freqs_cis [b or 1, s, d/2], a row per token (transformers' Llama 4), not only [s, d/2]"),
        "strides": (True, "views: xq, xk permuted and padded; freqs_cis sliced, permuted or expanded"),
        "backward": (True, "gradients for xq and xk"),
        "accuracy": ("float32", "accuracy model (accuracy.py): float32 math and one rounding, or dtype math"),
        "in_place": (False, "may write xq's and xk's memory with the result and return it (Liger's llama4 kernel)"),
        "empty": (True, "s = 0: empty xq, xk and freqs_cis (Meta's reshape of freqs_cis cannot take them)"),
    }

    def plans(self, caps):
        lim = limits()

        @st.composite
        def draw(draw):
            hq = draw(st.sampled_from(lim["h"]))
            hk = draw(st.sampled_from([h for h in lim["h"] if h <= hq])) if caps["gqa"] else hq
            b = draw(st.integers(1, lim["b"]))
            s = draw(domains.lengths((1, 3, 1, 2, lim["s"]), caps["empty"], lim["s"], small()))
            tables = ("seq", "one", "batch") + (("expanded",) if caps["strides"] else ()) if caps["per_token"] \
                else ("seq",)
            table = draw(st.sampled_from(tables))
            f_dims = 2 if table == "seq" else 3
            strides = caps["strides"]
            return Plan(draw(seeds()), draw(st.sampled_from(caps["dtypes"])), b, s, hq, hk,
                        draw(st.sampled_from(lim["dims"])), table,
                        draw(channel_layouts(4)) if strides else contiguous(4),
                        draw(channel_layouts(4)) if strides else contiguous(4),
                        draw(layouts(f_dims)) if strides and table != "expanded" else contiguous(f_dims))

        return draw()

    def build(self, p: Plan, arena) -> Case:
        xq = arena.randn((p.b, p.s, p.hq, p.d), p.dtype, p.q_layout)
        xk = arena.randn((p.b, p.s, p.hk, p.d), p.dtype, p.k_layout)
        lead = {"seq": (), "one": (1,), "batch": (p.b,), "expanded": (1,)}[p.table]
        theta = arena.angles((*lead, p.s, p.d // 2))
        freqs = complex_table(arena, theta, p.f_layout, p.b if p.table == "expanded" else 0)
        return ComplexCase(p, dict(xq=xq, xk=xk, freqs_cis=freqs), 3, arena.buffers, complex_args=("freqs_cis",))

    def effects(self, case):
        if case.caps.get("in_place"):
            return ("xq", "xk"), (Returned("xq", "xq", same=False), Returned("xk", "xk", same=False))
        return (), (Returned("xq"), Returned("xk"))

    def define(self, case, x64):
        cos, sin = per_channel(x64["freqs_cis"])
        if cos.dim() == 2:  # [s, d] -> [1, s, d]: reshape_for_broadcast's [1, s, 1, d/2]
            cos, sin = cos[None], sin[None]
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return {n: Expect(pairing.rotate(x64[n], cos, sin, True), x64[n], case.plan.d, True, case.plan.dtype)
                for n in ("xq", "xk")}


def per_channel(parts64):
    """A complex table's float [..., d/2, 2] parts -> per-channel cos, sin [..., d] (interleaved pairs)."""
    return (pairing.per_channel(parts64[..., i], True) for i in (0, 1))


# ---- the convention's own invariants ---------------------------------------------------------------------


def with_table(plan, table: str):
    """The plan with freqs_cis of kind `table` (its layout kept where the rank stays)."""
    dims = 2 if table == "seq" else 3
    keep = len(plan.f_layout.order) == dims and table != "expanded"
    return plan._replace(table=table, f_layout=plan.f_layout if keep else contiguous(dims))


def call(fn, case, **overrides):
    """fn on the case's arguments, `overrides` replacing some; xq and xk as copies where the target may write them,
    so that one case serves several calls."""
    args = {**case.args, **overrides}
    if case.caps.get("in_place"):
        args = {n: v.clone() if n in ("xq", "xk") else v for n, v in args.items()}
    with torch.no_grad():
        return replace(case, args=args).call(fn)


def _model(caps):
    return caps.get("accuracy", "float32")


def pair_norms(conv, fn, caps, plan):
    """Multiplying pair (x_2i, x_2i+1) by z = freqs_cis[.., i] scales its norm by |z| (complex64 parts: |z| is 1
    within float32 rounding): |out pair| = |z| |x pair| within the model's bound on each member."""
    case = make_case(conv, caps, plan)
    outs = call(fn, case)
    f = case.args["freqs_cis"].detach().cpu().double()
    absz = f.pow(2).sum(-1).sqrt()
    absz = absz[None] if absz.dim() == 2 else absz
    for name, out in zip(("xq", "xk"), outs, strict=True):
        x = case.args[name].detach().cpu().double()
        want = x.unflatten(-1, (-1, 2)).norm(dim=-1) * absz.unsqueeze(-2)
        got = out.detach().cpu().double().unflatten(-1, (-1, 2)).norm(dim=-1)
        # each member within bound(|x pair| scale): the pair's norm within the sum of its members' bounds
        scale = x.unflatten(-1, (-1, 2)).abs().sum(-1)
        tol = 2 * bound(want, scale, plan.dtype, _model(caps))
        bad = ~((got - want).abs() <= tol)
        assert not bad.any(), f"pair norms: {name}: {int(bad.sum())} pairs whose norm is not |z| times the input's"


def conj_undoes(conv, fn, caps, plan):
    """The call with conj(freqs_cis) on the call's results gives back xq and xk (z conj(z) = |z|^2, 1 within the
    table's float32 rounding: compare.assert_undone)."""
    case = make_case(conv, caps, plan)
    once = call(fn, case)
    conj = case.args["freqs_cis"].clone()
    conj[..., 1].neg_()  # the imaginary part negated: conj(freqs_cis), as the call receives it
    back = call(fn, case, xq=once[0], xk=once[1], freqs_cis=conj)
    for name, b in zip(("xq", "xk"), back, strict=True):
        assert_undone(f"conj(freqs_cis): {name}", b, case.args[name], plan.d, True, torch.float32, _model(caps))


def shared_rows_per_token(conv, fn, caps, plan):
    """freqs_cis [s, d/2] equals the same rows given per token: [1, s, d/2] and, repeated, [b, s, d/2] (within two
    roundings: a kernel may contract the products differently per layout)."""
    if not caps["per_token"]:
        return
    case = make_case(conv, caps, with_table(plan, "seq"))
    want = call(fn, case)
    f = case.args["freqs_cis"]
    for what, g in (("[1, s, d/2]", f[None]), ("[b, s, d/2]", f[None].expand(plan.b, *f.shape).contiguous())):
        got = call(fn, case, freqs_cis=g)
        for name, gt, w in zip(("xq", "xk"), got, want, strict=True):
            assert_within(f"freqs_cis {what}: {name}, against [s, d/2]", gt, w, w, plan.d, True, 2, _model(caps))


def batch_entry_alone(conv, fn, caps, plan):
    """Batch entry i of a call with freqs_cis [b, s, d/2] is the call on entry i alone with its rows freqs_cis[i]."""
    if not caps["per_token"]:
        return
    case = make_case(conv, caps, with_table(plan, "batch"))
    full = call(fn, case)
    i = plan.seed % plan.b
    f = case.args["freqs_cis"]
    alone = call(fn, case, xq=case.args["xq"][i:i + 1], xk=case.args["xk"][i:i + 1], freqs_cis=f[i])
    for name, a, w in zip(("xq", "xk"), alone, full, strict=True):
        assert_within(f"batch entry {i} alone with freqs_cis[{i}]: {name}", a, w[i:i + 1], w[i:i + 1], plan.d, True,
                      2, _model(caps))


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: each batch entry called alone (its own tensors, its own rows of a per-token
    freqs_cis) and the batch rolled by one give bitwise the entry's results in the whole call."""
    case = make_case(conv, caps, plan._replace(b=max(plan.b, 2)))
    xq, xk, f = case.args["xq"], case.args["xk"], case.args["freqs_cis"]
    b = xq.shape[0]
    per_batch = plan.table in ("batch", "expanded")  # [b, s, d/2]; "seq" [s, d/2] and "one" [1, s, d/2] are shared
    full = call(fn, case)
    for i in sorted({0, b - 1, plan.seed % b}):
        rows = dict(freqs_cis=f[i:i + 1].clone()) if per_batch else {}
        alone = call(fn, case, xq=xq[i:i + 1].clone(), xk=xk[i:i + 1].clone(), **rows)
        for name, a, w in zip(("xq", "xk"), alone, full, strict=True):
            assert_bitwise(f"batch invariance: {name} of entry {i} alone, against in the batch of {b}", a[0], w[i])
    rows = dict(freqs_cis=torch.roll(f, 1, 0)) if per_batch else {}
    rolled = call(fn, case, xq=torch.roll(xq, 1, 0), xk=torch.roll(xk, 1, 0), **rows)
    for name, r, w in zip(("xq", "xk"), rolled, full, strict=True):
        assert_bitwise(f"batch invariance: {name} with the batch rolled by one, against the whole call's rolled", r,
                       torch.roll(w, 1, 0))


def swap_q_k(conv, fn, caps, plan):
    """fn(xk, xq) returns fn(xq, xk)'s results swapped (equal head counts), within two roundings."""
    case = make_case(conv, caps, plan._replace(hk=plan.hq))
    q1, k1 = call(fn, case)
    q2, k2 = call(fn, case, xq=case.args["xk"], xk=case.args["xq"])
    assert_within("xq's result with xq and xk swapped, against xk's", q2, k1, k1, plan.d, True, 2, _model(caps))
    assert_within("xk's result with xq and xk swapped, against xq's", k2, q1, q1, plan.d, True, 2, _model(caps))


Meta.INVARIANTS = {
    "pair_norms": pair_norms,
    "conj_undoes": conj_undoes,
    "shared_rows_per_token": shared_rows_per_token,
    "batch_entry_alone": batch_entry_alone,
    "batch_rows_alone": batch_rows_alone,
    "swap_q_k": swap_q_k,
}
CONVENTION = Meta()


Meta.DOMAIN = {
    "xq": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("xq"), domains.spaced("xq"),
           *domains.sizes(lambda p: p.s, "empty", "s")),
    "xk": (*domains.layouts("xk"), domains.spaced("xk"), *domains.head_counts(lambda p: (p.hq, p.hk))),
    "freqs_cis": (domains.cls("[s, d/2]", lambda p, c: p.table == "seq"),
                  domains.cls("[1, s, d/2]", lambda p, c: p.table == "one", "per_token"),
                  domains.cls("[b, s, d/2]", lambda p, c: p.table == "batch", "per_token"),
                  domains.cls("[1, s, d/2] expanded over the batch", lambda p, c: p.table == "expanded",
                              off=lambda caps: not (caps["per_token"] and caps["strides"]), cap="per_token, strides"),
                  *domains.layouts("freqs_cis")),
}
