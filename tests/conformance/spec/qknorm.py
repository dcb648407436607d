"""QK-RMSNorm fused with RoPE, training form (`rope.qknorm.apply`; Qwen3, Gemma 3, OLMo 2):
    apply(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False, gemma=False) -> (q', k')
q [b, hq, s, d] (unsqueeze_dim=1) or [b, s, hq, d] (2), k likewise with hk heads; weights [d]; cos, sin [b or 1, s,
rot] (rot <= d even: the first rot channels rotate, the norm spans all d). Per head: y = R(x r w), r = (mean(x^2) +
eps)^(-1/2), w -> 1 + w with gemma; new tensors of q's dtype; gradients for q, k and both weights. The float64
definition and the accuracy model are in qknorm_math.py.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import accuracy, pairing
from ..compare import assert_bitwise
from ..contract import Returned
from ..run import make_case
from ..tensors import DTYPES, Layout, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, head_and_rotary, qknorm_math, small

EPS_VALUES = (1e-6, 1e-5, 0.25, 2.0)  # realistic, and large enough that eps's place in the formula shows
MAGNITUDES = (1.0, 0.05, 20.0)  # of x: eps dominates mean(x^2) at 0.05, not at 20


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    weight_dtype: torch.dtype
    table_dtype: torch.dtype
    b: int
    hq: int
    hk: int
    s: int
    d: int
    rot: int
    unsqueeze_dim: int
    cos_batch: int
    interleaved: bool
    gemma: bool
    eps: float
    magnitude: float
    q_layout: Layout
    k_layout: Layout
    cos_layout: object  # a Layout, or "expanded" ([1, s, rot] expanded over the batch)
    explicit_defaults: bool = False  # optional arguments passed where they hold their defaults


class QKNorm(Convention):
    NAME = "qknorm"
    SIGNATURE = ("q", "k", "q_weight", "k_weight", "cos", "sin", "eps", "unsqueeze_dim", "interleaved", "gemma")
    DIFFERENTIABLE = ("q", "k", "q_weight", "k_weight")
    CAPS = {
        "dtypes": (DTYPES, "dtypes of q and k"),
        "weight_dtypes": ("any", "the weights' dtype: 'any' float dtype (float32 with 16-bit q), or 'q' (q's only)"),
        "unsqueeze_dim": ((1, 2), "the layouts: 1 for [b, h, s, d], 2 for [b, s, h, d]"),
        "partial": (True, "rot < d (cos/sin narrower than the head), and odd d"),
        "interleaved": (True, "the interleaved keyword (pairs (2i, 2i + 1))"),
        "gemma": (True, "the gemma keyword (weights 1 + w)"),
        "strides": (True, "views: permuted, padded and expanded tensors"),
        "accuracy": ("float32", "accuracy model (accuracy.py, qknorm_math.py)"),
        "float32_tables": (True, "cos/sin in float32 with 16-bit q"),
        "mixed_tables": (True, "cos/sin in the other 16-bit dtype than q (float16 with bfloat16, the reverse), or "
                               "16-bit with float32 q"),
        "empty": (True, "s = 0: empty q, k, cos and sin"),
    }
    OPTIONAL = {"eps": 1e-6, "unsqueeze_dim": 1, "interleaved": False, "gemma": False}

    def plans(self, caps):
        lim = dict(b=2, h=3, s=4, dims=(2, 4, 6, 7, 8, 10, 16)) if small() else \
            dict(b=2, h=17, s=128, dims=(2, 6, 64, 80, 81, 128, 256))

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            d, rot = head_and_rotary(draw, lim["dims"], caps["partial"])
            hq = draw(st.integers(1, lim["h"]))
            b, s = draw(st.integers(1, lim["b"])), draw(st.integers(1, lim["s"]))
            strides = caps["strides"]
            return Plan(
                draw(seeds()), dtype, draw(st.sampled_from(domains.any_dtype(dtype)))
                if caps["weight_dtypes"] == "any" else dtype,
                draw(st.sampled_from(domains.table_dtypes(dtype, caps))),
                b, hq, draw(st.integers(1, hq)), s, d, rot, draw(st.sampled_from(caps["unsqueeze_dim"])),
                draw(st.sampled_from((1, b))), caps["interleaved"] and draw(st.booleans()),
                caps["gemma"] and draw(st.booleans()), draw(st.sampled_from(EPS_VALUES)),
                draw(st.sampled_from(MAGNITUDES)), draw(layouts(4)) if strides else contiguous(4),
                draw(layouts(4)) if strides else contiguous(4),
                draw(st.one_of(layouts(3, padded_dims=(1, 2)), st.just("expanded"))) if strides else contiguous(3))

        return domains.with_explicit(domains.with_empty(draw(), caps, domains.zeroed, ("s",)), caps)

    def build(self, p: Plan, arena, weights=None) -> Case:
        def heads(h):
            shape = (p.b, h, p.s, p.d) if p.unsqueeze_dim == 1 else (p.b, p.s, h, p.d)
            return torch.randn(shape, generator=arena.gen, dtype=torch.float64) * p.magnitude

        q = arena.place(heads(p.hq).to(p.dtype), p.q_layout)
        k = arena.place(heads(p.hk).to(p.dtype), p.k_layout)
        ws = [arena.randn((p.d,), p.weight_dtype) for _ in range(2)] if weights is None else \
            [arena.place(w.to(p.weight_dtype)) for w in weights]
        theta = pairing.per_channel(arena.angles((p.cos_batch, p.s, p.rot // 2)), p.interleaved)
        tables = []
        for fn in (torch.cos, torch.sin):
            values = fn(theta).to(p.table_dtype)
            tables.append(arena.place(values[:1]).expand(p.b, p.s, p.rot) if p.cos_layout == "expanded" else
                          arena.place(values, p.cos_layout))
        args = dict(q=q, k=k, q_weight=ws[0], k_weight=ws[1], cos=tables[0], sin=tables[1], eps=p.eps,
                    unsqueeze_dim=p.unsqueeze_dim)
        if p.interleaved:
            args["interleaved"] = True
        if p.gemma:
            args["gemma"] = True
        return Case(p, args, 6, arena.buffers)

    def effects(self, case):
        return (), (Returned("q"), Returned("k"))

    def tables(self, case, x64):
        ud = case.plan.unsqueeze_dim
        return x64["cos"].unsqueeze(ud), x64["sin"].unsqueeze(ud)

    def define(self, case, x64):
        p = case.plan
        cos, sin = self.tables(case, x64)
        return {name: Expect(qknorm_math.norm_rope(x64[name], x64[f"{name}_weight"], p.eps, p.gemma, cos, sin,
                                                   p.interleaved),
                             qknorm_math.forward_source(x64[name], x64[f"{name}_weight"], p.eps, p.gemma, p.rot,
                                                        p.interleaved), p.d, False, p.dtype)
                for name in ("q", "k")}

    def grad_scale(self, case, arg, up64, expect):
        p = case.plan
        name = arg.removesuffix("_weight")
        x, w = (case.args[n].detach().cpu().double() for n in (name, f"{name}_weight"))
        if arg.endswith("_weight"):
            scale = qknorm_math.weight_grad_scale(up64[name], x, w, p.eps, p.gemma, p.rot, p.interleaved)
        else:
            scale = qknorm_math.input_grad_scale(up64[name], x, w, p.eps, p.gemma, p.rot, p.interleaved)
        return scale, torch.zeros(p.d, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------- invariants

def _call(fn, case, **overrides):
    return case.call(fn) if not overrides else Case(case.plan, {**case.args, **overrides}, case.positional).call(fn)


def _uniform_case(conv, caps, plan):
    """The plan with eps -> 0 (1e-30: below float32's resolution of mean(x^2) for every drawn magnitude) and every
    weight c (Gemma: w = c - 1); returns (case, c)."""
    c = 0.5 + (plan.seed % 7) / 4  # 0.5 .. 2: exact in every dtype
    plan = plan._replace(eps=1e-30)
    w = torch.full((plan.d,), c - 1.0 if plan.gemma else c, dtype=torch.float64)
    case = conv.build(plan, _arena(plan), (w, w))
    case.caps = caps
    return case, c


def _arena(plan):
    from ..tensors import Arena

    return Arena(plan.seed)


def unit_rms_limit(conv, fn, caps, plan):
    """w = 1 (Gemma: w = 0) and eps -> 0: RoPE of the unit-RMS vector x / rms(x), within the forward model."""
    case, _ = _uniform_case(conv, caps, plan._replace(seed=plan.seed - plan.seed % 7 + 2))  # c = 1
    got = case.call(fn)
    cos, sin = (case.args[n].detach().cpu().double().unsqueeze(plan.unsqueeze_dim) for n in ("cos", "sin"))
    for name, g in zip(("q", "k"), got, strict=True):
        x = case.args[name].detach().cpu().double()
        unit = x / x.square().mean(-1, keepdim=True).sqrt()
        want = pairing.rotate(unit, cos, sin, plan.interleaved)
        scale = qknorm_math.k_fwd(plan.d) * qknorm_math.elementwise_scale(unit, plan.rot, plan.interleaved)
        accuracy.check(f"w = 1, eps -> 0: {name} against RoPE of x / rms(x)", g, want, scale, plan.dtype,
                       caps.get("accuracy", "float32"))


def rotation_preserves_norm(conv, fn, caps, plan):
    """Every weight c and eps -> 0: each output head holds sum_i y_i^2 = d c^2 (oracle-free). The rotation keeps each
    pair's y_a^2 + y_b^2 = (c n_a)^2 + (c n_b)^2, the tail is c n, and sum n^2 = d when eps -> 0. Each element errs by
    at most e S (S its pair's |c n_a| + |c n_b|, e = EPS[D] + 2 K_FWD 2^-20, the forward model), and the tables'
    cos^2 + sin^2 = 1 within 2 EPS[T]: |sum y^2 - d c^2| <= (4 e (1 + e) + 2 EPS[T]) d c^2 (Cauchy-Schwarz on
    sum |y| S <= 2 sum (c n)^2)."""
    case, c = _uniform_case(conv, caps, plan)
    e = accuracy.EPS[plan.dtype] + 2 * qknorm_math.k_fwd(plan.d) * accuracy.F32_EVAL
    if caps.get("accuracy", "float32") == "dtype":  # EPS[D] (|y| + K_FWD S) with |y| <= S
        e = accuracy.EPS[plan.dtype] * (1 + qknorm_math.k_fwd(plan.d))
    tol = (4 * e * (1 + e) + 2 * accuracy.EPS[plan.table_dtype]) * plan.d * c * c
    for name, y in zip(("q", "k"), case.call(fn), strict=True):
        energy = y.detach().cpu().double().square().sum(-1)
        bad = ~((energy - plan.d * c * c).abs() <= tol)
        assert not bad.any(), (f"norm: {name}'s heads hold sum y^2 = {energy[bad][0].item()!r}, not d c^2 = "
                               f"{plan.d * c * c!r} (w = {c}, eps -> 0; tolerance {tol:.3g})")


def equals_rope_of_norm(conv, fn, caps, plan):
    """The fused result against a plain RoPE (the suite's float64 rotation) of the float64 RMSNorm(x) w rounded to
    float32: within the fused forward's model (the target's accuracy model) plus that rounding and a float32
    rotation's."""
    case = make_case(conv, caps, plan)
    got = case.call(fn)
    ud = plan.unsqueeze_dim
    a = {n: qknorm_math.norm(case.args[n].detach().cpu(), case.args[f"{n}_weight"].detach().cpu(), plan.eps,
                             plan.gemma)[2] for n in ("q", "k")}
    cos, sin = (t.detach().cpu().unsqueeze(ud) for t in (case.args["cos"], case.args["sin"]))
    want = tuple(pairing.rotate(a[n].float(), cos, sin, plan.interleaved) for n in ("q", "k"))
    for name, g, w in zip(("q", "k"), got, want, strict=True):
        s = qknorm_math.elementwise_scale(a[name], plan.rot, plan.interleaved)
        w64 = w.detach().cpu().double()
        tol = (accuracy.bound(w64, qknorm_math.k_fwd(plan.d) * s, plan.dtype, caps.get("accuracy", "float32"))
               + accuracy.bound(w64, s, torch.float32))
        err = (g.detach().cpu().double() - w64).abs()
        bad = ~(err <= tol)
        assert not bad.any(), f"{name}: {int(bad.sum())} elements beyond the rounding of a plain RoPE of RMSNorm(x) w"


def q_k_independent(conv, fn, caps, plan):
    """q's result does not depend on k or k_weight: another k of the same shape and another weight leave it bitwise
    unchanged; a k with another head count may change the launch's tiles and with them the order of the norm's
    float32 sum, which the accuracy model allows in any order (qknorm_math): within the forward model of q's own."""
    case = make_case(conv, caps, plan)
    q1 = case.call(fn)[0]
    gen = torch.Generator().manual_seed(plan.seed + 3)
    k = case.args["k"]
    w2 = torch.randn(plan.d, generator=gen, dtype=torch.float64).to(plan.weight_dtype).to(k.device)
    k_same = torch.randn(k.shape, generator=gen, dtype=torch.float64).to(k.dtype).to(k.device)
    assert_bitwise("q after k's values and k_weight were changed", _call(fn, case, k=k_same, k_weight=w2)[0], q1)
    shape = list(k.shape)
    shape[1 if plan.unsqueeze_dim == 1 else 2] = plan.hq + 1
    k2 = torch.randn(shape, generator=gen, dtype=torch.float64).to(k.dtype).to(k.device)
    q2 = _call(fn, case, k=k2, k_weight=w2)[0].detach().cpu().double()
    x = case.args["q"].detach().cpu().double()
    s = qknorm_math.elementwise_scale(qknorm_math.norm(x, case.args["q_weight"].detach().cpu(), plan.eps,
                                                       plan.gemma)[2], plan.rot, plan.interleaved)
    # both results within one model of the float64 value: within twice of each other
    q1 = q1.detach().cpu().double()
    tol = 2 * accuracy.bound(q1, qknorm_math.k_fwd(plan.d) * s, plan.dtype, caps.get("accuracy", "float32"))
    bad = ~((q2 - q1).abs() <= tol)
    assert not bad.any(), f"q after k's head count changed: {int(bad.sum())} elements beyond the norm's rounding"


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise, forward: each sequence called alone (its own q and k, its rows of per-sequence
    tables) and the batch rolled by one give bitwise its results in the whole call. The norm's sum runs over one
    head, so nothing of another sequence may enter it; the weights' gradients are a sum over the batch by
    definition, so the backward is not compared here."""
    b = max(plan.b, 2)
    case = make_case(conv, caps, plan._replace(b=b, cos_batch=b if plan.cos_batch > 1 else 1))
    q, k = case.args["q"], case.args["k"]
    tables = [n for n in ("cos", "sin") if case.args[n].shape[0] == b]
    with torch.no_grad():
        whole = _call(fn, case)
        for i in sorted({0, b - 1, plan.seed % b}):
            rows = {n: case.args[n][i:i + 1].clone() for n in tables}
            alone = _call(fn, case, q=q[i:i + 1].clone(), k=k[i:i + 1].clone(), **rows)
            for name, a, w in zip(("q", "k"), alone, whole, strict=True):
                assert_bitwise(f"batch invariance: {name} of sequence {i} alone, against in the batch of {b}", a[0],
                               w[i])
        rows = {n: torch.roll(case.args[n], 1, 0) for n in tables}
        rolled = _call(fn, case, q=torch.roll(q, 1, 0), k=torch.roll(k, 1, 0), **rows)
    for name, r, w in zip(("q", "k"), rolled, whole, strict=True):
        assert_bitwise(f"batch invariance: {name} with the batch rolled by one, against the whole call's rolled", r,
                       torch.roll(w, 1, 0))


QKNorm.INVARIANTS = {
    "batch_rows_alone": batch_rows_alone,
    "unit_rms_limit": unit_rms_limit,
    "rotation_preserves_norm": rotation_preserves_norm,
    "equals_rope_of_norm": equals_rope_of_norm,
    "q_k_independent": q_k_independent,
}
def _eager(case):
    """--rope-schedule eager: Qwen3RMSNorm of q and of k (Gemma3RMSNorm with gemma), the mean as PyTorch's CUDA
    kernels reduce it (`qknorm_math.eager_variance`), then transformers' rotation, each operation in the dtypes
    eager PyTorch gives it (partial rotary: the rotated channels, then the rest, concatenated)."""
    p = case.plan
    cos, sin = (case.args[n].unsqueeze(p.unsqueeze_dim) for n in ("cos", "sin"))
    partner, sign = pairing.partner_and_sign(p.rot, p.interleaved)
    out = {}
    with torch.no_grad():
        for name in ("q", "k"):
            x, w = case.args[name], case.args[f"{name}_weight"]
            h = x.to(torch.float32)
            h = h * torch.rsqrt(qknorm_math.eager_variance(h) + p.eps)
            y = (h * (1.0 + w.float())).type_as(x) if p.gemma else w * h.to(x.dtype)
            head = y[..., :p.rot]
            turned = head[..., partner.to(head.device)] * sign.to(head.device, head.dtype)  # rotate_half: exact
            out[name] = torch.cat([head * cos + turned * sin, y[..., p.rot:]], dim=-1)
    return out


QKNorm.SCHEDULES = {"eager": _eager}
CONVENTION = QKNorm()


def _weights() -> tuple:
    return domains.pairings(lambda p: (p.dtype, p.weight_dtype), "", "weight_dtypes",
                            mixed_off=lambda caps: caps["weight_dtypes"] != "any",
                            float32_off=lambda caps: caps["weight_dtypes"] != "any")


def _tables(arg: str) -> tuple:
    def pair(p):
        return p.dtype, p.table_dtype

    return (*domains.pairings(pair), domains.table_16bit_float32_input(pair, "mixed_tables"),
            *domains.layouts(arg, expanded=True), *domains.widths(lambda p: (p.rot, p.d)),
            domains.cls("batch 1", lambda p, c: p.cos_batch == 1),
            domains.cls("batch b > 1", lambda p, c: p.cos_batch > 1))


QKNorm.DOMAIN = {
    "q": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("q"), *domains.odd_heads(lambda p: p.d),
          *domains.sizes(lambda p: p.s, "empty", "s")),
    "k": (*domains.layouts("k"), *domains.head_counts(lambda p: (p.hq, p.hk), cap="")),
    "q_weight": _weights(),
    "k_weight": _weights(),
    "cos": _tables("cos"),
    "sin": _tables("sin"),
    "eps": domains.optional("eps", "another eps"),
    "unsqueeze_dim": domains.optional("unsqueeze_dim", "2", other_off=lambda caps: 2 not in caps["unsqueeze_dim"]),
    "interleaved": domains.optional("interleaved", "True", "interleaved"),
    "gemma": domains.optional("gemma", "True", "gemma"),
}
