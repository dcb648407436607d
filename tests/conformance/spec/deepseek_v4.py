"""DeepSeek-V4's convention (transformers' `modeling_deepseek_v4`):
    apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1) -> x_embed
    nope, rope = x[..., :D - r], x[..., D - r:]                         r = 2w, w = cos.shape[-1]
    c, s = cos.unsqueeze(unsqueeze_dim).repeat_interleave(2, -1), sin alike
    x_embed = cat(nope, (rope.float() * c + rotate_half_interleaved(rope).float() * s).to(x.dtype))
with rotate_half_interleaved(y) = stack((-y[..., 1::2], y[..., ::2]), -1).flatten(-2). x [b, h, s, D]
(unsqueeze_dim=1) or [b, s, h, D] (2); cos, sin [b or 1, s, w] with one column per rotary pair (V4's rotary module
gives freqs.cos(), no duplicated half), in any float dtype. V4 lays a head out as [nope | rope]: the TRAILING r
channels are rotated, pair i = channels (D - r + 2i, D - r + 2i + 1) by cos[..., i] and sin[..., i]; the leading
D - r channels are passed through bitwise. float32 math, one rounding to x's dtype, whatever the tables' dtype (no
promotion, unlike transformers' Llama form). A new tensor of x's shape; the gradient flows to x (the pass-through
channels get the upstream gradient as it is). V4 rotates the attention output back with the same call and -sin.

The shared accuracy helpers (pairing.py, accuracy.py, compare.py) take the rotated channels first and the copies
after them. So the expectation is stated on x's channels reordered rope first (`to_front`: the trailing r channels,
then the leading D - r): `read` reorders an output alike, the expectation's source is the reordered input, and the
gradient's scale and copied channels are written back to x's order (`grad_scale`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import pairing
from ..compare import assert_bitwise, assert_undone, assert_within
from ..contract import Returned
from ..run import make_case
from ..tensors import DTYPES, Layout, Wide, contiguous, layouts, place_heads, seeds
from . import Case, Convention, Expect, domains, small
from .hf import batch_rows_alone, call, refusing, tables_batch_broadcast, unsqueeze_dim_transposed, unsqueeze_domain
from .hf_single import heads_together


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    table_dtype: torch.dtype
    b: int
    h: int
    s: int
    d: int  # D, the head dim
    w: int  # the tables' width: one column per rotary pair, r = 2w <= D
    unsqueeze_dim: int
    cos_batch: int
    x_layout: object  # a tensors.Layout, a Wide, or "expanded" (one head broadcast over h: stride 0)
    cos_layout: object  # a tensors.Layout, or "expanded" (a [1, s, w] table expanded over the batch)
    explicit_defaults: bool = False  # unsqueeze_dim passed where it holds its default


def to_front(t, rot: int):
    """x's channels rope first: [..., D] with its trailing `rot` channels moved ahead of the leading D - rot (the
    shared helpers' order: rotated channels, then copies)."""
    n = t.shape[-1] - rot
    return torch.cat([t[..., n:], t[..., :n]], dim=-1) if n else t


def from_front(t, rot: int):
    """The inverse of `to_front`."""
    n = t.shape[-1] - rot
    return torch.cat([t[..., rot:], t[..., :rot]], dim=-1) if n else t


def rot_of(case) -> int:
    return 2 * case.args["cos"].shape[-1]


# (D, w): V4's head (512 = 448 nope + 64 rope), rotary widths within powers of two, the whole head rotated (r = D),
# one pair (w = 1), heads of no power of two, odd heads (an odd count of leading channels)
HEADS_SMALL = ((10, 2), (6, 3), (8, 1), (4, 2), (12, 4), (9, 2), (2, 1), (16, 4), (5, 1), (8, 4))
HEADS_DEVICE = ((512, 32), (128, 32), (128, 64), (80, 8), (80, 40), (512, 1), (64, 1), (2, 1), (96, 16), (81, 8),
                (192, 32), (512, 256))


