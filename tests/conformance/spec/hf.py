"""transformers' convention (Llama and most decoder models):
    apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1) -> (q_embed, k_embed)
    q_embed = q * cos.unsqueeze(unsqueeze_dim) + rotate_half(q) * sin.unsqueeze(unsqueeze_dim)
q [b, hq, s, d] and k [b, hk, s, d] (unsqueeze_dim=1), or [b, s, h, d] (unsqueeze_dim=2); cos, sin [b or 1, s, d],
gathered by position already, in any dtype: the result has torch's promotion of q's and cos's dtypes, as the
expression gives. position_ids is unused (transformers 4.x passed it; 5 dropped it). New tensors; the gradient
flows to q and k.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import pairing
from ..contract import Returned
from ..tensors import DTYPES, Layout, contiguous, layouts, seeds
from . import Case, Convention, Expect, small


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    table_dtype: torch.dtype
    b: int
    hq: int
    hk: int
    s: int
    d: int
    unsqueeze_dim: int
    cos_batch: int
    equal_halves: bool
    q_layout: Layout
    k_layout: Layout
    cos_layout: object  # a Layout, or "expanded" (a [1, s, d] table expanded over the batch: stride 0)
    position_ids: bool


class HF(Convention):
    NAME = "hf"
    SIGNATURE = ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim")
    DIFFERENTIABLE = ("q", "k")
    CAPS = {
        "dtypes": (DTYPES, "dtypes of q and k"),
        "float32_tables": (True, "cos/sin in float32 with 16-bit q and k (the result is float32, as promoted)"),
        "gqa": (True, "k with another head count than q"),
        "unsqueeze_dim": ((1, 2), "the layouts: 1 for [b, h, s, d], 2 for [b, s, h, d]"),
        "cos_batch": (True, "cos/sin with a batch of b (one table per sequence), not only 1"),
        "elementwise_tables": (True, "cos/sin whose two halves differ (the formula reads one per channel)"),
        "strides": (True, "views: permuted, sliced and expanded tensors"),
        "position_ids": (True, "accepts the unused position_ids argument"),
        "backward": (True, "gradients for q and k"),
        "accuracy": ("float32", "accuracy model (accuracy.py): float32 math and one rounding, or dtype math"),
        "in_place": (False, "writes q and k and returns them (Liger's kernel), instead of new tensors"),
    }

    def plans(self, caps):
        lim = dict(b=2, h=3, s=5, dims=(2, 4, 6, 8, 12, 16)) if small() else \
            dict(b=4, h=32, s=512, dims=(2, 6, 64, 80, 128, 256))

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            table_dtype = draw(st.sampled_from((dtype, torch.float32))) if caps["float32_tables"] else dtype
            hq = draw(st.integers(1, lim["h"]))
            hk = draw(st.integers(1, hq)) if caps["gqa"] else hq
            b, s = draw(st.integers(1, lim["b"])), draw(st.integers(1, lim["s"]))
            strides = caps["strides"]
            cos_layout = draw(st.one_of(layouts(3, padded_dims=(1, 2)), st.just("expanded"))) if strides \
                else contiguous(3)
            return Plan(
                draw(seeds()), dtype, table_dtype, b, hq, hk, s, draw(st.sampled_from(lim["dims"])),
                draw(st.sampled_from(caps["unsqueeze_dim"])),
                draw(st.sampled_from((1, b))) if caps["cos_batch"] else 1,
                draw(st.booleans()) if caps["elementwise_tables"] else True,
                draw(layouts(4)) if strides else contiguous(4), draw(layouts(4)) if strides else contiguous(4),
                cos_layout, draw(st.booleans()) if caps["position_ids"] else False)

        return draw()

    def build(self, p: Plan, arena) -> Case:
        def heads_shape(h):
            return (p.b, h, p.s, p.d) if p.unsqueeze_dim == 1 else (p.b, p.s, h, p.d)

        q = arena.randn(heads_shape(p.hq), p.dtype, p.q_layout)
        k = arena.randn(heads_shape(p.hk), p.dtype, p.k_layout)
        theta = arena.angles((p.cos_batch, p.s, p.d // 2))
        theta = torch.cat([theta, theta if p.equal_halves else arena.angles(theta.shape)], dim=-1)
        tables = []
        for fn in (torch.cos, torch.sin):
            values = fn(theta).to(p.table_dtype)
            if p.cos_layout == "expanded":
                tables.append(arena.place(values[:1]).expand(p.b, p.s, p.d))
            else:
                tables.append(arena.place(values, p.cos_layout))
        args = dict(q=q, k=k, cos=tables[0], sin=tables[1])
        if p.position_ids:
            args["position_ids"] = arena.place(torch.arange(p.s).expand(p.b, p.s).clone())
        args["unsqueeze_dim"] = p.unsqueeze_dim
        return Case(p, args, 4, arena.buffers)

    def effects(self, case):
        if case.caps.get("in_place"):
            return ("q", "k"), (Returned("q", "q"), Returned("k", "k"))
        return (), (Returned("q"), Returned("k"))

    def define(self, case, x64):
        p = case.plan
        out_dtype = torch.promote_types(p.dtype, p.table_dtype)
        if case.caps.get("in_place"):
            out_dtype = p.dtype  # written into q and k
        cos, sin = (x64[n].unsqueeze(p.unsqueeze_dim) for n in ("cos", "sin"))
        return {name: Expect(pairing.rotate(x64[name], cos, sin, False), x64[name], p.d, False, out_dtype)
                for name in ("q", "k")}


CONVENTION = HF()
