"""Megatron-LM's MLA training RoPE (`megatron.core.fusions.fused_mla_yarn_rope_apply`):
    fused_mla_rope_inplace(t, cos, sin, nope_dim, emb_dim, cu_seqlens_q=None, cp_rank=0, cp_size=1,
                           rotary_interleaved=False, inverse=False, remove_interleaving=False, position_ids=None) -> t
t [s, b, h, nope_dim + emb_dim] (sbhd, cu_seqlens_q None) or [T, h, nope_dim + emb_dim] (thd: packed sequences,
cu_seqlens_q [n + 1] of their lengths on all ranks); cos, sin [rows, 1, 1, emb_dim] or [rows, emb_dim] in any float
dtype (Megatron's rotary module gives cat(freqs, freqs), but every column is read). Each head's trailing emb_dim
channels are read as pairs x1 = x[2i], x2 = x[2i + 1] and, with the token's table row p (h = emb_dim / 2),
    left_i = x1 cos[p, i] - x2 sin[p, i]          right_i = x2 cos[p, h + i] + x1 sin[p, h + i]
are written half-split (left_i at i, right_i at h + i), or, remove_interleaving=True, back at 2i and 2i + 1;
inverse=True negates sin. The leading nope_dim channels are neither read nor written; rotary_interleaved must be
False (Megatron asserts it). The row p: sbhd, the s index (cp_rank and cp_size are not read); thd with position_ids,
position_ids[j]; thd without, the offset j of the token in its sequence, whose local bounds are cu_seqlens_q //
cp_size (length L), mapped for cp_size > 1 as Megatron's kernel writes it: j + (cp_rank L) // 2 for j < L // 2, else
j - L // 2 + ((2 cp_size - cp_rank - 1) L) // 2; a row past the last sequence (CUDA-graph padding) reads p = 0.
t is written in place and returned (its memory: autograd's Function hands back a view of it); the gradient flows to t,
the transpose of the rotation on the trailing channels and the upstream gradient as it is on the leading ones.

The shared accuracy helpers take the rotated channels first, as half-split pairs, then the copies. So an output is
read (`read`) with its trailing channels de-interleaved where remove_interleaving wrote them interleaved, and moved
ahead of the leading ones; the expectation's source is the input's pairs (x1, x2) side by side, then its leading
channels; the gradient's scale is written back to t's channel order (`grad_scale`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from ..compare import assert_bitwise, assert_undone, assert_within
from ..contract import Returned
from ..run import make_case
from ..tensors import DEVICE, DTYPES, Layout, Wide, contiguous, layouts, place_heads, seeds
from . import Case, Convention, Expect, domains, small
from .deepseek_v4 import to_front
from .hf import refusing
from .hf_deepseek_v3 import deinterleave, interleave


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    table_dtype: torch.dtype
    thd: bool  # t [T, h, d] with cu_seqlens_q; else [s, b, h, d]
    s: int  # sbhd: tokens per sequence
    b: int  # sbhd: batch
    lengths: tuple  # thd: each sequence's length on all ranks
    pad: int  # thd: rows past the last sequence (CUDA-graph padding)
    h: int
    nope: int
    emb: int
    cp_size: int
    cp_rank: int
    inverse: bool
    remove_interleaving: bool
    position_ids: bool  # thd: one row per token given (drawn in [0, rows))
    index_dtype: torch.dtype  # cu_seqlens_q's and position_ids'
    extra_rows: int  # table rows past the last one read
    equal_halves: bool  # cos, sin as cat(f, f); else every column its own
    table_rank: int  # 4: [rows, 1, 1, emb]; 2: [rows, emb]
    t_layout: object  # a tensors.Layout or a Wide
    cos_layout: Layout
    sin_layout: Layout
    positions_layout: Layout
    leaf: bool = False  # the backward property passes t as a leaf that requires grad
    explicit_defaults: bool = False


def n_tokens(p) -> int:
    """t's rows of tokens: s (sbhd), or the local tokens of every sequence and the padding (thd)."""
    return (sum(p.lengths) // p.cp_size + p.pad) if p.thd else p.s


def cu_of(lengths, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor((0, *lengths), dtype=torch.int64).cumsum(0).to(dtype)


def megatron_rows(cu, n: int, cp_size: int, cp_rank: int) -> list:
    """The table row of each of n packed tokens, as Megatron's kernel finds it: the first sequence whose local end
    (cu[i + 1] // cp_size) lies past the token, the offset in it, the dual-chunk map; none found (padding): row 0."""
    bounds = [int(c) // cp_size for c in cu]
    rows = []
    for token in range(n):
        j, length = 0, 0
        for i in range(len(bounds) - 1):
            if bounds[i + 1] > token:
                j, length = token - bounds[i], bounds[i + 1] - bounds[i]
                break
        if cp_size > 1:
            j = j + cp_rank * length // 2 if j < length // 2 else \
                j - length // 2 + (2 * cp_size - cp_rank - 1) * length // 2
        rows.append(j)
    return rows


def by_position_ids(p) -> bool:
    """Whether the plan passes position_ids (the KV split's plans, which share these helpers, have none)."""
    return getattr(p, "position_ids", False)


def table_rows_needed(p) -> int:
    """The rows every token reads fit in (position_ids are drawn below it)."""
    if not p.thd:
        return p.s
    n = n_tokens(p)
    if by_position_ids(p):
        return max(n, 1)
    rows = megatron_rows(cu_of(p.lengths), n, p.cp_size, p.cp_rank)
    return max(rows) + 1 if rows else 0


def limits() -> dict:
    if small():
        return dict(s=4, b=2, h=2, n=3, k=2, nope=(0, 3, 2, 8), emb=(8, 4, 16), before=(1, 3), after=(0, 2), pad=2)
    # DeepSeek's q: 128 nope + 64 rope per head, its kv_lora_rank 512; odd and unaligned leading widths too
    return dict(s=256, b=4, h=16, n=4, k=48, nope=(128, 0, 64, 512, 3), emb=(64, 32, 128, 16), before=(64, 3),
                after=(0, 64), pad=16)


def draw_sequences(draw, caps, lim) -> dict:
    """Drawn by a plan strategy, first (Hypothesis varies early choices most), the choices that open classes: the
    format, sbhd's tokens, position_ids where the convention has them (caps["position_ids"]) and their layout,
    context parallelism, the dtypes, an empty call, thd's sequences and padding or sbhd's batch. Returns the plan's
    fields of those names."""
    thd = draw(st.booleans()) if caps["thd"] else False
    tokens = draw(domains.lengths((1, 3, 2, lim["s"]), False, lim["s"], small()))  # sbhd's s
    position_ids = thd and caps.get("position_ids", False) and draw(st.booleans())
    positions_layout = draw(layouts(1, spaced=True)) if caps["strides"] and position_ids else contiguous(1)
    cp_size = draw(st.sampled_from((1, 2, 4))) if caps["context_parallel"] else 1
    cp_rank = draw(st.sampled_from(tuple(reversed(range(cp_size)))))  # the last rank the simplest
    dtype = draw(st.sampled_from(caps["dtypes"]))
    table_dtype = draw(st.sampled_from(domains.table_dtypes(dtype, caps)))
    empty = caps["empty"] and draw(st.integers(0, 9)) == 0
    s, b, lengths, pad = 0, 1, (), 0
    if thd:
        unit = 2 * cp_size if cp_size > 1 else 1
        n = draw(st.integers(1, lim["n"]))
        lengths = [0 if empty else unit * draw(st.integers(0, lim["k"])) for _ in range(n)]
        if not empty and not any(lengths):
            lengths[-1] = unit
        if not empty and cp_size > 1 and caps["uneven_cp"] and draw(st.booleans()):
            # remainders that add up across sequences: local bounds are each global bound // cp_size, past the sum
            # of the local lengths once the remainders mod cp_size of the sequences before reach cp_size. The second
            # sequence's is raised so that the first two reach it wherever the first's is not 0 (reached by chance,
            # the case was in a few device draws in a hundred), with the same draws
            rem = [draw(st.integers(0, unit - 1)) for _ in lengths]
            if rem[0] % cp_size:
                if len(rem) == 1:  # a second sequence, of the remainder's complement alone
                    lengths, rem = [*lengths, 0], [*rem, 0]
                rem[1] += max(0, cp_size - rem[0] % cp_size - rem[1] % cp_size)
            lengths = [n + r for n, r in zip(lengths, rem, strict=True)]
            lengths[0] += 0 if any(n % unit for n in lengths) else 1
        lengths = tuple(lengths)
        pad = draw(st.integers(0, lim["pad"])) if caps["padding"] and not empty else 0
    else:
        s = 0 if empty else tokens
        b = draw(st.sampled_from((2, 1) if small() else (2, 1, lim["b"])))
    return dict(thd=thd, s=s, b=b, lengths=lengths, pad=pad, cp_size=cp_size, cp_rank=cp_rank, dtype=dtype,
                table_dtype=table_dtype, position_ids=position_ids, positions_layout=positions_layout)


def draw_heads_layout(draw, ndim: int, strides: bool, lim):
    """Drawn by a plan strategy: how a tensor of heads lies, a tensors.Layout, or (a third of the time where views are
    drawn) a Wide: its rows within wider NaN-filled ones."""
    kind = draw(st.sampled_from(("layout", "wide", "layout"))) if strides else "layout"
    if kind == "wide":
        return Wide(tuple(draw(st.permutations(range(ndim - 1)))) + (ndim - 1,), draw(st.sampled_from(lim["before"])),
                    draw(st.sampled_from(lim["after"])))
    return draw(layouts(ndim)) if strides else contiguous(ndim)


def build_tables(p, arena) -> dict:
    """cos and sin of the plan: rows for every token and p.extra_rows more, halves equal or each column its own angle,
    [rows, 1, 1, emb] or [rows, emb], in p.table_dtype, laid out as the plan says."""
    rows = table_rows_needed(p) + p.extra_rows
    theta = arena.angles((rows, p.emb // 2 if p.equal_halves else p.emb))
    if p.equal_halves:
        theta = torch.cat([theta, theta], -1)
    tables = {}
    for name, fn, layout in (("cos", torch.cos, p.cos_layout), ("sin", torch.sin, p.sin_layout)):
        values = fn(theta).to(p.table_dtype)
        tables[name] = arena.place(values.reshape(rows, 1, 1, p.emb) if p.table_rank == 4 else values, layout)
    return tables


def rotated_pairs(rope, cos, sin) -> tuple:
    """(left, right, x1, x2) in float64: the pairs x1 = rope[2i], x2 = rope[2i + 1] of the rope channels and Megatron's
    map of them by per-token cos, sin [..., emb] (broadcast against the pairs)."""
    half = rope.shape[-1] // 2
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    return x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:], x1, x2


class MegatronMLA(Convention):
    NAME = "megatron-mla"
    PARAMETER_CAPS = {"inverse": {"inverse": False}, "remove_interleaving": {"remove_interleaving": False},
                      "position_ids": {"position_ids": False}}
    SIGNATURE = ("t", "cos", "sin", "nope_dim", "emb_dim", "cu_seqlens_q", "cp_rank", "cp_size", "rotary_interleaved",
                 "inverse", "remove_interleaving", "position_ids")
    OPTIONAL = {"cu_seqlens_q": None, "cp_rank": 0, "cp_size": 1, "rotary_interleaved": False, "inverse": False,
                "remove_interleaving": False, "position_ids": None}
    DIFFERENTIABLE = ("t",)
    CAPS = {
        "dtypes": (DTYPES, "dtypes of t"),
        "float32_tables": (True, "cos/sin in float32 with 16-bit t (the result stays t's dtype)"),
        "mixed_tables": (True, "cos/sin in the other 16-bit dtype than t, or 16-bit with float32 t"),
        "elementwise_tables": (True, "cos/sin whose two halves differ (channel 2i + 1 reads column h + i)"),
        "thd": (True, "t [T, h, d] with cu_seqlens_q (packed sequences)"),
        "context_parallel": (True, "cp_size > 1: thd's dual-chunk rows of cp_rank; sbhd's rows unchanged"),
        "uneven_cp": (True, "thd sequences whose length is no multiple of 2 cp_size under cp_size > 1 (Megatron's "
                            "integer arithmetic on the odd local length)"),
        "padding": (True, "thd rows past the last sequence (CUDA-graph padding): row 0"),
        "position_ids": (True, "position_ids [T] (thd): one row per token, no context-parallel map"),
        "inverse": (True, "inverse=True: sin negated"),
        "remove_interleaving": (True, "remove_interleaving=True: the pairs written back interleaved"),
        "strides": (True, "views: t permuted, padded or a head within a wider row; cos, sin and position_ids sliced "
                          "from wider buffers"),
        "backward": (True, "the gradient of t"),
        "leaf": (True, "backward on t a leaf that requires grad: t written, its memory returned, t.grad correct"),
        "accuracy": ("float32", "accuracy model (accuracy.py): float32 math and one rounding, or dtype math"),
        "empty": (True, "no token: s = 0, or thd with every sequence empty"),
        "bad_input": (True, "a head other than nope_dim + emb_dim, emb_dim no multiple of 4, rotary_interleaved=True, "
                            "cp_rank outside [0, cp_size), tables of another shape, too few rows, position_ids with "
                            "sbhd or of another length, cu_seqlens_q not from 0 or decreasing, t's elements "
                            "overlapping: refused with a TypeError or ValueError whose message starts with the "
                            "argument at fault, before anything is written"),
    }

    def plans(self, caps):
        lim = limits()
        strides = caps["strides"]

        @st.composite
        def draw(draw):
            rows = draw_sequences(draw, caps, lim)
            thd, cp_size, cp_rank = rows["thd"], rows["cp_size"], rows["cp_rank"]
            dtype, table_dtype, position_ids = rows["dtype"], rows["table_dtype"], rows["position_ids"]
            s, b, lengths, pad = rows["s"], rows["b"], rows["lengths"], rows["pad"]
            t_layout = draw_heads_layout(draw, 3 if thd else 4, strides, lim)
            table_rank = draw(st.sampled_from((4, 2)))
            return Plan(
                draw(seeds()), dtype, table_dtype, thd, s, b, lengths, pad, draw(st.integers(1, lim["h"])),
                draw(st.sampled_from(lim["nope"])), draw(st.sampled_from(lim["emb"])), cp_size, cp_rank,
                draw(st.booleans()) if caps["inverse"] else False,
                draw(st.booleans()) if caps["remove_interleaving"] else False,
                position_ids, draw(st.sampled_from((torch.int32, torch.int64))), draw(st.sampled_from((0, 0, 1, 3))),
                draw(st.booleans()) if caps["elementwise_tables"] else True, table_rank, t_layout,
                draw(layouts(table_rank, padded_dims=(0, table_rank - 1))) if strides else contiguous(table_rank),
                draw(layouts(table_rank, padded_dims=(0, table_rank - 1))) if strides else contiguous(table_rank),
                rows["positions_layout"], draw(st.booleans()) if caps["backward"] and caps["leaf"] else False)

        return domains.with_explicit(draw(), caps)

    def t_shape(self, p: Plan) -> tuple:
        d = p.nope + p.emb
        return (n_tokens(p), p.h, d) if p.thd else (p.s, p.b, p.h, d)

    def build(self, p: Plan, arena) -> Case:
        t = place_heads(arena, self.t_shape(p), p.dtype, p.t_layout)
        tables = build_tables(p, arena)
        rows = tables["cos"].shape[0]
        args = dict(t=t, **tables, nope_dim=p.nope, emb_dim=p.emb)
        args["cu_seqlens_q"] = arena.place(cu_of(p.lengths, p.index_dtype)) if p.thd else None
        args.update(cp_rank=p.cp_rank, cp_size=p.cp_size, rotary_interleaved=False, inverse=p.inverse,
                    remove_interleaving=p.remove_interleaving)
        args["position_ids"] = arena.place(arena.integers(0, rows, (n_tokens(p),), p.index_dtype),
                                           p.positions_layout) if p.position_ids else None
        return Case(p, args, 5, arena.buffers)

    def leaf_args(self, case):
        return ("t",) if case.plan.leaf else ()

    def effects(self, case):
        return ("t",), Returned("t", "t", same="memory")

    def define(self, case, x64):
        p = case.plan
        x = x64["t"]
        rows = token_rows(case, x64)
        cos, sin = (table_2d(x64[n])[rows] for n in ("cos", "sin"))
        cos, sin = (tab[:, None, None] if not p.thd else tab[:, None] for tab in (cos, sin))
        if p.inverse:
            sin = -sin
        nope = x[..., :p.nope]
        left, right, x1, x2 = rotated_pairs(x[..., p.nope:], cos, sin)
        value = torch.cat([left, right, nope], -1)
        source = torch.cat([x1, x2, nope], -1)  # each output channel's input pair, half-split
        return {"t": Expect(value, source, p.emb, False, p.dtype)}

    def read(self, case, name, t):
        p = case.plan
        rope = t[..., p.nope:]
        if p.remove_interleaving:
            rope = deinterleave(rope)
        return torch.cat([rope, t[..., :p.nope]], -1)

    def grad_scale(self, case, arg, up64, expect):
        """Input channels 2i and 2i + 1 get the upstream gradients of output channels i and h + i (as `read` arranges
        them): their pair's scale, in t's channel order; the leading channels are copies of the upstream gradient."""
        p = case.plan
        g = up64[arg].abs()
        half = p.emb // 2
        pair = (g[..., :half] + g[..., half:p.emb]).repeat_interleave(2, -1)
        scale = torch.cat([torch.zeros_like(g[..., p.emb:]), pair], -1)
        return scale, torch.arange(p.nope + p.emb) < p.nope

    def outside(self, plan, caps):
        if plan.dtype not in caps["dtypes"] or plan.table_dtype not in domains.table_dtypes(plan.dtype, caps):
            return f"{plan.dtype} t with {plan.table_dtype} tables"
        why = packing_outside(plan, caps)
        if why:
            return why
        if plan.position_ids and not caps["position_ids"]:
            return "position_ids"
        if not caps["strides"] and plan.t_layout != contiguous(3 if plan.thd else 4):
            return "views (strides)"
        return None


def table_2d(tab):
    """cos or sin as [rows, emb]."""
    return tab.reshape(tab.shape[0], tab.shape[-1])


def token_rows(case, x64, cu_name: str = "cu_seqlens_q") -> torch.Tensor:
    """The table row each token reads (int64: [s], or [T]), from the arguments as given."""
    p = case.plan
    if not p.thd:
        return torch.arange(p.s)
    if by_position_ids(p):
        return x64["position_ids"].long()
    return torch.tensor(megatron_rows(x64[cu_name], n_tokens(p), p.cp_size, p.cp_rank), dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------- invariants
# Oracle-free properties, each comparing the target with itself.

def call(fn, case, up=None, **overrides):
    """fn on the case's arguments, `overrides` replacing some, t a copy of its values (the call writes it): (the
    result, t's gradient from the upstream gradient `up`, or None). With `up`, t is a tensor in the graph copied from
    a leaf, whose gradient is returned."""
    args = {**case.args, **overrides}
    leaf = args["t"].detach().clone().requires_grad_(up is not None)
    with torch.set_grad_enabled(up is not None):
        x = leaf.clone() if up is not None else leaf
        out = replace(case, args={**args, "t": x}).call(fn)
        if up is not None:
            out.backward(up)
    return out.detach(), (leaf.grad if up is not None else None)


def upstream(case, seed):
    return gaussian(case.args["t"].shape, case.args["t"], seed)


def gaussian(shape, like, seed: int) -> torch.Tensor:
    """N(0, 1) values of `shape` from `seed`, in the dtype and on the device of `like` (an upstream gradient)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).to(like.dtype).to(like.device)


def grads(caps) -> bool:
    return caps.get("backward", True)


def nope_untouched(conv, fn, caps, plan):
    """The leading nope_dim channels: bitwise as they were, and their gradient bitwise the upstream gradient's; the
    trailing channels read none of them (the leading channels NaN give bitwise the same trailing channels)."""
    case = make_case(conv, caps, plan)
    x, n = case.args["t"], plan.nope
    up = upstream(case, plan.seed + 6) if grads(caps) else None
    got, grad = call(fn, case, up)
    assert_bitwise(f"the leading {n} channels, against t's", got[..., :n], x[..., :n])
    if grad is not None:
        assert_bitwise(f"the gradient of the leading {n} channels, against the upstream gradient's", grad[..., :n],
                       up[..., :n])
    if n:
        poisoned = x.detach().clone()
        poisoned[..., :n] = float("nan")
        other, _ = call(fn, case, t=poisoned)
        assert_bitwise(f"the trailing channels with t's leading {n} NaN, against with its values", other[..., n:],
                       got[..., n:])


def inverse_undoes(conv, fn, caps, plan):
    """inverse=True with remove_interleaving=True on the result (its trailing channels interleaved back where the call
    wrote them half-split) gives back t: within two roundings and the tables' on the trailing channels
    (compare.assert_undone), bitwise on the leading ones. Tables with equal halves: with two, the map is no
    rotation."""
    if not (caps["inverse"] and caps["remove_interleaving"]):
        return
    case = make_case(conv, caps, plan._replace(inverse=False, equal_halves=True))
    x0, n = case.args["t"].detach().clone(), plan.nope
    once, _ = call(fn, case)
    if not plan.remove_interleaving:
        once = torch.cat([once[..., :n], interleave(once[..., n:])], -1)
    back, _ = call(fn, case, t=once, inverse=True, remove_interleaving=True)
    assert_undone("inverse: t", to_front(back, plan.emb), to_front(x0, plan.emb), plan.emb, True,
                  case.args["cos"].dtype, caps.get("accuracy", "float32"))


def quarter_turns(case, seed):
    """cos, sin of the case's tables' shape and dtype, each entry a quarter turn ((1, 0), (0, 1), (-1, 0) or
    (0, -1)), drawn per column (per pair where the halves must be equal)."""
    cos = case.args["cos"]
    gen = torch.Generator().manual_seed(seed)
    rows, emb = cos.shape[0], cos.shape[-1]
    if case.caps["elementwise_tables"]:
        turn = torch.randint(0, 4, (rows, emb), generator=gen)
    else:
        turn = torch.randint(0, 4, (rows, emb // 2), generator=gen).repeat(1, 2)
    c = torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=torch.float64)[turn]
    s = torch.tensor([0.0, 1.0, 0.0, -1.0], dtype=torch.float64)[turn]
    return tuple(v.reshape(cos.shape).to(cos.dtype).to(cos.device) for v in (c, s))


def remove_interleaving_permutes(conv, fn, caps, plan):
    """remove_interleaving=True writes what remove_interleaving=False writes, each pair moved from (i, h + i) to
    (2i, 2i + 1); the leading channels alike. Bitwise on quarter-turn tables (every product then exactly an input
    channel, its negation or zero, in any order of evaluation): this pins the permutation and the table column of
    every channel; on the case's tables within two roundings (a target may order either mode's operations otherwise),
    and so are the gradients."""
    if not caps["remove_interleaving"]:
        return
    case = make_case(conv, caps, plan._replace(remove_interleaving=False))
    n = plan.nope
    c, s = quarter_turns(case, plan.seed + 4)
    half_split, _ = call(fn, case, cos=c, sin=s)
    written, _ = call(fn, case, cos=c, sin=s, remove_interleaving=True)
    want = torch.cat([half_split[..., :n], interleave(half_split[..., n:])], -1)
    assert_bitwise("remove_interleaving=True on quarter-turn tables, against False's pairs interleaved", written, want)
    up = upstream(case, plan.seed + 5) if grads(caps) else None
    half_split, g_half = call(fn, case, up)
    up_moved = None if up is None else torch.cat([up[..., :n], interleave(up[..., n:])], -1)
    written, g_written = call(fn, case, up_moved, remove_interleaving=True)
    model = caps.get("accuracy", "float32")
    x = case.args["t"]
    pairs = torch.cat([deinterleave(x[..., n:]), x[..., :n]], -1)  # output channel i's input pair at (i, h + i)
    got = torch.cat([deinterleave(written[..., n:]), written[..., :n]], -1)
    assert_within("remove_interleaving=True, its pairs read back half-split, against False", got,
                  to_front(half_split, plan.emb), pairs, plan.emb, False, 2, model)
    if up is not None:  # input channels (2i, 2i + 1) get the upstream gradients of output channels i and h + i
        assert_within("the gradient with remove_interleaving=True (the upstream gradient moved alike), against False",
                      to_front(g_written, plan.emb), to_front(g_half, plan.emb), to_front(up_moved, plan.emb),
                      plan.emb, True, 2, model)


def shard_tokens(lengths, cp_size: int, rank: int) -> torch.Tensor:
    """The global token indices rank `rank` holds in the dual-chunk layout: chunks rank and 2 cp_size - 1 - rank of
    every sequence."""
    idx, offset = [], 0
    for n in lengths:
        c = n // (2 * cp_size)
        for chunk in (rank, 2 * cp_size - 1 - rank):
            idx.extend(range(offset + chunk * c, offset + (chunk + 1) * c))
        offset += n
    return torch.tensor(idx, dtype=torch.int64)


def packed_plan(plan, unit: int, **fields):
    """The plan as packed sequences on one rank (no padding), each length a multiple of `unit` with tokens (a batch
    entry of an sbhd plan a sequence); `fields` replace the convention's own (contiguous thd layouts, no
    position_ids)."""
    lengths = plan.lengths if plan.thd else (plan.s,) * plan.b
    cap = 1 if small() else 4
    lengths = tuple(unit * max(1, min(n // unit, cap)) for n in lengths) or (unit,)
    return plan._replace(thd=True, lengths=lengths, pad=0, cp_size=1, cp_rank=0, **fields)


def _packed(plan, unit: int) -> Plan:
    return packed_plan(plan, unit, position_ids=False, t_layout=contiguous(3))


def drawn_ranks(size: int, plan) -> range:
    return range(size) if not small() else (plan.seed % size,)  # on the CPU one rank per example, drawn


def context_parallel(conv, fn, caps, plan):
    """Dual-chunk context parallelism: every rank's call (cp_size, cp_rank, the sequences' cu_seqlens_q on all ranks)
    on its two chunks of each sequence gives bitwise the unsharded call's rows at those tokens, forward and backward.
    sbhd reads neither: the call with cp_size > 1 and any cp_rank is bitwise the call without."""
    if not caps["context_parallel"]:
        return
    size = plan.cp_size if plan.cp_size > 1 else 2
    if caps["thd"]:
        full = make_case(conv, caps, _packed(plan, 2 * size))
        x, up = full.args["t"], upstream(full, plan.seed + 7)
        want, want_grad = call(fn, full, up if grads(caps) else None)
        for rank in drawn_ranks(size, plan):
            tokens = shard_tokens(full.plan.lengths, size, rank).to(x.device)
            local_up = up.index_select(0, tokens) if grads(caps) else None
            out, grad = call(fn, full, local_up, t=x.index_select(0, tokens), cp_size=size, cp_rank=rank)
            assert_bitwise(f"rank {rank} of {size}, against the unsharded call's tokens", out,
                           want.index_select(0, tokens))
            if grad is not None:
                assert_bitwise(f"the gradient on rank {rank} of {size}, against the unsharded call's tokens", grad,
                               want_grad.index_select(0, tokens))
    sbhd = plan._replace(thd=False, s=max(plan.s, 1), lengths=(), pad=0, position_ids=False, cp_size=1, cp_rank=0,
                         t_layout=contiguous(4))
    case = make_case(conv, caps, sbhd)
    up = upstream(case, plan.seed + 8) if grads(caps) else None
    want, want_grad = call(fn, case, up)
    rank = plan.seed % size
    out, grad = call(fn, case, up, cp_size=size, cp_rank=rank)
    assert_bitwise(f"sbhd with cp_size {size}, cp_rank {rank}, against cp_size 1", out, want)
    if grad is not None:
        assert_bitwise(f"the gradient of sbhd with cp_size {size}, cp_rank {rank}, against cp_size 1", grad, want_grad)


def position_ids_shards(conv, fn, caps, plan):
    """Contiguous context parallelism through position_ids: a rank holding the r-th contiguous part of every
    sequence, called with its tokens, their rows in their sequences as position_ids, its own cu_seqlens_q and any
    cp_size and cp_rank (position_ids replace the dual-chunk map), gives bitwise the unsharded call's rows at those
    tokens, forward and backward."""
    if not (caps["thd"] and caps["position_ids"]):
        return
    size = plan.cp_size if plan.cp_size > 1 else 2
    full = make_case(conv, caps, _packed(plan, size))
    x, up = full.args["t"], upstream(full, plan.seed + 9)
    want, want_grad = call(fn, full, up if grads(caps) else None)
    dtype = plan.index_dtype
    for rank in drawn_ranks(size, plan):
        tokens, rows, offset = [], [], 0
        for n in full.plan.lengths:
            part = range(rank * n // size, (rank + 1) * n // size)
            tokens += [offset + j for j in part]
            rows += list(part)
            offset += n
        tokens = torch.tensor(tokens, dtype=torch.int64, device=x.device)
        local_cu = cu_of([n // size for n in full.plan.lengths], dtype).to(x.device)
        positions = torch.tensor(rows, dtype=dtype, device=x.device)
        local_up = up.index_select(0, tokens) if grads(caps) else None
        out, grad = call(fn, full, local_up, t=x.index_select(0, tokens), cu_seqlens_q=local_cu,
                         position_ids=positions, cp_size=size, cp_rank=rank)
        assert_bitwise(f"rank {rank} of {size} by position_ids, against the unsharded call's tokens", out,
                       want.index_select(0, tokens))
        if grad is not None:
            assert_bitwise(f"the gradient on rank {rank} of {size} by position_ids, against the unsharded call's "
                           f"tokens", grad, want_grad.index_select(0, tokens))


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: each sequence (an sbhd batch entry, a packed thd sequence with its cu_seqlens_q
    [0, length] and its position_ids) called alone gives bitwise its rows in the whole call, forward and backward
    (what an RL trainer needs of the rollout engine's kernel); sbhd also with the batch rolled by one."""
    p = plan._replace(b=max(plan.b, 2)) if not plan.thd else plan
    case = make_case(conv, caps, p)
    x, up = case.args["t"], upstream(case, plan.seed + 3)
    g = up if grads(caps) else None
    want, want_grad = call(fn, case, g)
    if p.thd:
        pid = case.args.get("position_ids")
        for i, span, cu in sequences_alone(case, "cu_seqlens_q"):
            extra = dict(cu_seqlens_q=cu)
            if pid is not None:
                extra["position_ids"] = pid[span].clone()
            out, grad = call(fn, case, None if g is None else g[span].clone(), t=x[span].clone(), **extra)
            assert_bitwise(f"batch invariance: sequence {i} alone, against in the whole call", out, want[span])
            if grad is not None:
                assert_bitwise(f"batch invariance: the gradient of sequence {i} alone, against in the whole call",
                               grad, want_grad[span])
        return
    for i in sorted({0, p.b - 1, plan.seed % p.b}):
        out, grad = call(fn, case, None if g is None else g[:, i:i + 1].clone(), t=x[:, i:i + 1].clone())
        assert_bitwise(f"batch invariance: batch entry {i} alone, against in the batch of {p.b}", out,
                       want[:, i:i + 1])
        if grad is not None:
            assert_bitwise(f"batch invariance: the gradient of batch entry {i} alone, against in the batch", grad,
                           want_grad[:, i:i + 1])
    out, grad = call(fn, case, None if g is None else torch.roll(g, 1, 1), t=torch.roll(x, 1, 1))
    assert_bitwise("batch invariance: the batch rolled by one, against the whole call's rolled", out,
                   torch.roll(want, 1, 1))
    if grad is not None:
        assert_bitwise("batch invariance: the gradients of the batch rolled by one, against the whole call's rolled",
                       grad, torch.roll(want_grad, 1, 1))


def sequences_alone(case, cu_name: str) -> list:
    """(i, its local tokens, the cu_seqlens of it alone) for the packed sequences of the case with tokens (on the CPU
    the first two): alone, its local length as in the whole call (Megatron divides each bound by cp_size, not the
    length)."""
    p = case.plan
    bounds = [int(v) // p.cp_size for v in case.args[cu_name].tolist()]
    spans = [(i, slice(a, e)) for i, (a, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)) if e > a]
    device = case.args[cu_name].device
    return [(i, span, torch.tensor([0, (span.stop - span.start) * p.cp_size], dtype=p.index_dtype, device=device))
            for i, span in (spans[:2] if small() else spans)]


def bad_flags_and_tables(case) -> list:
    """`bad_inputs` of the flags, the context-parallel rank and the tables, which the Megatron conventions share."""
    p, a = case.plan, case.args
    cos, sin = a["cos"], a["sin"]
    rows = cos.shape[0]

    def tables(shape, v=0.5):
        return dict(cos=cos.new_full(shape, v), sin=sin.new_full(shape, v))

    return [
        (("rotary_interleaved",), dict(rotary_interleaved=True)),
        (("remove_interleaving",), dict(remove_interleaving=1)),
        (("cp_rank",), dict(cp_size=p.cp_size, cp_rank=p.cp_size)),
        (("cp_rank",), dict(cp_rank=-1)),
        (("cp_size",), dict(cp_size=0, cp_rank=0)),
        (("cos",), dict(cos=table_2d(cos)[:, None], sin=table_2d(sin)[:, None])),
        (("cos",), tables((rows, 1, 1, p.emb + 4))),
        (("sin", "cos"), dict(sin=sin.new_full((rows + 1, *sin.shape[1:]), 0.5))),
        (("cos",), dict(cos=cos.to(torch.int64), sin=sin.to(torch.int64))),
        (("cos", "sin"), dict(cos=cos.to(other_device()), sin=sin.to(other_device()))),
    ]


def bad_packing(case, cu_name: str, by_rows: bool) -> list:
    """`bad_inputs` of cu_seqlens (thd): its type, dtype and shape; `by_rows` (its values give the rows), not from 0,
    decreasing, and the tables one row short."""
    p, a = case.plan, case.args
    cu = a[cu_name]
    bad = [
        ((cu_name,), {cu_name: cu.tolist()}),
        ((cu_name,), {cu_name: cu.float()}),
        ((cu_name,), {cu_name: cu[None]}),
        ((cu_name,), {cu_name: cu[:0]}),
    ]
    if by_rows:
        total = int(cu[-1])
        bad += [
            ((cu_name,), {cu_name: cu + p.cp_size}),  # not starting at 0
            ((cu_name,), {cu_name: torch.tensor([0, total + p.cp_size, total], dtype=cu.dtype, device=cu.device)}),
        ]
        need = table_rows_needed(p)
        if need:
            bad.append((("cos", "sin"), dict(cos=a["cos"][:need - 1], sin=a["sin"][:need - 1])))
    return bad


def bad_inputs(case) -> list:
    """(names a message may start with, argument overrides) for each bad call the case gives; each breaks one thing
    of a valid call."""
    p, a = case.plan, case.args
    t, cos, sin = a["t"], a["cos"], a["sin"]
    dev = t.device
    rows = cos.shape[0]
    bad = [
        (("t",), dict(t=t.detach().cpu().tolist())),
        (("t",), dict(t=t.to(torch.int32))),
        (("t", "nope_dim", "emb_dim"), dict(nope_dim=p.nope + 1)),
        (("nope_dim", "t"), dict(nope_dim=-1)),
        (("emb_dim", "t", "nope_dim"), dict(emb_dim=p.emb - 2, nope_dim=p.nope + 2)),
        (("emb_dim",), dict(emb_dim=float(p.emb))),
        (("inverse",), dict(inverse="yes")),
        *bad_flags_and_tables(case),
    ]
    if t.dim() and t.shape[0] > 1:
        bad.append((("t",), dict(t=t[:1].expand(t.shape))))  # overlapping elements: not writable in place
    need = table_rows_needed(p)
    if not p.thd:
        bad.append((("t",), dict(t=t[:, 0])))  # three dims without cu_seqlens_q
        bad.append((("position_ids",), dict(position_ids=torch.zeros(p.s, dtype=torch.int64, device=dev))))
        if need:
            bad.append((("cos", "sin"), dict(cos=cos[:need - 1], sin=sin[:need - 1])))
        return bad
    n = n_tokens(p)
    pid = a.get("position_ids")
    bad += [(("t",), dict(t=t[:, None])), *bad_packing(case, "cu_seqlens_q", pid is None)]  # t: four dims with it
    if pid is not None:
        bad += [
            (("position_ids",), dict(position_ids=pid[:n - 1] if n else pid.new_zeros(1))),
            (("position_ids",), dict(position_ids=pid.float())),
        ]
        if n:
            over = pid.clone()
            over[-1] = rows
            under = pid.clone()
            under[0] = -1
            bad += [(("position_ids", "cos"), dict(position_ids=over)), (("position_ids",), dict(position_ids=under))]
    return bad


def other_device():
    """A device other than the tensors': the CPU beside a GPU; beside the CPU `meta` (it holds no data)."""
    return "cpu" if DEVICE.type != "cpu" else "meta"


refuses_bad_input = refusing(bad_inputs)


MegatronMLA.INVARIANTS = {
    "nope_untouched": nope_untouched,
    "inverse_undoes": inverse_undoes,
    "remove_interleaving_permutes": remove_interleaving_permutes,
    "context_parallel": context_parallel,
    "position_ids_shards": position_ids_shards,
    "batch_rows_alone": batch_rows_alone,
    "refuses_bad_input": refuses_bad_input,
}


# ------------------------------------------------------------------------------------------------- the domain

def _tables_domain(arg: str) -> tuple:
    def pair(p):
        return p.dtype, p.table_dtype

    return (*domains.pairings(pair), domains.table_16bit_float32_input(pair, "mixed_tables"),
            *domains.layouts(arg),
            domains.cls("[rows, 1, 1, emb_dim]", lambda p, c: p.table_rank == 4),
            domains.cls("[rows, emb_dim]", lambda p, c: p.table_rank == 2),
            domains.cls("halves equal (cat(freqs, freqs))", lambda p, c: p.equal_halves),
            domains.cls("halves differ", lambda p, c: not p.equal_halves, "elementwise_tables"),
            domains.cls("rows past the last one read", lambda p, c: p.extra_rows > 0))


def _thd(cap: str = "thd"):
    return lambda caps: not caps["thd"] or not caps.get(cap, True)


def packing_classes(arg: str) -> tuple:
    """The classes of cu_seqlens (named `arg`): omitted or a tensor, its dtypes, an empty sequence, two with tokens,
    padding rows past the last, lengths no multiple of 2 cp_size."""
    return (*domains.optional(arg, "a tensor [n + 1] (thd)", other_off=_thd()),
            domains.cls("int32", lambda p, c: p.thd and p.index_dtype == torch.int32, off=_thd()),
            domains.cls("int64", lambda p, c: p.thd and p.index_dtype == torch.int64, off=_thd()),
            domains.cls("an empty sequence", lambda p, c: p.thd and 0 in p.lengths and sum(p.lengths) > 0, off=_thd()),
            domains.cls("two sequences with tokens", lambda p, c: p.thd and sum(map(bool, p.lengths)) > 1,
                        off=_thd()),
            domains.cls("rows past the last sequence (padding)", lambda p, c: p.thd and p.pad > 0, "padding",
                        off=_thd("padding")),
            domains.cls("a length no multiple of 2 cp_size (cp_size > 1)",
                        lambda p, c: p.thd and p.cp_size > 1 and any(n % (2 * p.cp_size) for n in p.lengths),
                        "uneven_cp", off=lambda caps: _thd()(caps) or not caps["context_parallel"]
                        or not caps["uneven_cp"]))


def packing_outside(plan, caps):
    """What of a plan's packing lies outside the capabilities (thd, context parallelism, padding rows), or None."""
    if plan.thd and not caps["thd"]:
        return "thd (thd)"
    if plan.cp_size > 1 and not caps["context_parallel"]:
        return "context parallelism (context_parallel)"
    if plan.pad and not caps["padding"]:
        return "padding rows (padding)"
    return None


def heads_classes(layout, wide: str, leaf: str) -> tuple:
    """The classes of a tensor of heads ([s, b, h, d] or [T, h, d]) beyond its dtype and layout: within wider rows
    (`layout(plan)` a Wide), each format, its token count, one head or several, a batch, a leaf."""
    return (domains.cls(wide, lambda p, c: isinstance(layout(p), Wide), "strides"),
            domains.cls("sbhd [s, b, h, d]", lambda p, c: not p.thd),
            domains.cls("thd [T, h, d]", lambda p, c: p.thd, "thd"),
            *domains.sizes(lambda p: n_tokens(p), "empty", "tokens"),
            domains.cls("one head", lambda p, c: p.h == 1),
            domains.cls("several heads", lambda p, c: p.h > 1),
            domains.cls("sbhd batch > 1", lambda p, c: not p.thd and p.b > 1),
            domains.cls(leaf, lambda p, c: p.leaf, "leaf"))

MegatronMLA.DOMAIN = {
    "t": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("t"),
          *heads_classes(lambda p: p.t_layout, "a head within a wider row", "a leaf that requires grad (backward)")),
    "cos": _tables_domain("cos"),
    "sin": _tables_domain("sin"),
    "nope_dim": (domains.cls("0 (the whole head rotated)", lambda p, c: p.nope == 0),
                 domains.cls("odd", lambda p, c: p.nope % 2 == 1),
                 domains.cls("even > 0", lambda p, c: p.nope > 0 and p.nope % 2 == 0)),
    "emb_dim": (domains.cls("4 (two pairs)", lambda p, c: p.emb == 4) if small() else
                domains.cls("64 (DeepSeek's)", lambda p, c: p.emb == 64),
                domains.cls("another multiple of 4", lambda p, c: p.emb != (4 if small() else 64))),
    "cu_seqlens_q": packing_classes("cu_seqlens_q"),
    "cp_rank": (*domains.optional("cp_rank", "rank > 0", "context_parallel"),
                domains.cls("the last rank of 4", lambda p, c: p.cp_size == 4 and p.cp_rank == 3, "context_parallel")),
    "cp_size": (*domains.optional("cp_size", "2 or 4", "context_parallel"),
                domains.cls("4", lambda p, c: p.cp_size == 4, "context_parallel"),
                domains.cls("thd with cp_size > 1", lambda p, c: p.thd and p.cp_size > 1 and not by_position_ids(p),
                            off=lambda caps: not caps["context_parallel"] or not caps["thd"]),
                domains.cls("sbhd with cp_size > 1 (not read)", lambda p, c: not p.thd and p.cp_size > 1,
                            "context_parallel")),
    "rotary_interleaved": (domains.cls("omitted", lambda p, c: domains.passed(c, "rotary_interleaved") is None),
                           domains.cls("explicit default (False)",
                                       lambda p, c: domains.passed(c, "rotary_interleaved") == "default",
                                       "explicit_defaults")),
    "inverse": domains.optional("inverse", "True", "inverse"),
    "remove_interleaving": domains.optional("remove_interleaving", "True", "remove_interleaving"),
    "position_ids": (*domains.optional("position_ids", "a tensor [T] (thd)", "position_ids",
                                       other_off=_thd("position_ids")),
                     domains.cls("int32", lambda p, c: p.position_ids and p.index_dtype == torch.int32,
                                 off=_thd("position_ids")),
                     domains.cls("int64", lambda p, c: p.position_ids and p.index_dtype == torch.int64,
                                 off=_thd("position_ids")),
                     domains.cls("with cp_size > 1 (no map)", lambda p, c: p.position_ids and p.cp_size > 1,
                                 off=lambda caps: _thd("position_ids")(caps) or not caps["context_parallel"]),
                     domains.spaced("position_ids")),
}


def pin(thd=False, dtype=torch.bfloat16, table_dtype=torch.bfloat16, **fields) -> Plan:
    base = dict(seed=0, dtype=dtype, table_dtype=table_dtype, thd=thd, s=3, b=2, lengths=(), pad=0, h=2, nope=128,
                emb=64, cp_size=1, cp_rank=0, inverse=False, remove_interleaving=False, position_ids=False,
                index_dtype=torch.int32, extra_rows=0, equal_halves=True, table_rank=4,
                t_layout=contiguous(3 if thd else 4), cos_layout=contiguous(4), sin_layout=contiguous(4),
                positions_layout=contiguous(1))
    return Plan(**{**base, **fields})


# DeepSeek's q heads (128 nope + 64 rope) in bfloat16: sbhd with Megatron's tables in t's dtype; packed sequences on
# rank 1 of 2 with an empty sequence and CUDA-graph padding, float32 tables; the attention output rotated back
# (inverse, remove_interleaving) as DeepSeek-V4's training does; packed sequences with padding rows without
# context parallelism (the padding rows read row 0 of the tables, as on every rank).
PINS = (pin(seed=1),
        pin(True, table_dtype=torch.float32, lengths=(8, 0, 4), pad=3, cp_size=2, cp_rank=1, seed=2),
        pin(True, torch.float32, torch.float32, lengths=(5, 3), inverse=True, remove_interleaving=True, nope=0,
            seed=3),
        pin(True, lengths=(3, 5), pad=2, seed=4))
MegatronMLA.PINS = PINS

CONVENTION = MegatronMLA()
