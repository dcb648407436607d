"""QK-RMSNorm fused with RoPE at positions into vLLM's cos_sin_cache (`rope.qknorm.apply_cache`):
    apply_cache(q, k, q_weight, k_weight, positions, cos_sin_cache, eps=1e-6, is_neox=True, gemma=False,
                mrope_section=None, mrope_interleaved=False) -> (q', k')
q [T, hq, d], k [T, hk, d], weights [d]; cos_sin_cache [max_position, rot] (row p: the rot / 2 cosines, then the
sines; rot <= d even); is_neox: pairs (i, i + rot / 2), else (2i, 2i + 1). Per head: y = R(x r w), r = (mean(x^2) +
eps)^(-1/2) over all d channels, w -> 1 + w with gemma. positions [T] (int32 or int64); multimodal RoPE as vLLM's
MRotaryEmbedding: positions [3, T] (temporal, height, width; or [T]: one stream for all three) with mrope_section
(pairs per stream, summing to rot / 2): pair i reads its section's stream, or, mrope_interleaved (Qwen3-VL), stream
i % 3 while i < 3 * mrope_section[i % 3], else stream 0. New tensors of q's dtype; gradients for q, k and both
weights. The norm's float64 definition and accuracy model are qknorm_math.py's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import pairing
from ..compare import assert_bitwise
from ..contract import Returned
from ..run import make_case
from ..tensors import DTYPES, Layout, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, head_and_rotary, qknorm_math, small
from .hf_mrope import sections, stream_of_pair
from .qknorm import EPS_VALUES, MAGNITUDES, QKNorm, rotation_preserves_norm
from .te_qknorm import forward_backward, refuses


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    weight_dtype: torch.dtype
    table_dtype: torch.dtype  # cos_sin_cache's
    positions_dtype: torch.dtype
    t: int
    hq: int
    hk: int
    d: int
    rot: int
    rows: int
    is_neox: bool
    gemma: bool
    eps: float
    magnitude: float
    section: tuple  # () without multimodal RoPE
    mrope_interleaved: bool
    streams: bool  # positions [3, T] (else [T]: one stream for all three)
    q_layout: Layout
    k_layout: Layout
    cache_layout: Layout
    positions_layout: Layout
    explicit_defaults: bool = False  # optional arguments passed where they hold their defaults

    @property
    def interleaved(self) -> bool:
        """Pairs (2i, 2i + 1): is_neox False (the name qknorm_math's scales and QKNorm.grad_scale read)."""
        return not self.is_neox


class QKNormCache(Convention):
    NAME = "qknorm-cache"
    SIGNATURE = ("q", "k", "q_weight", "k_weight", "positions", "cos_sin_cache", "eps", "is_neox", "gemma",
                 "mrope_section", "mrope_interleaved")
    DIFFERENTIABLE = ("q", "k", "q_weight", "k_weight")
    CAPS = {
        "dtypes": (DTYPES, "dtypes of q and k"),
        "weight_dtypes": ("any", "the weights' dtype: 'any' float dtype, or 'q' (q's only)"),
        "cache_dtypes": ("any", "cos_sin_cache's dtype: 'any' float dtype, or 'q'"),
        "partial": (True, "rot < d: the norm spans the head, the rotation the first rot channels; odd d"),
        "is_neox": ((True, False), "the pairings: True half-split, False interleaved"),
        "gemma": (True, "the gemma keyword (weights 1 + w)"),
        "mrope": (True, "multimodal positions [3, T] with mrope_section"),
        "mrope_interleaved": (True, "mrope_interleaved (Qwen3-VL's sections)"),
        "int32_positions": (True, "int32 positions as well as int64"),
        "strides": (True, "q, k, cos_sin_cache and positions as views"),
        "messages": (True, "bad input refused with TypeError/ValueError whose message starts with the argument"),
        "accuracy": ("float32", "accuracy model (accuracy.py, qknorm_math.py)"),
        "empty": (True, "no tokens: T = 0 (q, k and positions without elements)"),
    }
    grad_scale = QKNorm.grad_scale

    OPTIONAL = {"eps": 1e-6, "is_neox": True, "gemma": False, "mrope_section": None, "mrope_interleaved": False}

    def plans(self, caps):
        lim = dict(t=4, h=3, rows=8, dims=(2, 4, 6, 7, 8, 10, 16)) if small() else \
            dict(t=256, h=17, rows=4096, dims=(2, 6, 64, 80, 81, 128, 256))

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            d, rot = head_and_rotary(draw, lim["dims"], caps["partial"])
            pairs = rot // 2
            mrope = caps["mrope"] and draw(st.booleans())
            inter = mrope and caps["mrope_interleaved"] and draw(st.booleans())
            section = draw(sections(pairs, inter)) if mrope else ()
            streams = inter or (mrope and draw(st.booleans()))  # one stream for all three: no section matters
            hq = draw(st.integers(1, lim["h"]))
            strides = caps["strides"]

            def dtypes(cap):
                return draw(st.sampled_from(domains.any_dtype(dtype))) if caps[cap] == "any" else dtype

            return Plan(
                draw(seeds()), dtype, dtypes("weight_dtypes"), dtypes("cache_dtypes"),
                draw(st.sampled_from((torch.int64, torch.int32))) if caps["int32_positions"] else torch.int64,
                draw(st.integers(1, lim["t"])), hq, draw(st.integers(1, hq)), d, rot, draw(st.integers(2, lim["rows"])),
                draw(st.sampled_from(caps["is_neox"])), caps["gemma"] and draw(st.booleans()),
                draw(st.sampled_from(EPS_VALUES)), draw(st.sampled_from(MAGNITUDES)), section, inter,
                streams,
                draw(layouts(3)) if strides else contiguous(3), draw(layouts(3)) if strides else contiguous(3),
                draw(layouts(2)) if strides else contiguous(2),
                draw(layouts(2 if streams else 1)) if strides else contiguous(2 if streams else 1))

        return domains.with_explicit(domains.with_empty(draw(), caps, domains.zeroed, ("t",), first=False), caps)

    def build(self, p: Plan, arena, weights=None) -> Case:
        def heads(h, layout):
            x = torch.randn((p.t, h, p.d), generator=arena.gen, dtype=torch.float64) * p.magnitude
            return arena.place(x.to(p.dtype), layout)

        q, k = heads(p.hq, p.q_layout), heads(p.hk, p.k_layout)
        ws = [arena.randn((p.d,), p.weight_dtype) for _ in range(2)] if weights is None else \
            [arena.place(w.to(p.weight_dtype)) for w in weights]
        theta = arena.angles((p.rows, p.rot // 2))
        cache = arena.place(torch.cat([theta.cos(), theta.sin()], dim=-1).to(p.table_dtype), p.cache_layout)
        shape = (3, p.t) if p.streams else (p.t,)
        pos = arena.integers(0, p.rows, shape, p.positions_dtype)
        layout = p.positions_layout if len(p.positions_layout.order) == len(shape) else contiguous(len(shape))
        args = dict(q=q, k=k, q_weight=ws[0], k_weight=ws[1], positions=arena.place(pos, layout),
                    cos_sin_cache=cache, eps=p.eps, is_neox=p.is_neox)
        if p.gemma:
            args["gemma"] = True
        if p.section:
            args["mrope_section"] = list(p.section)
        if p.mrope_interleaved:
            args["mrope_interleaved"] = True
        return Case(p, args, 6, arena.buffers)

    def effects(self, case):
        return (), (Returned("q"), Returned("k"))

    def define(self, case, x64):
        p = case.plan
        half = p.rot // 2
        pos = x64["positions"]
        if p.section:
            rows = x64["cos_sin_cache"][pos.expand(3, p.t)]  # [3, T, rot]
            stream = stream_of_pair(p.section, half, p.mrope_interleaved)
            pair = torch.arange(half)
            rows = torch.cat([rows[stream, :, pair].t(), rows[stream, :, half + pair].t()], dim=-1)  # [T, rot]
        else:
            rows = x64["cos_sin_cache"][pos]
        cos, sin = (pairing.per_channel(t, not p.is_neox).unsqueeze(-2) for t in (rows[:, :half], rows[:, half:]))
        return {name: Expect(qknorm_math.norm_rope(x64[name], x64[f"{name}_weight"], p.eps, p.gemma, cos, sin,
                                                   not p.is_neox),
                             qknorm_math.forward_source(x64[name], x64[f"{name}_weight"], p.eps, p.gemma, p.rot,
                                                        not p.is_neox), p.d, False, p.dtype)
                for name in ("q", "k")}


# ---- invariants -------------------------------------------------------------------------------------------------

def _call(fn, case, **overrides):
    args = {n: v for n, v in {**case.args, **overrides}.items() if v is not None}
    with torch.no_grad():
        return Case(case.plan, args, case.positional).call(fn)


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: each token called alone (its q and k rows, its positions: the column of [3, T]) and
    the tokens rolled by one (positions with them) give bitwise its results in the whole call: q' and k', and q's and
    k's gradients from the same random upstream gradients. The norm's sum runs over one head of one token, so nothing
    of another token may enter it; the weights' gradients are a sum over every token of the call by definition and
    are not compared."""
    p = plan._replace(t=max(plan.t, 2))
    case = make_case(conv, caps, p)
    outs, grads, ups = forward_backward(fn, case)
    pos = case.args["positions"]
    for i in sorted({0, p.t - 1, plan.seed % p.t}):
        rows = {n: case.args[n][i:i + 1].clone() for n in ("q", "k")}
        o, g, _ = forward_backward(fn, case, tuple(u[i:i + 1].clone() for u in ups),
                                   positions=pos[..., i:i + 1].clone(), **rows)
        for what, got, want in (("", o, outs), ("the gradient of ", g, grads)):
            for name, a, w in zip(("q", "k"), got, want, strict=True):
                assert_bitwise(f"batch invariance: {what}{name} of token {i} alone, against among {p.t}", a[0], w[i])
    o, g, _ = forward_backward(fn, case, tuple(torch.roll(u, 1, 0) for u in ups), positions=torch.roll(pos, 1, -1),
                               **{n: torch.roll(case.args[n], 1, 0) for n in ("q", "k")})
    for what, got, want in (("", o, outs), ("the gradient of ", g, grads)):
        for name, r, w in zip(("q", "k"), got, want, strict=True):
            assert_bitwise(f"batch invariance: {what}{name} with the tokens rolled by one, against the whole call's "
                           f"rolled", r, torch.roll(w, 1, 0))


def tokens_independent(conv, fn, caps, plan):
    """Tokens reversed together with their positions give the reversed result, bitwise: each token's heads depend on
    its own row and positions only."""
    case = make_case(conv, caps, plan)
    want = _call(fn, case)
    flipped = {n: case.args[n].flip(0) for n in ("q", "k")}
    got = _call(fn, case, **flipped, positions=case.args["positions"].flip(-1))
    for name, g, w in zip(("q", "k"), got, want, strict=True):
        assert_bitwise(f"{name}: tokens reversed with their positions", g.flip(0), w)


def mrope_stream_locality(conv, fn, caps, plan):
    """Multimodal positions: moving stream m's positions (m = 1 or 2, one that owns pairs) changes the channels of
    the pairs of m's section and leaves every other channel bitwise as it was."""
    if not caps["mrope"] or not plan.t:  # without tokens no position moves anything
        return
    half = plan.rot // 2
    p = plan._replace(streams=True, positions_layout=contiguous(2))
    if not p.section:  # text positions drawn: sections of the plan's pairs
        p = p._replace(section=(half - half // 2, half // 2, 0), mrope_interleaved=False)
    stream = stream_of_pair(p.section, half, p.mrope_interleaved)
    owners = [m for m in (1, 2) if bool((stream == m).any())]
    if not owners:
        return
    m = owners[p.seed % len(owners)]
    case = make_case(conv, caps, p)
    want = _call(fn, case)
    moved = case.args["positions"].clone()
    moved[m] = (moved[m] + 1) % p.rows
    got = _call(fn, case, positions=moved)
    pair = torch.arange(p.rot)
    pair = pair // 2 if not p.is_neox else pair % half
    mine = torch.cat([stream[pair] == m, torch.zeros(p.d - p.rot, dtype=torch.bool)])
    for name, g, w in zip(("q", "k"), got, want, strict=True):
        assert_bitwise(f"{name}: the channels of streams other than {m} after stream {m}'s positions moved",
                       g[..., ~mine.to(g.device)], w[..., ~mine.to(w.device)])
        changed = g[..., mine.to(g.device)] != w[..., mine.to(w.device)]
        assert bool(changed.any()), f"{name}: stream {m}'s positions moved and its pairs' channels stayed as they " \
                                    f"were (section {p.section}, interleaved {p.mrope_interleaved})"


def refuses_bad_input(conv, fn, caps, plan):
    """Bad input refused by name before anything is written: eps <= 0, weights of the wrong length or dtype, float64
    q, flags that are no bool, positions [3, T] without mrope_section, sections not covering the pairs."""
    case = make_case(conv, caps, plan)
    q, w, pos = case.args["q"], case.args["q_weight"], case.args["positions"]
    bad = [("eps", ValueError, dict(eps=0.0)), ("eps", ValueError, dict(eps=-plan.eps)),
           ("q_weight", ValueError, dict(q_weight=torch.cat([w, w[:1]]))),
           ("k_weight", TypeError, dict(k_weight=w.double())), ("q", TypeError, dict(q=q.double())),
           ("gemma", TypeError, dict(gemma="yes")), ("is_neox", TypeError, dict(is_neox=1))]
    if caps["mrope"]:
        bad.append(("mrope_section", ValueError, dict(mrope_section=[plan.rot // 2 + 1, 0, 0],
                                                      mrope_interleaved=None)))
        if not plan.section:
            bad.append(("positions", ValueError, dict(positions=pos.expand(3, plan.t))))
    refuses(fn, case, bad, caps)


QKNormCache.INVARIANTS = {
    "batch_rows_alone": batch_rows_alone,
    "rotation_preserves_norm": rotation_preserves_norm,
    "tokens_independent": tokens_independent,
    "mrope_stream_locality": mrope_stream_locality,
    "refuses_bad_input": refuses_bad_input,
}
CONVENTION = QKNormCache()


def _dtype_pair(get, cap) -> tuple:
    return domains.pairings(get, "", cap, mixed_off=lambda caps: caps[cap] != "any",
                            float32_off=lambda caps: caps[cap] != "any")


QKNormCache.DOMAIN = {
    "q": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("q"), *domains.odd_heads(lambda p: p.d),
          *domains.sizes(lambda p: p.t, "empty", "tokens")),
    "k": (*domains.layouts("k"), *domains.head_counts(lambda p: (p.hq, p.hk), cap="")),
    "q_weight": _dtype_pair(lambda p: (p.dtype, p.weight_dtype), "weight_dtypes"),
    "k_weight": _dtype_pair(lambda p: (p.dtype, p.weight_dtype), "weight_dtypes"),
    "positions": (*domains.index_dtypes(lambda p: p.positions_dtype, "int32_positions"),
                  domains.cls("[T]", lambda p, c: not p.streams),
                  domains.cls("[3, T]", lambda p, c: p.streams, "mrope"), *domains.layouts("positions")),
    "cos_sin_cache": (*_dtype_pair(lambda p: (p.dtype, p.table_dtype), "cache_dtypes"),
                      *domains.layouts("cos_sin_cache"), *domains.widths(lambda p: (p.rot, p.d))),
    "eps": domains.optional("eps", "another eps"),
    "is_neox": domains.optional("is_neox", "False", other_off=lambda caps: False not in caps["is_neox"]),
    "gemma": domains.optional("gemma", "True", "gemma"),
    "mrope_section": domains.optional("mrope_section", "three sections", "mrope"),
    "mrope_interleaved": domains.optional("mrope_interleaved", "True", "mrope_interleaved"),
}
