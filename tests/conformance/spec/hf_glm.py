"""transformers' GLM and GLM-4 convention:
    apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1) -> (q_embed, k_embed)
    cos = cos.unsqueeze(unsqueeze_dim)[..., :r/2].repeat_interleave(2, dim=-1)   (sin alike), r = cos.shape[-1]
    q_embed = cat(q_rot * cos + rotate_half_interleaved(q_rot) * sin, q_pass)
with rotate_half_interleaved(x) = stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2): interleaved pairs (2i, 2i + 1)
over the first r channels, pair i rotated by column i of the first half of each table row; the second half
(which GLM's rotary module fills with a copy of the first, cat(theta, theta)) is never read, so it is drawn
different here. q_rot = q[..., :r], q_pass = q[..., r:] (GLM rotates half the head). Shapes, dtypes and the
result as in spec/hf.py: new tensors in torch's promotion of q's and cos's dtypes; the gradient flows to q and k.
"""
from __future__ import annotations

import torch

from .. import pairing
from ..compare import assert_bitwise
from ..run import make_case
from .hf import HF, INVARIANTS, call, rotated, schedule_of


class HFGLM(HF):
    NAME = "hf-glm"
    INTERLEAVED = True
    CAPS = {**HF.CAPS,
            "elementwise_tables": (True, "cos/sin whose second half differs from the first (GLM reads the first "
                                         "half only)")}

    def define(self, case, x64):
        first = {n: pairing.per_channel(x64[n][..., :x64[n].shape[-1] // 2], True) for n in ("cos", "sin")}
        return self.rotate_heads(case, x64, first["cos"], first["sin"])


def second_half_unread(conv, fn, caps, plan):
    """The second half of each table row is not read: the first half negated there (the opposite of the copy GLM's
    module puts there, so that a read of it cannot pass unseen) gives the same result, bitwise."""
    case = make_case(conv, caps, plan)
    want = call(fn, case)
    h = case.args["cos"].shape[-1] // 2
    tables = {n: torch.cat([case.args[n][..., :h], -case.args[n][..., :h]], dim=-1) for n in ("cos", "sin")}
    for name, g, w in zip(rotated(case), call(fn, case, **tables), want, strict=True):
        assert_bitwise(f"second half of cos/sin replaced by the first half negated: {name}", g, w)


HFGLM.INVARIANTS = {**INVARIANTS, "second_half_unread": second_half_unread}
def _rotate_half_interleaved(x):
    """GLM's rotate_half: pairs (x[2i], x[2i + 1]) as (-x[2i + 1], x[2i])."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _first_half_repeated(tab):
    """GLM's tables: each row's first half, each column repeated for both channels of its pair."""
    return tab[..., : tab.shape[-1] // 2].repeat_interleave(2, dim=-1)


# --rope-schedule: `eager`, GLM's expression as transformers' models run it; `float32`, float32 math (each product
# and the sum rounded to float32 in turn) and one rounding
HFGLM.SCHEDULES = {math_name: schedule_of(math, _first_half_repeated, _rotate_half_interleaved)
                   for math_name, math in (("eager", None), ("float32", torch.float32))}

CONVENTION = HFGLM()
