"""TransformerEngine's packed-QKV convention:
    apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd",
                                   start_positions=None, interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0)
    -> (q, k, v)
qkv [s, b, h, nq + nk + nv] (sbhd) or [b, s, h, nq + nk + nv] (bshd), (nq, nk, nv) = qkv_split_arg_list, nq a
multiple of nk. Each head's last dimension holds q, k and v; q's part is nq / nk heads of width nk (head g of
q's result is part g % (nq / nk) of qkv head g // (nq / nk)). q is rotated by q_freqs, k by k_freqs (angles
[s2, 1, 1, d2], read as float32, d2 even and <= nk; channels d2.. copied), v is copied; the three are new
contiguous tensors, and the gradient flows to qkv. Token j of sequence i is at position cp_position(j) +
start_positions[i] (docs/contract.md section 3: with cp_size > 1 a rank holds chunks cp_rank and
2 cp_size - 1 - cp_rank of every sequence, c = s / 2 tokens each). `cu_seqlens` is accepted and unused (thd is
not a packed-QKV format).

The gradient of qkv is assembled from three outputs' upstream gradients: `grad_scale` gives the generic
backward its accuracy scale part by part.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional

import torch
from hypothesis import strategies as st

from .. import pairing
from ..compare import assert_bitwise
from ..contract import Returned
from ..positions import token_positions
from ..run import make_case
from ..tensors import DTYPES, Layout, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, small

FORMATS = ("sbhd", "bshd")


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    freqs_dtype: torch.dtype
    tensor_format: str
    s: int  # tokens per sequence on this rank
    b: int
    h: int
    groups: int  # nq / nk
    nk: int
    nv: int
    d2: int
    interleaved: bool
    equal_halves: bool  # the two members of each pair share an angle (RotaryPositionEmbedding's freqs)
    start_dtype: Optional[torch.dtype]  # start_positions' dtype; None: not passed
    cp_size: int
    cp_rank: int
    q_rows: int  # q_freqs' rows past the last position
    k_rows: int
    qkv_layout: Layout
    freqs_layout: Layout
    explicit_defaults: bool = False  # optional arguments passed where they hold their defaults


def positions_of(p: Plan, start) -> torch.Tensor:
    """[b, s] int64: position j of the rank's part of a sequence, mapped by the dual-chunk layout, then shifted by
    the sequence's start."""
    return token_positions((p.b, p.s), "bshd", start, None, p.cp_size, p.cp_rank)


def split(p: Plan, qkv):
    """q [.., h * groups, nk], k [.., h, nk], v [.., h, nv] out of qkv [.., h, nq + nk + nv] (views or copies)."""
    nq = p.groups * p.nk
    q, k, v = qkv[..., :nq], qkv[..., nq: nq + p.nk], qkv[..., nq + p.nk:]
    return q.reshape(*qkv.shape[:2], p.h * p.groups, p.nk), k, v


def start_dtypes(caps) -> tuple:
    """None (not passed) and the index dtypes the target takes for start_positions."""
    return (None, torch.int32, torch.int64) if caps["int64_start_positions"] else (None, torch.int32)


