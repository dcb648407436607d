"""Megatron-LM's MLA key/value split (`megatron.core.fusions.fused_mla_yarn_rope_apply`):
    fused_mla_rope_kv_split(kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens_kv=None, cp_rank=0, cp_size=1,
                            rotary_interleaved=False, remove_interleaving=False, out_key=None, out_value=None)
        -> (key, value)
kv [s, b, h, k_dim + v_dim] (sbhd, cu_seqlens_kv None) or [T, h, k_dim + v_dim] (thd: packed sequences,
cu_seqlens_kv [n + 1] of their lengths on all ranks), the up-projection of MLA's compressed kv; k_pos_emb
[s, b, 1, emb_dim] or [T, 1, emb_dim], the one rope head every head shares, in any float dtype; cos, sin as
megatron-mla's (spec/megatron_mla.py). Each token's table row p as megatron-mla finds it without position_ids (sbhd:
the s index, cp_rank and cp_size not read; thd: the offset in its sequence by the local bounds cu_seqlens_kv //
cp_size, the dual-chunk map for cp_size > 1, row 0 past the last sequence). k_pos_emb's pairs x1 = pe[2i],
x2 = pe[2i + 1] give (h = emb_dim / 2)
    left_i = x1 cos[p, i] - x2 sin[p, i]          right_i = x2 cos[p, h + i] + x1 sin[p, h + i]
and key = cat(kv[..., :k_dim], rope) on every head, rope half-split (left_i at i, right_i at h + i), or interleaved
with remove_interleaving (2i, 2i + 1); value = kv[..., k_dim:]. Both in kv's dtype: new tensors, or written into
out_key and out_value (both or neither) and those returned; no argument is written otherwise. rotary_interleaved
must be False. Gradients: kv's, the upstream gradients of key's leading k_dim channels and of value side by side;
k_pos_emb's, the transpose of the rotation applied to the sum over the heads of key's rope-channel gradients.

Accuracy. key's rope channels: the rotation within the accuracy model on the scale of k_pos_emb's pairs; key's
leading channels and value: bitwise copies, and so is kv's gradient. k_pos_emb's gradient: the head sum S = sum_h g_h
may be rounded once to kv's dtype before the rotation's transpose (Megatron's kernel sums in float32 and rounds to the
gradient's dtype; a broadcast whose backward sums the heads rounds alike). With P the pair scale of sum_h |g_h|, that
rounding (within EPS of kv's dtype relative, accuracy.py's bound of one rounding) and a float32 sum of h terms in any
order add at most (EPS + h 2^-24) P; the scale handed to the model is P (1 + (EPS + h 2^-24) / unit), unit the model's
factor on its scale (F32_EVAL for float32 math, EPS of k_pos_emb's dtype for dtype math).

The shared accuracy helpers take the rotated channels first, as half-split pairs, then the copies: key is read with its
rope channels de-interleaved where remove_interleaving wrote them interleaved, moved ahead of the leading ones.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import accuracy
from ..compare import assert_bitwise
from ..contract import Returned
from ..run import make_case
from ..tensors import DTYPES, Layout, Wide, contiguous, layouts, place_heads, seeds
from . import Case, Convention, Expect, domains, small
from .hf import refusing
from .hf_deepseek_v3 import deinterleave, interleave
from .megatron_mla import (
    MegatronMLA,
    bad_flags_and_tables,
    bad_packing,
    build_tables,
    cu_of,
    draw_heads_layout,
    draw_sequences,
    drawn_ranks,
    gaussian,
    grads,
    heads_classes,
    limits,
    n_tokens,
    other_device,
    packed_plan,
    packing_classes,
    packing_outside,
    quarter_turns,
    rotated_pairs,
    sequences_alone,
    shard_tokens,
    table_2d,
    table_rows_needed,
    token_rows,
)


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype  # kv's, and so key's and value's
    pe_dtype: torch.dtype  # k_pos_emb's
    table_dtype: torch.dtype
    thd: bool  # kv [T, h, d] with cu_seqlens_kv; else [s, b, h, d]
    s: int  # sbhd: tokens per sequence
    b: int  # sbhd: batch
    lengths: tuple  # thd: each sequence's length on all ranks
    pad: int  # thd: rows past the last sequence (CUDA-graph padding)
    h: int
    k_dim: int
    v_dim: int
    emb: int
    cp_size: int
    cp_rank: int
    remove_interleaving: bool
    index_dtype: torch.dtype  # cu_seqlens_kv's
    extra_rows: int  # table rows past the last one read
    equal_halves: bool  # cos, sin as cat(f, f); else every column its own
    table_rank: int  # 4: [rows, 1, 1, emb]; 2: [rows, emb]
    kv_layout: object  # a tensors.Layout or a Wide
    pe_layout: object  # the same: a Wide is k_pos_emb sliced from the compressed projection's rows, as MLA's is
    cos_layout: Layout
    sin_layout: Layout
    out_layout: object = None  # out_key's and out_value's Layout; None: no out buffers
    leaf: bool = False  # the backward property passes kv and k_pos_emb as leaves that require grad
    explicit_defaults: bool = False


def widths() -> dict:
    """k_dim and v_dim drawn: powers of two first (Megatron's kernel takes tl.arange over each), then odd ones."""
    if small():
        return dict(k=(4, 2, 8, 3), v=(4, 2, 5))
    return dict(k=(128, 64, 3), v=(128, 64, 5))  # DeepSeek's: 128 and 128


def pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class MegatronMLAKV(Convention):
    NAME = "megatron-mla-kv"
    PARAMETER_CAPS = {"remove_interleaving": {"remove_interleaving": False},
                      "out_key": {"out_key": False, "out_value": False}}
    SIGNATURE = ("kv", "k_pos_emb", "cos", "sin", "emb_dim", "k_dim", "v_dim", "cu_seqlens_kv", "cp_rank", "cp_size",
                 "rotary_interleaved", "remove_interleaving", "out_key", "out_value")
    OPTIONAL = {"cu_seqlens_kv": None, "cp_rank": 0, "cp_size": 1, "rotary_interleaved": False,
                "remove_interleaving": False, "out_key": None, "out_value": None}
    DIFFERENTIABLE = ("kv", "k_pos_emb")
    CAPS = {
        "dtypes": (DTYPES, "dtypes of kv (and of k_pos_emb)"),
        "pe_dtypes": (True, "k_pos_emb in another float dtype than kv (key stays in kv's)"),
        "float32_tables": (True, "cos/sin in float32 with 16-bit kv (the result stays kv's dtype)"),
        "mixed_tables": (True, "cos/sin in the other 16-bit dtype than kv, or 16-bit with float32 kv"),
        "elementwise_tables": (True, "cos/sin whose two halves differ (channel 2i + 1 reads column h + i)"),
        "thd": (True, "kv [T, h, d] with cu_seqlens_kv (packed sequences)"),
        "context_parallel": (True, "cp_size > 1: thd's dual-chunk rows of cp_rank; sbhd's rows unchanged"),
        "uneven_cp": (True, "thd sequences whose length is no multiple of 2 cp_size under cp_size > 1"),
        "padding": (True, "thd rows past the last sequence (CUDA-graph padding): row 0"),
        "remove_interleaving": (True, "remove_interleaving=True: the rope pairs written back interleaved"),
        "out_key": (True, "out_key and out_value given: the results written into them and they returned"),
        "out_value": (True, "out_value given (with out_key: both or neither)"),
        "odd_widths": (True, "k_dim and v_dim not powers of two (Megatron's kernel takes tl.arange over each)"),
        "strides": (True, "views: kv permuted, padded or its heads within wider rows; k_pos_emb a slice of wider "
                          "rows; cos, sin and the out buffers sliced from wider buffers"),
        "backward": (True, "the gradients of kv and k_pos_emb"),
        "leaf": (True, "backward on kv and k_pos_emb leaves that require grad, as Megatron's tests pass them"),
        "accuracy": ("float32", "accuracy model (accuracy.py): float32 math and one rounding, or dtype math"),
        "empty": (True, "no token: s = 0, or thd with every sequence empty"),
        "bad_input": (True, "a head other than k_dim + v_dim, k_pos_emb not [..., 1, emb_dim] of kv's tokens, "
                            "emb_dim no multiple of 4, rotary_interleaved=True, cp_rank outside [0, cp_size), tables "
                            "of another shape or too few rows, cu_seqlens_kv not from 0 or decreasing, one out buffer "
                            "alone, out buffers of another shape or dtype, requiring grad, overlapping or sharing "
                            "memory with an input: refused with a TypeError or ValueError whose message starts with "
                            "the argument at fault, before anything is written"),
    }

    def plans(self, caps):
        lim, wid = limits(), widths()
        strides = caps["strides"]
        k_dims = wid["k"] if caps["odd_widths"] else tuple(filter(pow2, wid["k"]))
        v_dims = wid["v"] if caps["odd_widths"] else tuple(filter(pow2, wid["v"]))

        @st.composite
        def draw(draw):
            rows = draw_sequences(draw, caps, lim)
            ndim = 3 if rows["thd"] else 4
            dtype = rows["dtype"]
            kv_layout = draw_heads_layout(draw, ndim, strides, lim)
            pe_layout = draw_heads_layout(draw, ndim, strides, lim)
            k_dim = draw(st.sampled_from(k_dims))
            v_dim = k_dim if k_dim in v_dims and draw(st.booleans()) else draw(st.sampled_from(v_dims))
            others = tuple(d for d in caps["dtypes"] if d != dtype) if caps["pe_dtypes"] else ()
            pe_dtype = draw(st.sampled_from((dtype, dtype, *others)))
            out_layout = None
            if caps["out_key"] and draw(st.booleans()):
                out_layout = draw(layouts(ndim)) if strides else contiguous(ndim)
            table_rank = draw(st.sampled_from((4, 2)))
            return Plan(
                draw(seeds()), dtype, pe_dtype, rows["table_dtype"], rows["thd"], rows["s"], rows["b"],
                rows["lengths"], rows["pad"], draw(st.integers(1, lim["h"])), k_dim, v_dim,
                draw(st.sampled_from(lim["emb"])), rows["cp_size"], rows["cp_rank"],
                draw(st.booleans()) if caps["remove_interleaving"] else False,
                draw(st.sampled_from((torch.int32, torch.int64))), draw(st.sampled_from((0, 0, 1, 3))),
                draw(st.booleans()) if caps["elementwise_tables"] else True, table_rank, kv_layout, pe_layout,
                draw(layouts(table_rank, padded_dims=(0, table_rank - 1))) if strides else contiguous(table_rank),
                draw(layouts(table_rank, padded_dims=(0, table_rank - 1))) if strides else contiguous(table_rank),
                out_layout, draw(st.booleans()) if caps["backward"] and caps["leaf"] else False)

        return domains.with_explicit(draw(), caps)

    def build(self, p: Plan, arena) -> Case:
        lead = (n_tokens(p),) if p.thd else (p.s, p.b)
        kv = place_heads(arena, (*lead, p.h, p.k_dim + p.v_dim), p.dtype, p.kv_layout)
        pe = place_heads(arena, (*lead, 1, p.emb), p.pe_dtype, p.pe_layout)
        args = dict(kv=kv, k_pos_emb=pe, **build_tables(p, arena), emb_dim=p.emb, k_dim=p.k_dim, v_dim=p.v_dim)
        # by keyword where they differ from the defaults (settle_defaults passes the defaults where the plan says)
        if p.thd:
            args["cu_seqlens_kv"] = arena.place(cu_of(p.lengths, p.index_dtype))
        if p.cp_size > 1:
            args.update(cp_rank=p.cp_rank, cp_size=p.cp_size)
        if p.remove_interleaving:
            args["remove_interleaving"] = True
        if p.out_layout is not None:  # NaN until written
            for name, width in (("out_key", p.k_dim + p.emb), ("out_value", p.v_dim)):
                args[name] = arena.place(torch.full((*lead, p.h, width), float("nan"), dtype=p.dtype), p.out_layout)
        return Case(p, args, 7, arena.buffers)

    def leaf_args(self, case):
        return ("kv", "k_pos_emb") if case.plan.leaf else ()

    def effects(self, case):
        if case.args.get("out_key") is None:
            return (), (Returned("key"), Returned("value"))
        return ("out_key", "out_value"), (Returned("key", "out_key", same="memory"),
                                          Returned("value", "out_value", same="memory"))

    def define(self, case, x64):
        p = case.plan
        rows = token_rows(case, x64, "cu_seqlens_kv")
        cos, sin = (table_2d(x64[n])[rows] for n in ("cos", "sin"))
        cos, sin = (tab[:, None, None] if not p.thd else tab[:, None] for tab in (cos, sin))
        kv = x64["kv"]
        heads = (*kv.shape[:-1], p.emb)
        left, right, x1, x2 = rotated_pairs(x64["k_pos_emb"], cos, sin)
        rope, pairs = torch.cat([left, right], -1).expand(heads), torch.cat([x1, x2], -1).expand(heads)
        nope, value = kv[..., :p.k_dim], kv[..., p.k_dim:]
        return {"key": Expect(torch.cat([rope, nope], -1), torch.cat([pairs, nope], -1), p.emb, False, p.dtype),
                "value": Expect(value, value, 0, False, p.dtype)}

    def read(self, case, name, t):
        if name != "key":
            return t
        p = case.plan
        rope = t[..., p.k_dim:]
        return torch.cat([deinterleave(rope) if p.remove_interleaving else rope, t[..., :p.k_dim]], -1)

    def grad_scale(self, case, arg, up64, expect):
        """kv's gradient: copies of the upstream gradients (scale 0, bitwise). k_pos_emb's channels 2i and 2i + 1: the
        pair scale of key's rope channels i and h + i summed over the heads (as `read` arranges them), widened by the
        head sum's rounding (`pe_grad_factor`)."""
        p = case.plan
        if arg == "kv":
            lead = up64["value"].shape[:-1]
            return torch.zeros(*lead, p.k_dim + p.v_dim, dtype=torch.float64), torch.ones(p.k_dim + p.v_dim,
                                                                                         dtype=torch.bool)
        g = up64["key"][..., :p.emb].abs()
        half = p.emb // 2
        pair = (g[..., :half] + g[..., half:]).sum(-2, keepdim=True).repeat_interleave(2, -1)
        return pair * pe_grad_factor(case), torch.zeros(p.emb, dtype=torch.bool)

    def outside(self, plan, caps):
        if plan.dtype not in caps["dtypes"] or plan.table_dtype not in domains.table_dtypes(plan.dtype, caps):
            return f"{plan.dtype} kv with {plan.table_dtype} tables"
        if plan.pe_dtype != plan.dtype and not (caps["pe_dtypes"] and plan.pe_dtype in caps["dtypes"]):
            return f"{plan.pe_dtype} k_pos_emb with {plan.dtype} kv (pe_dtypes)"
        why = packing_outside(plan, caps)
        if why:
            return why
        if plan.remove_interleaving and not caps["remove_interleaving"]:
            return "remove_interleaving"
        if plan.out_layout is not None and not caps["out_key"]:
            return "out buffers (out_key)"
        if not caps["odd_widths"] and not (pow2(plan.k_dim) and pow2(plan.v_dim)):
            return "k_dim or v_dim not a power of two (odd_widths)"
        ndim = 3 if plan.thd else 4
        if not caps["strides"] and any(x not in (None, contiguous(ndim)) for x in (plan.kv_layout, plan.pe_layout,
                                                                                    plan.out_layout)):
            return "views (strides)"
        return None


def pe_grad_factor(case) -> float:
    """1 + (EPS + h 2^-24) / unit (the module's accuracy note): the head sum rounded once to kv's dtype and summed in
    float32 in any order, in units of what the model allows per unit of scale."""
    p = case.plan
    model = case.caps.get("accuracy", "float32")
    unit = accuracy.F32_EVAL if model == "float32" else accuracy.EPS[p.pe_dtype]
    return 1 + (accuracy.EPS[p.dtype] + p.h * 2.0**-24) / unit


# ---------------------------------------------------------------------------------------------------- invariants
# Oracle-free properties, each comparing the target with itself.

OUTPUTS = ("key", "value", "the gradient of kv", "the gradient of k_pos_emb")


def call(fn, case, ups=None, **overrides) -> tuple:
    """fn on the case's arguments, `overrides` replacing some, kv and k_pos_emb copies, and, where the case passes out
    buffers, new ones (NaN, of the results' shapes): (key, value, kv's gradient, k_pos_emb's gradient), the results
    copied out. With `ups` (key's and value's upstream gradients) kv and k_pos_emb are leaves whose gradients are
    returned; without, the gradients are None."""
    args = {**case.args, **overrides}
    grad = ups is not None
    leaves = {n: args[n].detach().clone().requires_grad_(grad) for n in ("kv", "k_pos_emb")}
    args.update(leaves)
    if args.get("out_key") is not None:
        lead, dtype = tuple(args["kv"].shape[:-1]), args["kv"].dtype
        for name, width in (("out_key", args["k_dim"] + args["emb_dim"]), ("out_value", args["v_dim"])):
            args[name] = torch.full((*lead, width), float("nan"), dtype=dtype, device=args["kv"].device)
    with torch.set_grad_enabled(grad):
        key, value = replace(case, args=args).call(fn)
        if grad:
            torch.autograd.backward((key, value), ups)
    return (key.detach().clone(), value.detach().clone(),
            *(leaves[n].grad if grad else None for n in ("kv", "k_pos_emb")))


def upstreams(case, seed: int) -> tuple:
    """key's and value's upstream gradients: N(0, 1) from `seed`, in kv's dtype."""
    p, kv = case.plan, case.args["kv"]
    lead = tuple(kv.shape[:-1])
    return gaussian((*lead, p.k_dim + p.emb), kv, seed), gaussian((*lead, p.v_dim), kv, seed + 1)


def assert_same(what: str, got: tuple, want: tuple, pick=lambda x: x):
    """Each output of `call` bitwise equal to `pick` of the other call's (the gradients where both have them)."""
    for name, g, w in zip(OUTPUTS, got, want, strict=True):
        if g is not None and w is not None:
            assert_bitwise(f"{what}: {name}", g, pick(w))


def rope_shared_by_heads(conv, fn, caps, plan):
    """k_pos_emb rotated once for all heads: every head's rope channels bitwise head 0's; the last head's key and value
    bitwise those of a call on that head of kv alone (h = 1); and, from an upstream gradient on that head alone (zero
    on the others), k_pos_emb's gradient bitwise the one-head call's (a sum over the heads adds only zeros to it)."""
    case = make_case(conv, caps, plan)
    p, kv = plan, case.args["kv"]
    key, value, _, _ = call(fn, case)
    for j in range(1, p.h):
        assert_bitwise(f"key's rope channels of head {j}, against head 0's", key[..., j, p.k_dim:],
                       key[..., 0, p.k_dim:])
    j = p.h - 1
    ups = None
    if grads(caps):
        drawn, value_up = upstreams(case, plan.seed + 2)
        key_up = torch.zeros_like(drawn)
        key_up[..., j, :] = drawn[..., j, :]
        ups = (key_up, torch.zeros_like(value_up))
    whole = call(fn, case, ups)
    alone = call(fn, case, None if ups is None else tuple(u[..., j:j + 1, :] for u in ups), kv=kv[..., j:j + 1, :])
    assert_bitwise(f"head {j} of kv alone: key, against in the call of {p.h} heads", alone[0], key[..., j:j + 1, :])
    assert_bitwise(f"head {j} of kv alone: value, against in the call of {p.h} heads", alone[1],
                   value[..., j:j + 1, :])
    if ups is not None:
        assert_bitwise(f"the gradient of k_pos_emb from head {j} alone, against from head {j} of {p.h} (the others "
                       f"zero)", alone[3], whole[3])


def nope_and_v_copied(conv, fn, caps, plan):
    """key's leading k_dim channels bitwise kv's, value bitwise kv's trailing v_dim channels, kv's gradient bitwise the
    upstream gradients of those channels side by side; key's rope channels read nothing of kv (kv NaN gives them
    bitwise), and the copies nothing of k_pos_emb (k_pos_emb NaN gives them bitwise)."""
    case = make_case(conv, caps, plan)
    p, kv, k = plan, case.args["kv"], plan.k_dim
    ups = upstreams(case, plan.seed + 6) if grads(caps) else None
    key, value, g_kv, _ = call(fn, case, ups)
    assert_bitwise(f"key's leading {k} channels, against kv's", key[..., :k], kv[..., :k])
    assert_bitwise(f"value, against kv's trailing {p.v_dim} channels", value, kv[..., k:])
    if g_kv is not None:
        assert_bitwise("the gradient of kv, against the upstream gradients of key's leading channels and of value",
                       g_kv, torch.cat([ups[0][..., :k], ups[1]], -1))
    nan_kv = call(fn, case, kv=torch.full_like(kv, float("nan")))
    assert_bitwise("key's rope channels with kv NaN, against with its values", nan_kv[0][..., k:], key[..., k:])
    nan_pe = call(fn, case, k_pos_emb=torch.full_like(case.args["k_pos_emb"], float("nan")))
    assert_bitwise("key's leading channels with k_pos_emb NaN, against with its values", nan_pe[0][..., :k],
                   key[..., :k])
    assert_bitwise("value with k_pos_emb NaN, against with its values", nan_pe[1], value)


def remove_interleaving_permutes(conv, fn, caps, plan):
    """remove_interleaving=True gives False's key with each rope pair moved from (i, h + i) to (2i, 2i + 1), the rest
    bitwise alike, and from upstream gradients moved alike the same gradients. Bitwise on quarter-turn tables (every
    product then exactly an input, its negation or zero, in any order of evaluation), which pins the permutation and
    every channel's table column, forward and backward."""
    if not caps["remove_interleaving"]:
        return
    case = make_case(conv, caps, plan._replace(remove_interleaving=False))
    k = plan.k_dim
    c, s = quarter_turns(case, plan.seed + 4)
    ups = upstreams(case, plan.seed + 5) if grads(caps) else None
    half_split = call(fn, case, ups, cos=c, sin=s)
    moved = None if ups is None else (torch.cat([ups[0][..., :k], interleave(ups[0][..., k:])], -1), ups[1])
    written = call(fn, case, moved, cos=c, sin=s, remove_interleaving=True)
    want = (torch.cat([half_split[0][..., :k], interleave(half_split[0][..., k:])], -1), *half_split[1:])
    assert_same("remove_interleaving=True on quarter-turn tables, against False's pairs interleaved", written, want)


def context_parallel(conv, fn, caps, plan):
    """Dual-chunk context parallelism: every rank's call (cp_size, cp_rank, the sequences' cu_seqlens_kv on all ranks)
    on its two chunks of each sequence gives bitwise the unsharded call's rows at those tokens: key, value and both
    gradients. sbhd reads neither: the call with cp_size > 1 and any cp_rank is bitwise the call without."""
    if not caps["context_parallel"]:
        return
    size = plan.cp_size if plan.cp_size > 1 else 2
    if caps["thd"]:
        full = make_case(conv, caps, packed_plan(plan, 2 * size, kv_layout=contiguous(3), pe_layout=contiguous(3),
                                                 out_layout=None))
        kv, pe = full.args["kv"], full.args["k_pos_emb"]
        ups = upstreams(full, plan.seed + 7) if grads(caps) else None
        want = call(fn, full, ups)
        for rank in drawn_ranks(size, plan):
            tokens = shard_tokens(full.plan.lengths, size, rank).to(kv.device)
            local = None if ups is None else tuple(u.index_select(0, tokens) for u in ups)
            got = call(fn, full, local, kv=kv.index_select(0, tokens), k_pos_emb=pe.index_select(0, tokens),
                       cp_size=size, cp_rank=rank)
            assert_same(f"rank {rank} of {size}, against the unsharded call's tokens", got, want,
                        lambda w, tokens=tokens: w.index_select(0, tokens))
    sbhd = plan._replace(thd=False, s=max(plan.s, 1), lengths=(), pad=0, cp_size=1, cp_rank=0,
                         kv_layout=contiguous(4), pe_layout=contiguous(4), out_layout=None)
    case = make_case(conv, caps, sbhd)
    ups = upstreams(case, plan.seed + 8) if grads(caps) else None
    rank = plan.seed % size
    assert_same(f"sbhd with cp_size {size}, cp_rank {rank}, against cp_size 1",
                call(fn, case, ups, cp_size=size, cp_rank=rank), call(fn, case, ups))


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: each sequence (an sbhd batch entry, a packed thd sequence with its cu_seqlens_kv
    [0, length]) called alone gives bitwise its rows in the whole call, key, value and both gradients; sbhd also with
    the batch rolled by one."""
    p = plan._replace(b=max(plan.b, 2)) if not plan.thd else plan
    case = make_case(conv, caps, p)
    kv, pe = case.args["kv"], case.args["k_pos_emb"]
    ups = upstreams(case, plan.seed + 3) if grads(caps) else None
    want = call(fn, case, ups)
    if p.thd:
        for i, span, cu in sequences_alone(case, "cu_seqlens_kv"):
            got = call(fn, case, None if ups is None else tuple(u[span].clone() for u in ups), kv=kv[span].clone(),
                       k_pos_emb=pe[span].clone(), cu_seqlens_kv=cu)
            assert_same(f"batch invariance: sequence {i} alone, against in the whole call", got, want,
                        lambda w, span=span: w[span])
        return
    for i in sorted({0, p.b - 1, plan.seed % p.b}):
        got = call(fn, case, None if ups is None else tuple(u[:, i:i + 1].clone() for u in ups),
                   kv=kv[:, i:i + 1].clone(), k_pos_emb=pe[:, i:i + 1].clone())
        assert_same(f"batch invariance: batch entry {i} alone, against in the batch of {p.b}", got, want,
                    lambda w, i=i: w[:, i:i + 1])
    got = call(fn, case, None if ups is None else tuple(torch.roll(u, 1, 1) for u in ups), kv=torch.roll(kv, 1, 1),
               k_pos_emb=torch.roll(pe, 1, 1))
    assert_same("batch invariance: the batch rolled by one, against the whole call's rolled", got, want,
                lambda w: torch.roll(w, 1, 1))


def bad_inputs(case) -> list:
    """(names a message may start with, argument overrides) for each bad call the case gives; each breaks one thing
    of a valid call."""
    p, a = case.plan, case.args
    kv, pe, cos, sin = a["kv"], a["k_pos_emb"], a["cos"], a["sin"]
    n = kv.shape[0]
    bad = [
        (("kv",), dict(kv=kv.detach().cpu().tolist())),
        (("kv",), dict(kv=kv.to(torch.int32))),
        (("k_pos_emb",), dict(k_pos_emb=pe.detach().cpu().tolist())),
        (("k_pos_emb",), dict(k_pos_emb=pe.to(torch.float64))),
        (("kv", "k_dim", "v_dim"), dict(k_dim=p.k_dim + 1)),
        (("v_dim", "kv"), dict(v_dim=-1)),
        (("emb_dim", "k_pos_emb", "cos"), dict(emb_dim=p.emb - 2)),
        (("emb_dim",), dict(emb_dim=float(p.emb))),
        (("k_pos_emb",), dict(k_pos_emb=pe.expand(*pe.shape[:-2], 2, p.emb))),  # a head per kv head
        (("k_pos_emb",), dict(k_pos_emb=pe.new_zeros((*pe.shape[:-1], p.emb + 4)))),
        (("k_pos_emb",), dict(k_pos_emb=pe.new_zeros((n + 1, *pe.shape[1:])))),  # another token count
        (("k_pos_emb",), dict(k_pos_emb=pe.to(other_device()))),
        *bad_flags_and_tables(case),
    ]
    if not p.thd:
        bad.append((("kv",), dict(kv=kv[:, 0])))  # three dims without cu_seqlens_kv
        need = table_rows_needed(p)
        if need:
            bad.append((("cos", "sin"), dict(cos=cos[:need - 1], sin=sin[:need - 1])))
    else:
        bad += [(("kv",), dict(kv=kv[:, None])), *bad_packing(case, "cu_seqlens_kv", True)]  # kv: four dims with it
    if case.caps["out_key"]:
        bad += _bad_outputs(case)
    # a target without the parameter refuses it as Python does, naming no argument
    return [b for b in bad if case.caps["remove_interleaving"] or "remove_interleaving" not in b[1]]


def _bad_outputs(case) -> list:
    """`bad_inputs` of the out buffers (whether or not the case passes them)."""
    p, kv = case.plan, case.args["kv"]
    lead = tuple(kv.shape[:-1])
    key = torch.full((*lead, p.k_dim + p.emb), float("nan"), dtype=kv.dtype, device=kv.device)
    value = torch.full((*lead, p.v_dim), float("nan"), dtype=kv.dtype, device=kv.device)
    other = torch.float16 if kv.dtype != torch.float16 else torch.bfloat16
    bad = [
        (("out_value", "out_key"), dict(out_key=key, out_value=None)),
        (("out_key", "out_value"), dict(out_key=None, out_value=value)),
        (("out_key",), dict(out_key=key.tolist(), out_value=value)),
        (("out_key",), dict(out_key=key[..., 1:], out_value=value)),
        (("out_value",), dict(out_key=key, out_value=value.to(other))),
        (("out_key",), dict(out_key=key.clone().requires_grad_(), out_value=value)),
    ]
    if lead and lead[0] > 1 and p.v_dim:
        bad.append((("out_value",), dict(out_key=key, out_value=value[:1].expand(value.shape))))  # elements overlap
    if kv.numel() and p.v_dim:
        bad.append((("out_value",), dict(out_key=key, out_value=kv[..., p.k_dim:])))  # kv's own memory
    return bad


refuses_bad_input = refusing(bad_inputs)


MegatronMLAKV.INVARIANTS = {
    "rope_shared_by_heads": rope_shared_by_heads,
    "nope_and_v_copied": nope_and_v_copied,
    "remove_interleaving_permutes": remove_interleaving_permutes,
    "context_parallel": context_parallel,
    "batch_rows_alone": batch_rows_alone,
    "refuses_bad_input": refuses_bad_input,
}


# ------------------------------------------------------------------------------------------------- the domain

def _buffer_classes(arg: str) -> tuple:
    return (*domains.optional(arg, "a buffer", cap=arg),
            domains.cls("a strided view", lambda p, c: domains.layout_kind(c.args.get(arg)) == "strided", "strides",
                        off=lambda caps: not caps[arg] or not caps["strides"]))


MegatronMLAKV.DOMAIN = {
    "kv": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("kv"),
           *heads_classes(lambda p: p.kv_layout, "heads within wider rows", "leaves that require grad (backward)")),
    "k_pos_emb": (domains.cls("kv's dtype", lambda p, c: p.pe_dtype == p.dtype),
                  domains.cls("another dtype than kv's", lambda p, c: p.pe_dtype != p.dtype, "pe_dtypes"),
                  *domains.layouts("k_pos_emb"),
                  domains.cls("a slice of wider rows (the compressed projection's)",
                              lambda p, c: isinstance(p.pe_layout, Wide), "strides")),
    "cos": MegatronMLA.DOMAIN["cos"],
    "sin": MegatronMLA.DOMAIN["sin"],
    "emb_dim": MegatronMLA.DOMAIN["emb_dim"],
    "k_dim": (domains.cls("a power of two", lambda p, c: pow2(p.k_dim)),
              domains.cls("not a power of two", lambda p, c: not pow2(p.k_dim), "odd_widths"),
              domains.cls("k_dim == v_dim (DeepSeek's)", lambda p, c: p.k_dim == p.v_dim),
              domains.cls("k_dim != v_dim", lambda p, c: p.k_dim != p.v_dim)),
    "v_dim": (domains.cls("a power of two", lambda p, c: pow2(p.v_dim)),
              domains.cls("not a power of two", lambda p, c: not pow2(p.v_dim), "odd_widths")),
    "cu_seqlens_kv": packing_classes("cu_seqlens_kv"),
    "cp_rank": MegatronMLA.DOMAIN["cp_rank"],
    "cp_size": MegatronMLA.DOMAIN["cp_size"],
    "rotary_interleaved": MegatronMLA.DOMAIN["rotary_interleaved"],
    # the capability, named for the argument, also keeps its explicit default undrawn (a release without it)
    "remove_interleaving": domains.optional("remove_interleaving", "True", cap="remove_interleaving"),
    "out_key": _buffer_classes("out_key"),
    "out_value": _buffer_classes("out_value"),
}


def pin(thd=False, dtype=torch.bfloat16, table_dtype=torch.bfloat16, **fields) -> Plan:
    ndim = 3 if thd else 4
    base = dict(seed=0, dtype=dtype, pe_dtype=dtype, table_dtype=table_dtype, thd=thd, s=3, b=2, lengths=(), pad=0,
                h=2, k_dim=128, v_dim=128, emb=64, cp_size=1, cp_rank=0, remove_interleaving=False,
                index_dtype=torch.int32, extra_rows=0, equal_halves=True, table_rank=4, kv_layout=contiguous(ndim),
                pe_layout=contiguous(ndim), cos_layout=contiguous(4), sin_layout=contiguous(4))
    return Plan(**{**base, **fields})


# DeepSeek's kv heads (128 + 128) and its 64-channel rope head in bfloat16, sbhd with Megatron's tables in kv's dtype;
# packed sequences on rank 1 of 2 with an empty sequence and CUDA-graph padding, float32 tables; float32 kv with a
# bfloat16 rope head, written back interleaved into the caller's buffers.
PINS = (pin(seed=1),
        pin(True, table_dtype=torch.float32, lengths=(8, 0, 4), pad=3, cp_size=2, cp_rank=1, seed=2),
        pin(True, torch.float32, torch.float32, pe_dtype=torch.bfloat16, lengths=(5, 3), remove_interleaving=True,
            out_layout=contiguous(3), seed=3))
MegatronMLAKV.PINS = PINS

CONVENTION = MegatronMLAKV()
