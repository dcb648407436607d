"""transformers' one-tensor form (Gemma 3n and Gemma 4 rotate q alone on the layers that share k):
    apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1) -> x_embed
    x_embed = cat(x_rot * cos.unsqueeze(unsqueeze_dim) + rotate_half(x_rot) * sin.unsqueeze(unsqueeze_dim), x_pass)
x [b, h, s, d] (unsqueeze_dim=1) or [b, s, h, d] (unsqueeze_dim=2); cos, sin [b or 1, s, r] as in spec/hf.py
(x_rot = x[..., :r] rotated with pairs (i, i + r/2), x_pass = x[..., r:] passed through; transformers' Gemma
functions rotate the whole head, r = d). unsqueeze_dim is passed by keyword (Gemma 3n's function has an unused
position_ids before it). A new tensor in torch's promotion of x's and cos's dtypes; the gradient flows to x.
"""
from __future__ import annotations

from ..compare import assert_bitwise
from ..contract import Returned
from ..run import make_case
from . import Case
from .hf import (
    HF,
    Plan,
    batch_rows_alone,
    call,
    heads_domain,
    inverse,
    partial_is_sliced,
    tables_batch_broadcast,
    tables_domain,
    unsqueeze_dim_transposed,
    unsqueeze_domain,
)


class HFSingle(HF):
    NAME = "hf-single"
    SIGNATURE = ("x", "cos", "sin", "unsqueeze_dim")
    DIFFERENTIABLE = ("x",)
    CAPS = {k: v for k, v in HF.CAPS.items() if k not in ("gqa", "position_ids", "in_place")}
    OPTIONAL = {"unsqueeze_dim": 1}
    DOMAIN = {"x": heads_domain("x"), "cos": tables_domain(), "sin": tables_domain("sin"),
              "unsqueeze_dim": unsqueeze_domain()}

    def build(self, p: Plan, arena) -> Case:
        x = arena.randn(self.heads_shape(p, p.hq), p.dtype, p.q_layout)
        return Case(p, dict(x=x, **self.tables(p, arena), unsqueeze_dim=p.unsqueeze_dim), 3, arena.buffers)

    def effects(self, case):
        return (), Returned("x")


def heads_together(conv, fn, caps, plan):
    """Every head is rotated by the same tables: the call on x's heads split in two (views of x) gives those heads
    of the call on x, bitwise; so the one-tensor form on q and on k is what the pair form gives for both."""
    case = make_case(conv, caps, plan)
    x, dim = case.args["x"], case.plan.unsqueeze_dim
    if x.shape[dim] < 2:
        return
    (whole,) = call(fn, case)
    cut = 1 + plan.seed % (x.shape[dim] - 1)
    rest = x.shape[dim] - cut
    for part, idx in ((x.narrow(dim, 0, cut), slice(0, cut)), (x.narrow(dim, cut, rest), slice(cut, None))):
        (got,) = call(fn, case, x=part)
        want = whole[:, idx] if dim == 1 else whole[:, :, idx]
        assert_bitwise(f"heads {idx.start or 0}..{idx.stop or x.shape[dim]} alone, against the same heads of the "
                       f"call on all {x.shape[dim]}", got, want)


HFSingle.INVARIANTS = {
    "unsqueeze_transposed": unsqueeze_dim_transposed,
    "batch_rows_alone": batch_rows_alone,
    "tables_batch_broadcast": tables_batch_broadcast,
    "inverse": inverse,
    "partial_is_sliced": partial_is_sliced,
    "heads_together": heads_together,
}

CONVENTION = HFSingle()