class TEQKV(Convention):
    NAME = "te-qkv"
    SIGNATURE = ("qkv", "q_freqs", "k_freqs", "qkv_split_arg_list", "tensor_format", "start_positions",
                 "interleaved", "cu_seqlens", "cp_size", "cp_rank")
    DIFFERENTIABLE = ("qkv",)
    CAPS = {
        "dtypes": (DTYPES, "dtypes of qkv"),
        "freqs_dtypes": (DTYPES, "dtypes of q_freqs and k_freqs (read as float32)"),
        "formats": (FORMATS, "tensor formats"),
        "groups": (True, "nq a multiple of nk other than nk (q heads grouped per qkv head)"),
        "partial": (True, "d2 < nk: channels d2.. copied"),
        "interleaved": (True, "interleaved (GPT-J) pairs"),
        "elementwise_freqs": (True, "angles that differ within a pair (freqs act channel by channel)"),
        "start_positions": (True, "start_positions, int32 or int64 [b]"),
        "int64_start_positions": (True, "start_positions of dtype int64 (not only int32)"),
        "backward_start_positions": (True, "the gradient of a call with start_positions"),
        "v_width": (True, "v's head width nv other than k's nk"),
        "context_parallel": (True, "cp_size > 1: the dual-chunk positions of cp_rank"),
        "cp_start_positions": (True, "start_positions together with cp_size > 1 (TE's own function refuses it)"),
        "strides": (True, "qkv and the freqs as views (permuted, padded); TE's function needs them contiguous"),
        "backward": (True, "the gradient of qkv"),
        "accuracy": ("float32", "accuracy model (accuracy.py): float32 math and one rounding, or dtype math"),
        "empty": (True, "qkv without elements: s = 0 or b = 0"),
    }
    INVARIANTS: dict = {}  # filled below

    OPTIONAL = {"tensor_format": "sbhd", "start_positions": None, "interleaved": False, "cu_seqlens": None,
                "cp_size": 1, "cp_rank": 0}

    def plans(self, caps):
        lim = dict(s=5, b=2, h=3, nk=(2, 4, 6, 8), nv=8, groups=3, extra=2) if small() else \
            dict(s=256, b=3, h=8, nk=(32, 64, 80, 128), nv=128, groups=8, extra=64)

        @st.composite
        def draw(draw):
            cp_size = draw(st.sampled_from((1, 1, 2, 3))) if caps["context_parallel"] else 1
            s = draw(st.integers(1, lim["s"]))
            if cp_size > 1 and s:
                s = 2 * max(1, s // 2)  # two chunks of s / 2 tokens
            nk = draw(st.sampled_from(lim["nk"]))
            d2 = draw(st.sampled_from(range(2, nk + 1, 2))) if caps["partial"] and draw(st.booleans()) else nk
            start = draw(st.sampled_from(start_dtypes(caps))) if caps["start_positions"] else None
            if cp_size > 1 and not caps["cp_start_positions"]:
                start = None
            return Plan(
                draw(seeds()), draw(st.sampled_from(caps["dtypes"])), draw(st.sampled_from(caps["freqs_dtypes"])),
                draw(st.sampled_from(caps["formats"])), s, draw(st.integers(1, lim["b"])),
                draw(st.integers(1, lim["h"])), draw(st.integers(1, lim["groups"])) if caps["groups"] else 1,
                nk, draw(st.one_of(st.just(nk), st.integers(1, lim["nv"]))) if caps["v_width"] else nk, d2,
                draw(st.booleans()) if caps["interleaved"] else False,
                draw(st.booleans()) if caps["elementwise_freqs"] else True,
                start, cp_size, draw(st.integers(0, cp_size - 1)),
                draw(st.integers(0, lim["extra"])), draw(st.integers(0, lim["extra"])),
                draw(layouts(4)) if caps["strides"] else contiguous(4),
                draw(layouts(4)) if caps["strides"] else contiguous(4))

        @st.composite
        def with_empty(draw):  # drawn last: the other choices stay as they were
            p = draw(plain)
            return p._replace(**{n: 0 for n in domains.empty_dims(draw, caps["empty"], ("b", "s"), all_first=False)})

        plain = draw()
        return domains.with_explicit(with_empty(), caps)

    def backward_plan(self, plan, caps):
        return plan if caps["backward_start_positions"] else plan._replace(start_dtype=None)

    def freqs(self, p: Plan, arena, rows: int):
        """Angles [rows, 1, 1, d2] in freqs_dtype: one per pair where the halves are equal, else one per channel."""
        if p.equal_halves:
            angles = pairing.per_channel(arena.angles((rows, p.d2 // 2)), p.interleaved)
        else:
            angles = arena.angles((rows, p.d2))
        return arena.place(angles.to(p.freqs_dtype).reshape(rows, 1, 1, p.d2), p.freqs_layout)

    def build(self, p: Plan, arena) -> Case:
        width = p.groups * p.nk + p.nk + p.nv
        shape = (p.s, p.b, p.h, width) if p.tensor_format == "sbhd" else (p.b, p.s, p.h, width)
        qkv = arena.randn(shape, p.dtype, p.qkv_layout)
        start = arena.integers(0, 4, (p.b,)) if p.start_dtype is not None else None
        # freqs must reach every position: of s tokens even where b = 0 (TE checks s against freqs' rows), none
        # where s = 0
        pos = positions_of(p._replace(b=max(p.b, 1)), start if p.b else None)
        last = int(pos.max()) if pos.numel() else -1
        args = dict(qkv=qkv, q_freqs=self.freqs(p, arena, last + 1 + p.q_rows),
                    k_freqs=self.freqs(p, arena, last + 1 + p.k_rows),
                    qkv_split_arg_list=[p.groups * p.nk, p.nk, p.nv], tensor_format=p.tensor_format)
        if start is not None:
            args["start_positions"] = arena.place(start.to(p.start_dtype))
        args["interleaved"] = p.interleaved
        if p.cp_size > 1:
            args["cp_size"], args["cp_rank"] = p.cp_size, p.cp_rank
        return Case(p, args, 4, arena.buffers)

    def effects(self, case):
        return (), (Returned("q"), Returned("k"), Returned("v"))

    def define(self, case, x64):
        p = case.plan
        q, k, v = split(p, x64["qkv"])
        pos = positions_of(p, x64.get("start_positions"))
        out = {}
        for name, x in (("q", q), ("k", k)):
            theta = x64[f"{name}_freqs"][:, 0, 0, :].float().double()[pos]  # read as float32; [b, s, d2]
            if p.tensor_format == "sbhd":
                theta = theta.transpose(0, 1)
            theta = theta.unsqueeze(2)  # over the heads
            out[name] = Expect(pairing.rotate(x, theta.cos(), theta.sin(), p.interleaved), x, p.d2, p.interleaved,
                               p.dtype)
        out["v"] = Expect(v, v, 0, p.interleaved, p.dtype)
        return out

    def grad_scale(self, case, arg, up64: dict, expect=None):
        """The accuracy scale of qkv's gradient and where it is a copy of the upstream gradient: q's part from q's
        upstream pairs (nq / nk heads of width nk per qkv head), k's from k's, v's a copy."""
        p = case.plan
        lead = up64["k"].shape[:3]
        parts = [pairing.pair_scale(up64["q"], p.d2, p.interleaved).reshape(*lead, p.groups * p.nk),
                 pairing.pair_scale(up64["k"], p.d2, p.interleaved), torch.zeros(*lead, p.nv, dtype=torch.float64)]
        head = pairing.copied_mask(p.nk, p.d2)
        copied = torch.cat([head.repeat(p.groups), head, torch.ones(p.nv, dtype=torch.bool)])
        return torch.cat(parts, dim=-1), copied


# ---------------------------------------------------------------------------------------------- invariants

def call(fn, case, **overrides):
    args = {**case.args, **overrides}
    return replace(case, args={n: v for n, v in args.items() if v is not None}).call(fn)


def seq_dim(fmt: str) -> int:
    return 0 if fmt == "sbhd" else 1


def v_copied(conv, fn, caps, plan):
    """v is qkv's v part, bitwise; q, k and v are new contiguous tensors."""
    case = make_case(conv, caps, plan)
    q, k, v = call(fn, case)
    assert_bitwise("v against qkv's v part", v, split(plan, case.args["qkv"])[2])
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.is_contiguous(), f"{name}: a new contiguous tensor was promised, got strides {t.stride()}"


def q_k_agree(conv, fn, caps, plan):
    """With nq == nk, equal q and k parts and k_freqs = q_freqs, q's and k's results are bitwise equal: the
    two paths are one rotation."""
    case = make_case(conv, caps, plan._replace(groups=1))
    qkv = case.args["qkv"].clone()
    qkv[..., plan.nk: 2 * plan.nk] = qkv[..., : plan.nk]
    q, k, _ = call(fn, case, qkv=qkv, k_freqs=case.args["q_freqs"])
    assert_bitwise("k's result against q's for equal parts and angles", k, q)


def formats_transposed(conv, fn, caps, plan):
    """bshd on the [b, s, ...] copy of an sbhd qkv gives the sbhd results transposed, bitwise."""
    if set(caps["formats"]) != set(FORMATS):
        return
    case = make_case(conv, caps, plan._replace(tensor_format="sbhd"))
    want = call(fn, case)
    got = call(fn, case, qkv=case.args["qkv"].transpose(0, 1).contiguous(), tensor_format="bshd")
    for name, g, w in zip("qkv", got, want, strict=True):
        assert_bitwise(f"bshd {name} against sbhd's transposed", g, w.transpose(0, 1))


def start_positions_shift(conv, fn, caps, plan):
    """start_positions[i] = P gives sequence i the results of freqs shifted by P rows without start_positions,
    bitwise, for q and k alike."""
    if not caps["start_positions"]:
        return
    p = plan._replace(start_dtype=plan.start_dtype or start_dtypes(caps)[-1], cp_size=1, cp_rank=0)
    case = make_case(conv, caps, p)
    want = call(fn, case)
    dim = seq_dim(p.tensor_format) ^ 1  # the batch dim
    for i, start in enumerate(case.args["start_positions"].tolist()):
        one = case.args["qkv"].narrow(dim, i, 1).contiguous()
        got = call(fn, case, qkv=one, q_freqs=case.args["q_freqs"][start:], k_freqs=case.args["k_freqs"][start:],
                   start_positions=None)
        for name, g, w in zip("qkv", got, want, strict=True):
            assert_bitwise(f"sequence {i}: {name} with freqs shifted by start_positions {start}", g,
                           w.narrow(dim, i, 1))


def cp_shards(conv, fn, caps, plan):
    """A rank's call (cp_size, cp_rank) on its two chunks of each sequence equals the unsharded call on the whole
    sequence at those tokens, bitwise."""
    if not caps["context_parallel"]:
        return
    size = plan.cp_size if plan.cp_size > 1 else 2
    rank, chunk = plan.seed % size, max(1, plan.s // 2)
    start = plan.start_dtype if caps["cp_start_positions"] else None
    full = make_case(conv, caps, plan._replace(s=2 * size * chunk, cp_size=1, cp_rank=0, start_dtype=start))
    dim = seq_dim(plan.tensor_format)
    tokens = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                        torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)])
    tokens = tokens.to(full.args["qkv"].device)
    want = call(fn, full)
    local = full.args["qkv"].index_select(dim, tokens)
    got = call(fn, full, qkv=local, cp_size=size, cp_rank=rank)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert_bitwise(f"rank {rank} of {size}: {name} against the unsharded call's tokens", g,
                       w.index_select(dim, tokens))


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: each sequence called alone (its batch entry of qkv, its start position given as
    start_positions where the plan passes them) and the batch rolled by one (start_positions rolled alike) give
    bitwise its results in the whole call, forward (q, k and v) and backward (its rows of qkv's gradient, from random
    upstream gradients sliced and rolled alike): what an RL trainer needs of the rollout engine's kernel. qkv lies in
    a contiguous buffer of its own in every call, so that only the batch around a sequence differs."""
    p = plan._replace(b=max(plan.b, 2), s=max(plan.s, 2 if plan.cp_size > 1 else 1))
    grads = caps["backward"] and (p.start_dtype is None or caps["backward_start_positions"])
    case = make_case(conv, caps, p)
    qkv = case.args["qkv"].detach().clone(memory_format=torch.contiguous_format)
    start = case.args.get("start_positions")
    dim = seq_dim(p.tensor_format) ^ 1  # the batch dim, of qkv and of q, k and v alike
    gen = torch.Generator().manual_seed(p.seed + 5)
    ups = [torch.randn(tuple(x.shape), generator=gen, dtype=torch.float64).to(p.dtype).to(qkv.device)
           for x in split(p, qkv)]

    def run_on(x, up, **overrides):
        """([q, k, v], qkv's gradient for upstream `up`, or None without a backward) of one call on qkv = x."""
        leaf = x.clone().requires_grad_(grads)
        with torch.set_grad_enabled(grads):
            out = call(fn, case, qkv=leaf, **overrides)
        if not grads:
            return [o.detach() for o in out], None
        pairs = [(o, u) for o, u in zip(out, up, strict=True) if o.requires_grad]
        grad = torch.autograd.grad([o for o, _ in pairs], leaf, [u for _, u in pairs], allow_unused=True)[0]
        return [o.detach() for o in out], torch.zeros_like(leaf) if grad is None else grad

    out, grad = run_on(qkv, ups)
    for i in sorted({0, p.b - 1, plan.seed % p.b}):
        extra = {} if start is None else dict(start_positions=start[i:i + 1].clone())
        o, g = run_on(qkv.narrow(dim, i, 1), [u.narrow(dim, i, 1).clone() for u in ups], **extra)
        for name, a, w in zip("qkv", o, out, strict=True):
            assert_bitwise(f"batch invariance: {name} of sequence {i} alone, against in the batch of {p.b}", a,
                           w.narrow(dim, i, 1))
        if grads:
            assert_bitwise(f"batch invariance: qkv's gradient of sequence {i} alone, against in the batch of {p.b}",
                           g, grad.narrow(dim, i, 1))
    extra = {} if start is None else dict(start_positions=torch.roll(start, 1, 0))
    o, g = run_on(torch.roll(qkv, 1, dim), [torch.roll(u, 1, dim) for u in ups], **extra)
    for name, r, w in zip("qkv", o, out, strict=True):
        assert_bitwise(f"batch invariance: {name} with the batch rolled by one, against the whole call's rolled", r,
                       torch.roll(w, 1, dim))
    if grads:
        assert_bitwise("batch invariance: qkv's gradient with the batch rolled by one, against the whole call's "
                       "rolled", g, torch.roll(grad, 1, dim))


TEQKV.INVARIANTS = {
    "batch_rows_alone": batch_rows_alone,
    "v_copied": v_copied,
    "q_k_agree": q_k_agree,
    "formats_transposed": formats_transposed,
    "start_positions_shift": start_positions_shift,
    "cp_shards": cp_shards,
}
CONVENTION = TEQKV()


def _freqs_domain(arg: str) -> tuple:
    return (*domains.dtypes(lambda p: p.freqs_dtype, "freqs_dtypes"),
            domains.cls("qkv's dtype", lambda p, c: p.freqs_dtype == p.dtype),
            domains.cls("another dtype than qkv's", lambda p, c: p.freqs_dtype != p.dtype,
                        off=lambda caps: len(caps["freqs_dtypes"]) < 2 and tuple(caps["freqs_dtypes"]) ==
                        tuple(caps["dtypes"])),
            *domains.layouts(arg),
            *domains.widths(lambda p: (p.d2, p.nk)),
            domains.cls("pairs share an angle", lambda p, c: p.equal_halves),
            domains.cls("one angle per channel", lambda p, c: not p.equal_halves, "elementwise_freqs"))


TEQKV.DOMAIN = {
    "qkv": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("qkv"),
            *domains.sizes(lambda p: p.s, "empty", "s"),
            domains.cls("b = 0 (empty)", lambda p, c: p.b == 0, "empty")),
    "q_freqs": _freqs_domain("q_freqs"),
    "k_freqs": domains.layouts("k_freqs"),
    "qkv_split_arg_list": (domains.cls("nq = nk", lambda p, c: p.groups == 1),
                           domains.cls("nq a multiple of nk (groups)", lambda p, c: p.groups > 1, "groups"),
                           domains.cls("nv = nk", lambda p, c: p.nv == p.nk),
                           domains.cls("nv another width", lambda p, c: p.nv != p.nk, "v_width")),
    "tensor_format": (*domains.optional("tensor_format", "bshd", other_off=lambda caps: "bshd" not in caps["formats"]),
                      *domains.flags(lambda p: p.tensor_format, FORMATS, allowed=lambda caps: caps["formats"])),
    "start_positions": (*domains.optional("start_positions", "a tensor [b]", "start_positions"),
                        *(c for c in domains.index_dtypes(lambda p: p.start_dtype, "start_positions")
                          if c.name == "int32"),
                        domains.cls("int64", lambda p, c: p.start_dtype == torch.int64, "int64_start_positions")),
    "interleaved": domains.optional("interleaved", "True", "interleaved"),
    # TE's packed-QKV call takes sbhd and bshd only: cu_seqlens is always left at its default
    "cu_seqlens": domains.optional("cu_seqlens")[:2],
    "cp_size": domains.optional("cp_size", "2 or 3", "context_parallel"),
    "cp_rank": domains.optional("cp_rank", "rank > 0", "context_parallel"),
}