class DeepSeekV4(Convention):
    NAME = "deepseek-v4"
    SIGNATURE = ("x", "cos", "sin", "unsqueeze_dim")
    OPTIONAL = {"unsqueeze_dim": 1}
    DIFFERENTIABLE = ("x",)
    CAPS = {
        "dtypes": (DTYPES, "dtypes of x"),
        "float32_tables": (True, "cos/sin in float32 with 16-bit x (the result stays x's dtype)"),
        "mixed_tables": (True, "cos/sin in the other 16-bit dtype than x, or in a 16-bit dtype with float32 x (the "
                               "result stays x's dtype)"),
        "unsqueeze_dim": ((1, 2), "the layouts: 1 for [b, h, s, D], 2 for [b, s, h, D]"),
        "cos_batch": (True, "cos/sin with a batch of b (one table per sequence), not only 1"),
        "strides": (True, "views: permuted, sliced (a head slice, a head within a wider row) and expanded x; "
                          "permuted, sliced and expanded tables"),
        "backward": (True, "gradients for x"),
        "accuracy": ("float32", "accuracy model (accuracy.py): float32 math and one rounding, or dtype math"),
        "empty": (True, "s = 0: empty x, cos and sin"),
        "bad_input": (True, "tables wider than D / 2 columns or empty, tables of another shape than sin or than the "
                            "call's batch and tokens, an unsqueeze_dim other than 1 or 2: refused with a TypeError or "
                            "ValueError whose message starts with the argument at fault, before anything is written"),
    }

    def plans(self, caps):
        lim = dict(b=2, h=3, s=5, heads=HEADS_SMALL, before=(1, 3), after=(0, 2)) if small() else \
            dict(b=4, h=16, s=256, heads=HEADS_DEVICE, before=(64, 3, 448), after=(0, 1, 64))
        strides = caps["strides"]

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            table_dtype = draw(st.sampled_from(domains.table_dtypes(dtype, caps)))
            d, w = draw(st.sampled_from(lim["heads"]))
            kind = draw(st.sampled_from(("layout", "wide", "layout", "expanded"))) if strides else "layout"
            if kind == "wide":
                x_layout = Wide(tuple(draw(st.permutations(range(3)))) + (3,), draw(st.sampled_from(lim["before"])),
                                draw(st.sampled_from(lim["after"])))
            else:
                x_layout = draw(layouts(4)) if kind == "layout" and strides else \
                    "expanded" if kind == "expanded" else contiguous(4)
            # one head often (V4's KV); an expanded x is one head broadcast over two or more
            h = 1 if kind != "expanded" and draw(st.booleans()) else draw(st.integers(2, lim["h"]))
            b = draw(st.integers(1, lim["b"]))
            # decode (s = 1) often; s = 0 where the target takes it
            s = draw(domains.lengths((1, 3, 1, 2, 1, lim["s"], 1), caps.get("empty", False), lim["s"], small()))
            cos_layout = draw(st.one_of(layouts(3, padded_dims=(1, 2)), st.just("expanded"))) if strides \
                else contiguous(3)
            return Plan(draw(seeds()), dtype, table_dtype, b, h, s, d, w,
                        draw(st.sampled_from(caps["unsqueeze_dim"])),
                        draw(st.sampled_from((1, b))) if caps["cos_batch"] else 1,
                        x_layout, cos_layout, domains.explicit_defaults(draw, caps))

        return draw()

    def heads_shape(self, p: Plan, h: int = None) -> tuple:
        h = p.h if h is None else h
        return (p.b, h, p.s, p.d) if p.unsqueeze_dim == 1 else (p.b, p.s, h, p.d)

    def build(self, p: Plan, arena) -> Case:
        x = self.heads(p, arena)
        return Case(p, dict(x=x, **self.tables(p, arena), unsqueeze_dim=p.unsqueeze_dim), 3, arena.buffers)

    def heads(self, p: Plan, arena):
        """x: N(0, 1) values laid out as p.x_layout says; a Wide one within NaN-filled wider rows, an expanded one a
        single head's values broadcast over the heads (stride 0)."""
        lay = p.x_layout
        if lay == "expanded":
            one = arena.randn(self.heads_shape(p, 1), p.dtype)
            return one.expand(self.heads_shape(p))
        return place_heads(arena, self.heads_shape(p), p.dtype, lay)

    def tables(self, p: Plan, arena) -> dict:
        """cos and sin [b or 1, s, w]: one angle per pair, each its own (a table read per channel, or as
        cat(w, w), reads other angles)."""
        theta = arena.angles((p.cos_batch, p.s, p.w))
        out = {}
        for name, fn in (("cos", torch.cos), ("sin", torch.sin)):
            values = fn(theta).to(p.table_dtype)
            if p.cos_layout == "expanded":
                out[name] = arena.place(values[:1]).expand(p.b, p.s, p.w)
            else:
                out[name] = arena.place(values, p.cos_layout)
        return out

    def effects(self, case):
        return (), Returned("x")

    def define(self, case, x64):
        p = case.plan
        rot = rot_of(case)
        cos, sin = (pairing.per_channel(x64[n], True).unsqueeze(p.unsqueeze_dim) for n in ("cos", "sin"))
        source = to_front(x64["x"], rot)
        return {"x": Expect(pairing.rotate(source, cos, sin, True), source, rot, True, p.dtype)}

    def read(self, case, name, t):
        return to_front(t, rot_of(case))

    def grad_scale(self, case, arg, up64, expect):
        """x's gradient in x's order: the scale of the upstream gradient's pairs (reordered rope first, as `read`
        gives it) written back to x's order, and the leading D - r channels copies of the upstream gradient."""
        e = expect[arg]
        scale = from_front(pairing.pair_scale(up64[arg], e.rot, True), e.rot)
        d = scale.shape[-1]
        return scale, torch.arange(d) < d - e.rot

    def backward_plan(self, plan, caps):
        """An expanded x cannot be written as the view of a tensor in the graph (its elements alias): the
        backward property takes it contiguous."""
        return plan._replace(x_layout=contiguous(4)) if plan.x_layout == "expanded" else plan

    def outside(self, plan, caps):
        if plan.dtype not in caps["dtypes"] or plan.table_dtype not in domains.table_dtypes(plan.dtype, caps):
            return f"{plan.dtype} x with {plan.table_dtype} tables"
        if plan.unsqueeze_dim not in caps["unsqueeze_dim"]:
            return f"unsqueeze_dim={plan.unsqueeze_dim}"
        if plan.cos_batch > 1 and not caps["cos_batch"]:
            return "per-sequence tables (cos_batch)"
        if plan.s == 0 and not caps["empty"]:
            return "s = 0 (empty)"
        if not caps["strides"] and (plan.x_layout != contiguous(4) or plan.cos_layout != contiguous(3)):
            return "views (strides)"
        return None


