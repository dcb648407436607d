"""vLLM's fused QK norm + RoPE (its custom op `vllm._custom_ops.fused_qk_norm_rope`):
    fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
                       cos_sin_cache, is_neox, position_ids) -> None
qkv [T, (hq + hk + hv) * head_dim]: per token hq query heads, hk key heads, hv value heads. Each q and k head is
RMS-normalised over head_dim (weights q_weight, k_weight [head_dim]) and its first rot channels rotated at
position_ids [T] (int64, or int32) of cos_sin_cache [max_position, rot] (row p: the rot / 2 cosines, then the
sines); is_neox: pairs (i, i + rot / 2), else (2i, 2i + 1). qkv is written IN PLACE, its q and k heads only: v is
untouched, bitwise. Inference only (no backward). Definition and accuracy model: qknorm_math.py.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import pairing
from ..compare import assert_bitwise
from ..run import make_case
from ..tensors import DTYPES, Layout, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, qknorm_math, small
from .qknorm import EPS_VALUES, MAGNITUDES


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    weight_dtype: torch.dtype
    cache_dtype: torch.dtype
    positions_dtype: torch.dtype
    t: int
    hq: int
    hk: int
    hv: int
    d: int
    rot: int
    rows: int
    is_neox: bool
    eps: float
    magnitude: float
    qkv_layout: Layout  # padded rows: qkv a slice of a wider buffer
    cache_layout: Layout
    positions_layout: Layout


class VLLMQKNorm(Convention):
    NAME = "vllm-qknorm"
    SIGNATURE = ("qkv", "num_heads_q", "num_heads_k", "num_heads_v", "head_dim", "eps", "q_weight", "k_weight",
                 "cos_sin_cache", "is_neox", "position_ids")
    DIFFERENTIABLE = ()
    CAPS = {
        "dtypes": (DTYPES, "dtypes of qkv"),
        "weight_dtypes": ("any", "the weights' dtype: 'any' float dtype, or 'qkv' (qkv's only)"),
        "cache_dtypes": ("any", "cos_sin_cache's dtype: 'any' float dtype, or 'qkv'"),
        "head_dims": ("any", "head_dim: 'any' (odd too, with rot < head_dim), or a tuple of the sizes supported"),
        "partial": (True, "rot < head_dim: the norm spans the head, the rotation the first rot channels"),
        "is_neox": ((True, False), "the pairings: True half-split, False interleaved"),
        "strides": (True, "qkv with padded rows, and cos_sin_cache and position_ids as views"),
        "int32_positions": (True, "int32 position_ids as well as int64"),
        "accuracy": ("float32", "accuracy model (accuracy.py, qknorm_math.py)"),
        "empty": (True, "no tokens: T = 0 (qkv and position_ids without elements)"),
    }

    def plans(self, caps):
        lim = dict(t=5, h=3, rows=8, dims=(2, 4, 6, 7, 8, 10, 16)) if small() else \
            dict(t=256, h=17, rows=4096, dims=(2, 6, 64, 80, 81, 128, 256))

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            dims = lim["dims"] if caps["head_dims"] == "any" else caps["head_dims"]
            d = draw(st.sampled_from(dims))
            rot = 2 * draw(st.integers(1, d // 2)) if caps["partial"] and draw(st.booleans()) else d - d % 2
            hk = draw(st.integers(1, lim["h"]))
            strides = caps["strides"]

            def dtypes(cap, shift=0):  # (the two in other orders: each pairing drawn within the CPU budget)
                choices = domains.any_dtype(dtype)
                return draw(st.sampled_from(choices[shift:] + choices[:shift])) if caps[cap] == "any" else dtype

            return Plan(
                draw(seeds()), dtype, dtypes("weight_dtypes"), dtypes("cache_dtypes", 1),
                draw(st.sampled_from((torch.int64, torch.int32))) if caps["int32_positions"] else torch.int64,
                draw(st.integers(1, lim["t"])), draw(st.integers(1, lim["h"])), hk,
                draw(st.sampled_from((0, hk, hk + 1))), d, rot, draw(st.integers(1, lim["rows"])),
                draw(st.sampled_from(caps["is_neox"])), draw(st.sampled_from(EPS_VALUES)),
                draw(st.sampled_from(MAGNITUDES)),
                Layout((0, 1), (0, draw(st.sampled_from((0, 0, 1, 4))))) if strides else contiguous(2),
                draw(layouts(2)) if strides else contiguous(2),
                draw(layouts(1, spaced=True)) if strides else contiguous(1))

        return domains.with_empty(draw(), caps, domains.zeroed, ("t",))

    def build(self, p: Plan, arena) -> Case:
        heads = p.hq + p.hk + p.hv
        values = torch.randn((p.t, heads * p.d), generator=arena.gen, dtype=torch.float64) * p.magnitude
        qkv = arena.place(values.to(p.dtype), p.qkv_layout)
        q_weight, k_weight = (arena.randn((p.d,), p.weight_dtype) for _ in range(2))
        theta = arena.angles((p.rows, p.rot // 2))
        cache = arena.place(torch.cat([theta.cos(), theta.sin()], dim=-1).to(p.cache_dtype), p.cache_layout)
        positions = arena.place(arena.integers(0, p.rows, (p.t,), p.positions_dtype), p.positions_layout)
        args = dict(qkv=qkv, num_heads_q=p.hq, num_heads_k=p.hk, num_heads_v=p.hv, head_dim=p.d, eps=p.eps,
                    q_weight=q_weight, k_weight=k_weight, cos_sin_cache=cache, is_neox=p.is_neox,
                    position_ids=positions)
        return Case(p, args, 11, arena.buffers)

    def effects(self, case):
        return ("qkv",), None

    def define(self, case, x64):
        """qkv as [T, H * d]: the q and k heads normalised and rotated, then the v heads as given. Expect's `rot` is
        the width of the q and k heads, so that the runner compares the v heads bitwise (its copied channels), and
        its source the forward scale (qknorm_math), whatever pairs the runner forms over it."""
        p = case.plan
        heads = x64["qkv"].reshape(p.t, p.hq + p.hk + p.hv, p.d)  # named: with T = 0, -1 could be any
        rows = x64["cos_sin_cache"][x64["position_ids"]]  # [T, rot]
        half = p.rot // 2
        cos, sin = (pairing.per_channel(t, not p.is_neox).unsqueeze(-2) for t in (rows[:, :half], rows[:, half:]))
        parts, sources = [], []
        for x, w in ((heads[:, :p.hq], x64["q_weight"]), (heads[:, p.hq:p.hq + p.hk], x64["k_weight"])):
            parts.append(qknorm_math.norm_rope(x, w, p.eps, False, cos, sin, not p.is_neox))
            sources.append(qknorm_math.forward_source(x, w, p.eps, False, p.rot, not p.is_neox))
        v = heads[:, p.hq + p.hk:]
        width = (p.hq + p.hk + p.hv) * p.d
        value = torch.cat([*parts, v], dim=1).reshape(p.t, width)
        source = torch.cat([*sources, torch.zeros_like(v)], dim=1).reshape(p.t, width)
        return {"qkv": Expect(value, source, (p.hq + p.hk) * p.d, False, p.dtype)}


# ---- invariants -------------------------------------------------------------------------------------------------

def _run(fn, case):
    with torch.no_grad():
        result = case.call(fn)
    assert result is None, f"expected None (qkv is written in place), got {type(result).__name__}"
    return case.args["qkv"]


def v_untouched(conv, fn, caps, plan):
    """The v heads bitwise as given, with v heads as many as k's (vLLM's layout): a kernel that takes the heads
    after q for k's must still stop at k's."""
    plan = plan._replace(hv=plan.hk)
    case = make_case(conv, caps, plan)
    v0 = case.args["qkv"][:, (plan.hq + plan.hk) * plan.d:].clone()
    qkv = _run(fn, case)
    assert_bitwise("v heads after the call", qkv[:, (plan.hq + plan.hk) * plan.d:], v0)


def tokens_independent(conv, fn, caps, plan):
    """Tokens reversed together with their position_ids give the reversed result, bitwise: each token's heads depend
    on its own row and position only."""
    case = make_case(conv, caps, plan)
    flipped = make_case(conv, caps, plan)
    flipped.args["qkv"].copy_(case.args["qkv"].flip(0))
    flipped.args["position_ids"].copy_(case.args["position_ids"].flip(0))
    want = _run(fn, case).clone()
    assert_bitwise("tokens reversed with their positions", _run(fn, flipped).flip(0), want)


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: each token called alone (its qkv row, its position) and the tokens rolled by one
    (position_ids with them) write bitwise its row of the whole call: the q and k heads normalised and rotated, the v
    heads as given. The norm's sum runs over one head of one token, so nothing of another token may enter it."""
    p = plan._replace(t=max(plan.t, 2))
    case = make_case(conv, caps, p)
    given = {n: case.args[n].clone() for n in ("qkv", "position_ids")}
    whole = _run(fn, case).clone()

    def run_on(args):
        """qkv after fn on new tensors `args` (qkv, position_ids) with the case's other arguments."""
        return _run(fn, Case(p, {**case.args, **args}, case.positional))

    for i in sorted({0, p.t - 1, plan.seed % p.t}):
        alone = run_on({n: x[i:i + 1].clone() for n, x in given.items()})
        assert_bitwise(f"batch invariance: qkv of token {i} alone, against among {p.t}", alone[0], whole[i])
    rolled = run_on({n: torch.roll(x, 1, 0) for n, x in given.items()})
    assert_bitwise("batch invariance: qkv with the tokens rolled by one, against the whole call's rolled", rolled,
                   torch.roll(whole, 1, 0))


