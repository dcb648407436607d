"""Liger-Kernel's convention: transformers' (spec/hf.py), written in place:
    liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1) -> (q, k)
q [b, hq, s, d] and k [b, hk, s, d], rotated in place and returned; cos/sin [1 or b, s, r] or [s, r] (rank 2,
one table for every sequence), gathered by position already. The kernel reads the first half of cos/sin (the
two members of a pair share an angle), so the halves are drawn equal; it computes in cos's dtype and stores
into q's dtype: with tables in q's dtype that is math in the activations' dtype (the "dtype" accuracy model),
with float32 tables float32 math and one rounding (within it). The rotary width r is cos's width (Liger >= 0.8;
earlier releases rotate the whole head): channels r.. are left as they are. position_ids is unused.

Liger's kernel writes q's memory when q lies as transformers' models hand it over, a [b, h, s, d] view of a
contiguous [b, s, h, d] projection; that layout is always drawn, other views where the target has strides.
"""
from __future__ import annotations

from typing import NamedTuple

from hypothesis import strategies as st

from ..compare import assert_bitwise
from ..run import make_case
from ..tensors import Layout, channel_layouts
from . import domains
from .hf import HF, INVARIANTS, call
from .hf import Plan as HFPlan

# q and k as transformers' attention makes them: view(b, s, h, d).transpose(1, 2)
PROJECTION = Layout((0, 2, 1, 3), (0, 0, 0, 0))


class Plan(NamedTuple("Plan", [*HFPlan.__annotations__.items(), ("rot", int), ("rank2", bool)])):
    """transformers' plan, with the rotary width (cos's width) and whether cos/sin are given as [s, r]."""


def rank2_tables(conv, fn, caps, plan):
    """cos/sin [s, r] equal the same tables as [1, s, r], bitwise."""
    if not caps["rank2_tables"]:
        return
    case = make_case(conv, caps, plan._replace(cos_batch=1, rank2=True))
    want = call(fn, case, cos=case.args["cos"][None], sin=case.args["sin"][None])
    for name, g, w in zip(("q", "k"), call(fn, case), want, strict=True):
        assert_bitwise(f"rank-2 tables: {name}, against the same tables as [1, s, r]", g, w)


class Liger(HF):
    NAME = "liger"
    CAPS = {
        **HF.CAPS,
        "unsqueeze_dim": ((1,), "the layouts: Liger takes [b, h, s, d] only (unsqueeze_dim=1)"),
        "elementwise_tables": (False, "cos/sin whose two halves differ: Liger reads the first half (one angle per "
                                      "pair), so only equal halves are drawn unless a target declares this"),
        "strides": (True, "q and k as other views than a projection's [b, h, s, d] view of [b, s, h, d] memory, "
                          "and tables permuted, sliced or expanded"),
        "accuracy": ("dtype", "math in cos's dtype (q's dtype with 16-bit tables): accuracy.py's dtype model"),
        "in_place": (True, "may write q's and k's memory with the result and return views of it (Liger's kernel)"),
        "rank2_tables": (True, "cos/sin as [s, r], one table for every sequence (Liger >= 0.8)"),
        "partial": (True, "cos/sin narrower than the head: rotary width = their width, the rest kept (Liger >= 0.8)"),
        "mixed_tables": (False, "cos/sin in another dtype than q other than float32: Liger computes in cos's dtype "
                                "and stores q's, which no accuracy model here states"),
    }
    DOMAIN = {**HF.DOMAIN,
              "cos": (*HF.DOMAIN["cos"], domains.cls("[s, r] (rank 2)", lambda p, c: p.rank2, "rank2_tables"))}
    SCHEDULES = {}  # Liger computes in cos's dtype and writes q's in place: not transformers' expression
    INVARIANTS = {**{k: v for k, v in INVARIANTS.items() if k != "unsqueeze_transposed"},
                  "rank2_tables": rank2_tables}

    def plans(self, caps):
        plain = super().plans(caps)
        head_layouts = st.one_of(st.just(PROJECTION), channel_layouts(4)) \
            if caps["strides"] else st.just(PROJECTION)

        @st.composite
        def draw(draw):
            p = draw(plain)
            rot = draw(st.sampled_from(range(2, p.d + 1, 2))) if caps["partial"] and draw(st.booleans()) else p.d
            rank2 = caps["rank2_tables"] and p.cos_batch == 1 and draw(st.booleans())
            p = p._replace(q_layout=draw(head_layouts), k_layout=draw(head_layouts))
            return Plan(*p, rot, rank2)

        return draw()

    def table_width(self, p) -> int:
        return p.rot

    def build(self, p: Plan, arena):
        case = super().build(p, arena)
        if p.rank2:  # [1, s, r] -> [s, r]: a view into the same buffer
            case.args["cos"], case.args["sin"] = case.args["cos"][0], case.args["sin"][0]
        return case

    def define(self, case, x64):
        cos, sin = x64["cos"], x64["sin"]
        if cos.dim() == 2:
            cos, sin = cos[None], sin[None]
        return self.rotate_heads(case, x64, cos, sin)


CONVENTION = Liger()