# ---------------------------------------------------------------------------------------------- invariants
# Oracle-free properties, or relations to transformers' GLM form that pin where each channel comes from.

def _replace_nope(x, n: int, fill: float):
    """x with its leading n channels `fill`, in x's layout where that can be written (an expanded x: the head it
    broadcasts, refilled and broadcast again)."""
    if any(st_ == 0 and k > 1 for k, st_ in zip(x.shape, x.stride(), strict=True)):
        dims = [i for i, (k, st_) in enumerate(zip(x.shape, x.stride(), strict=True)) if st_ == 0 and k > 1]
        one = x.narrow(dims[0], 0, 1).detach().clone()
        one[..., :n] = fill
        return one.expand(x.shape)
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    y.copy_(x.detach())
    y[..., :n] = fill
    return y


def nope_untouched(conv, fn, caps, plan):
    """The leading D - r channels of the result are x's, bitwise, and their gradient is the upstream gradient's,
    bitwise (transformers concatenates x's nope slice as it is); the rotated channels read none of them: x with its
    leading channels NaN gives the same trailing channels, bitwise."""
    case = make_case(conv, caps, plan)
    x, rot = case.args["x"], rot_of(case)
    n = x.shape[-1] - rot
    with torch.no_grad():
        (got,) = call(fn, case)
    assert_bitwise(f"the leading {n} channels (D - r), against x's", got[..., :n], x[..., :n])
    if caps.get("backward", True) and got.numel():
        leaf = x.detach().clone().requires_grad_()
        (out,) = call(fn, case, x=leaf)
        gen = torch.Generator().manual_seed(plan.seed + 6)
        up = torch.randn(tuple(out.shape), generator=gen, dtype=torch.float64).to(out.dtype).to(out.device)
        out.backward(up)
        assert_bitwise(f"the gradient of the leading {n} channels, against the upstream gradient's",
                       leaf.grad[..., :n], up[..., :n])
    if n == 0:
        return
    with torch.no_grad():
        (other,) = call(fn, case, x=_replace_nope(x, n, float("nan")))
    assert_bitwise(f"the trailing {rot} channels with x's leading {n} NaN, against with x's values",
                   other[..., n:], got[..., n:])