VLLMQKNorm.INVARIANTS = {"batch_rows_alone": batch_rows_alone, "v_untouched": v_untouched,
                         "tokens_independent": tokens_independent}
CONVENTION = VLLMQKNorm()


def _any(cap):
    return lambda caps: caps[cap] == "any"


VLLMQKNorm.DOMAIN = {
    "qkv": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("qkv"),
            *domains.sizes(lambda p: p.t, "empty", "tokens")),
    "num_heads_q": domains.sizes(lambda p: p.hq, "", empty=False, pow2=True),
    "num_heads_k": domains.head_counts(lambda p: (p.hq, p.hk), cap=""),
    "num_heads_v": (domains.cls("0", lambda p, c: p.hv == 0), domains.cls("as many as k", lambda p, c: p.hv == p.hk),
                    domains.cls("another count", lambda p, c: p.hv not in (0, p.hk))),
    "head_dim": (*domains.odd_heads(lambda p: p.d, "head_dims"),
                 *domains.sizes(lambda p: p.d, "", empty=False, one=False)),
    "eps": domains.flags(lambda p: p.eps, EPS_VALUES),
    "q_weight": domains.pairings(lambda p: (p.dtype, p.weight_dtype), "", "weight_dtypes",
                                 mixed_off=lambda caps: not _any("weight_dtypes")(caps),
                                 float32_off=lambda caps: not _any("weight_dtypes")(caps)),
    "k_weight": (domains.cls("q_weight's dtype", lambda p, c: True),),
    "cos_sin_cache": (*domains.pairings(lambda p: (p.dtype, p.cache_dtype), "", "cache_dtypes",
                                        mixed_off=lambda caps: not _any("cache_dtypes")(caps),
                                        float32_off=lambda caps: not _any("cache_dtypes")(caps)),
                      *domains.layouts("cos_sin_cache"),
                      *domains.widths(lambda p: (p.rot, p.d))),
    "is_neox": domains.flags(lambda p: p.is_neox, (True, False), ("half-split (True)", "interleaved (False)"),
                             allowed=lambda caps: caps["is_neox"]),
    "position_ids": (*domains.index_dtypes(lambda p: p.positions_dtype, "int32_positions"),
                     *domains.layouts("position_ids"), domains.spaced("position_ids")),
}