def inverse(conv, fn, caps, plan):
    """V4's inverse rotation of the attention output: the call with (cos, -sin) on the result gives back x, within
    two roundings and the tables' rounding on the rotated channels (compare.assert_undone, on the channels reordered
    rope first), and bitwise on the leading D - r (copied twice)."""
    case = make_case(conv, caps, plan)
    rot = rot_of(case)
    with torch.no_grad():
        (once,) = call(fn, case)
        (back,) = call(fn, case, x=once, sin=-case.args["sin"])
    assert_undone("inverse: x", to_front(back, rot), to_front(case.args["x"], rot), rot, True,
                  case.args["cos"].dtype, caps.get("accuracy", "float32"))


def _quarter_tables(case, seed):
    """cos/sin of the case's shape whose every entry is a quarter turn, (cos, sin) one of (1, 0), (0, 1), (-1, 0),
    (0, -1), drawn per pair."""
    cos = case.args["cos"]
    turn = torch.randint(0, 4, tuple(cos.shape), generator=torch.Generator().manual_seed(seed))
    c = torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=torch.float64)[turn]
    s = torch.tensor([0.0, 1.0, 0.0, -1.0], dtype=torch.float64)[turn]
    return c.to(cos.dtype).to(cos.device), s.to(cos.dtype).to(cos.device)


def glm_form(x_rot, cos, sin, dim: int, math):
    """transformers' GLM form (spec/hf_glm.py) on a whole-head x_rot [..., r] with GLM's tables cat(cos, cos)
    [..., 2w] (the first half read, each column repeated for its pair), in `math`: interleaved pairs (2i, 2i + 1)."""
    w = cos.shape[-1]
    c, s = (torch.cat([t, t], -1).unsqueeze(dim)[..., :w].repeat_interleave(2, -1).to(math) for t in (cos, sin))
    y = x_rot.to(math)
    return y * c + torch.stack((-y[..., 1::2], y[..., ::2]), -1).flatten(-2) * s


def equals_glm_on_slice(conv, fn, caps, plan):
    """The call is x's leading D - r channels as they are, then transformers' GLM form (interleaved pairs, GLM's
    tables cat(cos, cos)) on x's trailing r channels, rounded to x's dtype. Bitwise on tables of quarter turns
    drawn per pair (each product then exactly an input, its negation or zero: every output is one input channel
    exactly, in any order of evaluation, fused multiply-adds and 16-bit math included): this pins the slice, the
    pairing, the sign and the table column of every channel. On the case's tables within two roundings of that
    form in float32 math (each side within its accuracy model of the same value)."""
    case = make_case(conv, caps, plan)
    x, rot, dim = case.args["x"], rot_of(case), plan.unsqueeze_dim
    n = x.shape[-1] - rot
    c, s = _quarter_tables(case, plan.seed + 4)
    with torch.no_grad():
        (got,) = call(fn, case, cos=c, sin=s)
        want = glm_form(x[..., n:].cpu(), c.cpu(), s.cpu(), dim, torch.float64).to(x.dtype)
        assert_bitwise("x on quarter-turn tables, against x's leading channels and GLM's form on its trailing ones",
                       got, torch.cat([x[..., :n].cpu(), want], -1))
        (got,) = call(fn, case)
        want = glm_form(x[..., n:], case.args["cos"], case.args["sin"], dim, torch.float32).to(x.dtype)
        want = torch.cat([x[..., :n], want], -1)
    assert_within("x, against x's leading channels and GLM's form in float32 on its trailing ones",
                  to_front(got, rot), to_front(want, rot), to_front(x, rot), rot, True, 2,
                  caps.get("accuracy", "float32"))


def bad_inputs(case) -> list:
    """(names a message may start with, argument overrides) for each bad call the case gives: tables wider than
    D / 2 columns (r = 2w > D) and empty (w = 0), sin of another shape than cos, tables of rank 2, for another
    sequence length, for a batch neither 1 nor b, an unsqueeze_dim other than 1 or 2."""
    p, a = case.plan, case.args
    cos, sin = a["cos"], a["sin"]
    cb, w = cos.shape[0], p.w

    def wider(t, k):
        return torch.cat([t, t.new_full((*t.shape[:-1], k), 0.5)], dim=-1)

    def full(shape, v):
        return cos.new_full(shape, v)

    over = p.d // 2 + 1 - w  # columns to add for a width of D // 2 + 1: 2w > D
    return [(("cos",), dict(cos=wider(cos, over), sin=wider(sin, over))),
            (("cos",), dict(cos=cos[..., :0], sin=sin[..., :0])),
            (("sin", "cos"), dict(sin=wider(sin, 1))),
            (("cos",), dict(cos=cos[0], sin=sin[0])),
            (("cos", "sin"), dict(cos=full((cb, p.s + 1, w), 0.6), sin=full((cb, p.s + 1, w), 0.8))),
            (("cos", "sin"), dict(cos=full((p.b + 1, p.s, w), 0.6), sin=full((p.b + 1, p.s, w), 0.8))),
            (("unsqueeze_dim",), dict(unsqueeze_dim=0)),
            (("unsqueeze_dim",), dict(unsqueeze_dim=3))]


refuses_bad_input = refusing(bad_inputs)


DeepSeekV4.INVARIANTS = {
    "nope_untouched": nope_untouched,
    "inverse": inverse,
    "batch_rows_alone": batch_rows_alone,
    "equals_glm_on_slice": equals_glm_on_slice,
    "unsqueeze_transposed": unsqueeze_dim_transposed,
    "tables_batch_broadcast": tables_batch_broadcast,
    "heads_together": heads_together,
    "refuses_bad_input": refuses_bad_input,
}


def _schedule(case):
    """transformers' V4 expression as its model runs it: float32 products and sum (PyTorch's operations, no fused
    multiply-add), one rounding to x's dtype."""
    x, dim = case.args["x"], case.plan.unsqueeze_dim
    n = x.shape[-1] - rot_of(case)
    with torch.no_grad():
        rope = glm_form(x[..., n:], case.args["cos"], case.args["sin"], dim, torch.float32).to(x.dtype)
        return {"x": torch.cat([x[..., :n], rope], -1)}


# --rope-schedule float32: transformers' own evaluation (float32 math, one rounding)
DeepSeekV4.SCHEDULES = {"float32": _schedule}


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


def tables_domain(arg: str = "cos") -> tuple:
    """cos's (and sin's) classes: the dtype pairing with x, the layout, the batch, the width against the head."""
    def pair(p):
        return p.dtype, p.table_dtype

    return (*domains.pairings(pair),
            domains.table_16bit_float32_input(pair, "mixed_tables"),
            *domains.layouts(arg, expanded=True),
            domains.cls("batch 1", lambda p, c: p.cos_batch == 1),
            domains.cls("batch b > 1", lambda p, c: p.cos_batch > 1, "cos_batch"),
            domains.cls("one pair (w = 1)", lambda p, c: p.w == 1),
            domains.cls("several pairs", lambda p, c: p.w > 1),
            domains.cls("2w = D: nothing passed through", lambda p, c: 2 * p.w == p.d),
            domains.cls("2w < D: leading channels passed through", lambda p, c: 2 * p.w < p.d))


DeepSeekV4.DOMAIN = {
    "x": (*domains.dtypes(lambda p: p.dtype),
          *domains.sizes(lambda p: p.s, "empty", "s"),
          *domains.layouts("x", expanded=True),
          domains.cls("a head within a wider row", lambda p, c: isinstance(p.x_layout, Wide), "strides"),
          domains.cls("one head (V4's KV)", lambda p, c: p.h == 1),
          domains.cls("several heads", lambda p, c: p.h > 1),
          domains.cls("batch 1", lambda p, c: p.b == 1),
          domains.cls("batch > 1", lambda p, c: p.b > 1),
          domains.cls("head dim a power of two", lambda p, c: _pow2(p.d)),
          domains.cls("head dim not a power of two", lambda p, c: not _pow2(p.d)),
          domains.cls("odd head dim", lambda p, c: p.d % 2 == 1)),
    "cos": tables_domain(),
    "sin": tables_domain("sin"),
    "unsqueeze_dim": unsqueeze_domain(),
}

# V4's attention at decode, bfloat16 with bfloat16 tables, one table per sequence: the KV's one head of 512 channels
# (448 nope, 64 rope) as [b, h, s, D]; q's heads as [b, s, h, D], a head slice of a wider projection, float32 tables
PINS = (Plan(seed=5, dtype=torch.bfloat16, table_dtype=torch.bfloat16, b=2, h=1, s=1, d=512, w=32, unsqueeze_dim=1,
             cos_batch=2, x_layout=contiguous(4), cos_layout=contiguous(3)),
        Plan(seed=6, dtype=torch.bfloat16, table_dtype=torch.float32, b=2, h=4, s=3, d=512, w=32, unsqueeze_dim=2,
             cos_batch=1, x_layout=Layout((0, 1, 2, 3), (0, 0, 3, 0)), cos_layout=contiguous(3)))
DeepSeekV4.PINS = PINS

CONVENTION = DeepSeekV4()
