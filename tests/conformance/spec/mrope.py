"""rope's canonical multimodal RoPE call (TransformerEngine's style, three position streams):
    apply_multimodal_rotary_pos_emb(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                                    mrope_interleaved=False) -> out
t [T, h, d] (thd), [s, b, h, d] (sbhd) or [b, s, h, d] (bshd); freqs [s2, 1, 1, d2] float32 angles, one per
channel, d2 <= d even; positions [3, *lead] int32/int64 (temporal, height, width; lead: t's token dims) or one
stream for all three [*lead], each in [0, s2). Channel c of pair k (k = c // 2 with interleaved GPT-J pairs,
else c mod d2/2) turns by freqs[positions[m, token], c], m the stream of pair k: its section of mrope_section
(pairs per stream, summing to d2/2), or Qwen3-VL's layout with mrope_interleaved (spec/hf_mrope.py). cos and sin
are of the float32 angles (the oracle takes them in float64); channels d2.. are copied. A new tensor of t's shape
and dtype; the gradient flows to t.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import pairing
from ..compare import assert_bitwise, assert_within
from ..contract import Returned
from ..run import inputs64, make_case
from ..tensors import DTYPES, Layout, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, small
from .hf_mrope import other_sections, sections, select, stream_of_channel

FORMATS = ("thd", "sbhd", "bshd")


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    tensor_format: str
    lead: tuple  # t's token dims: (T,), (s, b) or (b, s)
    h: int
    d: int
    d2: int
    rows: int  # s2, freqs' rows
    interleaved: bool
    mrope_interleaved: bool
    section: tuple
    text: bool  # positions [*lead]: one stream for all three
    positions_dtype: torch.dtype
    pair_angles: bool  # both channels of a pair share an angle (freqs built so), else one angle per channel
    t_layout: Layout
    freqs_layout: Layout
    positions_layout: Layout
    explicit_defaults: bool = False  # tensor_format, interleaved, mrope_interleaved passed at their defaults


class MRoPE(Convention):
    NAME = "mrope"
    SIGNATURE = ("t", "freqs", "positions", "mrope_section", "tensor_format", "interleaved", "mrope_interleaved")
    DIFFERENTIABLE = ("t",)
    CAPS = {
        "dtypes": (DTYPES, "dtypes of t"),
        "formats": (FORMATS, "tensor formats"),
        "interleaved": ((False, True), "the pairings: False half-split (i, i + d2/2), True GPT-J (2i, 2i + 1)"),
        "mrope_interleaved": ((False, True), "the section layouts: consecutive (Qwen2-VL), interleaved (Qwen3-VL)"),
        "partial": (True, "a rotary width d2 below d"),
        "text_positions": (True, "positions [*lead]: one stream for all three"),
        "elementwise_freqs": (True, "freqs whose two channels of a pair differ (TE's formula reads one per channel)"),
        "strides": (True, "views: permuted and sliced t, sliced freqs, permuted positions"),
        "int32_positions": (True, "int32 positions as well as int64"),
        "backward": (True, "the gradient for t"),
        "accuracy": ("float32", "accuracy model (accuracy.py): float32 math and one rounding, or dtype math"),
        "empty": (True, "no tokens: a token dim of 0 (T, s or b), t and positions without elements"),
    }

    OPTIONAL = {"tensor_format": "thd", "interleaved": False, "mrope_interleaved": False}

    def plans(self, caps):
        lim = dict(t=6, s=3, b=2, h=3, rows=6, dims=(2, 4, 6, 8, 12, 16)) if small() else \
            dict(t=4096, s=512, b=4, h=16, rows=8192, dims=(2, 6, 64, 80, 128, 256))

        @st.composite
        def draw(draw):
            explicit = domains.explicit_defaults(draw, caps)
            fmt = draw(st.sampled_from(caps["formats"]))
            dims = ("t",) if fmt == "thd" else ("s", "b")
            lead = tuple(draw(st.integers(1, lim[n])) for n in dims)
            if fmt == "bshd":
                lead = lead[::-1]
            d = draw(st.sampled_from(lim["dims"]))
            d2 = 2 * draw(st.integers(1, d // 2)) if caps["partial"] and draw(st.booleans()) else d
            mrope_interleaved = draw(st.sampled_from(caps["mrope_interleaved"]))
            strides = caps["strides"]
            ndim = len(lead) + 2
            zero = domains.empty_dims(draw, caps["empty"], dims)  # drawn last: the other choices stay as they were
            lead = tuple(0 if n in zero else size for n, size in zip(dims, lead, strict=True))
            return Plan(
                draw(seeds()), draw(st.sampled_from(caps["dtypes"])), fmt, lead, draw(st.integers(1, lim["h"])), d, d2,
                draw(st.integers(1, lim["rows"])), draw(st.sampled_from(caps["interleaved"])), mrope_interleaved,
                draw(sections(d2 // 2, mrope_interleaved)), caps["text_positions"] and draw(st.integers(0, 3)) == 0,
                draw(st.sampled_from((torch.int64, torch.int32))) if caps["int32_positions"] else torch.int64,
                draw(st.booleans()) if caps["elementwise_freqs"] else True,
                draw(layouts(ndim)) if strides else contiguous(ndim),
                draw(layouts(4, padded_dims=(0, 3), permute=False)) if strides else contiguous(4),
                draw(layouts(len(lead) + 1)) if strides else contiguous(len(lead) + 1), explicit)

        return draw()

    def build(self, p: Plan, arena) -> Case:
        t = arena.randn((*p.lead, p.h, p.d), p.dtype, p.t_layout)
        if p.pair_angles:
            angles = pairing.per_channel(arena.angles((p.rows, p.d2 // 2)), p.interleaved)
        else:
            angles = arena.angles((p.rows, p.d2))
        freqs = arena.place(angles.float().reshape(p.rows, 1, 1, p.d2), p.freqs_layout)
        shape = p.lead if p.text else (3, *p.lead)
        layout = Layout(tuple(range(len(p.lead))), p.positions_layout.pad[1:]) if p.text else p.positions_layout
        positions = arena.place(arena.integers(0, p.rows, shape, p.positions_dtype), layout)
        args = dict(t=t, freqs=freqs, positions=positions, mrope_section=list(p.section), tensor_format=p.tensor_format,
                    interleaved=p.interleaved, mrope_interleaved=p.mrope_interleaved)
        return Case(p, args, 4, arena.buffers)

    def effects(self, case):
        return (), Returned("t")

    def define(self, case, x64):
        p = case.plan
        angles = x64["freqs"][:, 0, 0, :][x64["positions"].expand(3, *p.lead)]  # [3, *lead, d2]
        channel_stream = stream_of_channel(p.section, p.d2, p.mrope_interleaved, p.interleaved)
        cos, sin = (select(fn(angles), channel_stream).unsqueeze(-2) for fn in (torch.cos, torch.sin))
        return {"t": Expect(pairing.rotate(x64["t"], cos, sin, p.interleaved), x64["t"], p.d2, p.interleaved,
                            p.dtype)}


# ---- invariants -------------------------------------------------------------------------------------------------


def call(case, fn, **changes):
    with torch.no_grad():
        return Case(case.plan, {**case.args, **changes}, case.positional).call(fn)


def equal_streams(conv, fn, caps, plan):
    """Three equal streams: any section split gives the same result, bitwise, as one stream [*lead] does;
    and it is plain RoPE (TE's formula) at those positions."""
    case = make_case(conv, caps, plan)
    p = case.plan
    pos = case.args["positions"]
    one = pos if p.text else pos[0]
    equal = one.expand(3, *p.lead).contiguous()
    got = call(case, fn, positions=equal)
    other = list(other_sections(p.section, p.mrope_interleaved))
    assert_bitwise(f"equal streams, sections {list(p.section)} vs {other}", call(case, fn, positions=equal,
                                                                                mrope_section=other), got)
    if caps["text_positions"]:
        assert_bitwise("positions [*lead] vs [3, *lead] of equal rows", call(case, fn, positions=one.contiguous()), got)
    x64 = inputs64(case)
    angles = x64["freqs"][:, 0, 0, :][one.long().cpu()].unsqueeze(-2)
    ref = pairing.rotate(x64["t"], angles.cos(), angles.sin(), p.interleaved)
    assert_within("equal streams vs plain RoPE", got, ref, x64["t"], p.d2, p.interleaved, 1,
                  caps.get("accuracy", "float32"))


def formats_equivalent(conv, fn, caps, plan):
    """The tensor formats are layouts of one computation: sbhd equals bshd on the transposed views (positions
    transposed alike), and thd on the tokens flattened, bitwise."""
    case = make_case(conv, caps, plan)
    p = case.plan
    t, pos = case.args["t"], case.args["positions"]
    got = call(case, fn)
    streams = 0 if p.text else 1
    if p.tensor_format != "thd":
        other = {"sbhd": "bshd", "bshd": "sbhd"}[p.tensor_format]
        if other in caps["formats"]:
            swapped = call(case, fn, t=t.transpose(0, 1), positions=pos.transpose(streams, streams + 1),
                           tensor_format=other)
            assert_bitwise(f"{p.tensor_format} vs {other} on the transposed views", swapped.transpose(0, 1), got)
    if "thd" in caps["formats"]:
        flat = call(case, fn, t=t.reshape(-1, p.h, p.d), positions=pos.reshape(*pos.shape[:streams], -1),
                    tensor_format="thd")
        assert_bitwise(f"{p.tensor_format} vs thd on the tokens flattened", flat.reshape(got.shape), got)


def interleaved_equivalent(conv, fn, caps, plan):
    """GPT-J pairs on channels rearranged (2i, 2i + 1) <- (i, i + d2/2), freqs' channels alike, equal the
    half-split call rearranged alike: the pairing flag moves channels, nothing else. Within two roundings, as TE's
    convention states it, not bitwise: an implementation may evaluate cos and sin otherwise for each pairing (rope
    reads a table built by torch for half-split pairs and evaluates them in the kernel for GPT-J's; on the CPU the
    interpreter's numpy and torch's own cos differ in the last bit), and each result is within one rounding of the
    definition, so the two are within two of each other. Channels past d2 (copies) stay bitwise."""
    if set(caps["interleaved"]) != {False, True}:
        return
    case = make_case(conv, caps, plan)
    p = case.plan
    dev = case.args["t"].device
    half_split = torch.cat([torch.arange(0, p.d2, 2), torch.arange(1, p.d2, 2)])  # GPT-J channel of each
    to_gptj = torch.argsort(half_split).to(dev)
    rest = torch.arange(p.d2, p.d, device=dev)
    t, freqs = case.args["t"], case.args["freqs"]
    split = call(case, fn, interleaved=False)
    gptj = call(case, fn, t=t[..., torch.cat([to_gptj, rest])], freqs=freqs[..., to_gptj], interleaved=True)
    back = torch.cat([half_split.to(dev), rest])
    assert_within("interleaved=True on rearranged channels vs half-split", gptj[..., back], split, t, p.d2, False, 2,
                  caps.get("accuracy", "float32"))


def inverse(conv, fn, caps, plan):
    """The call with the angles negated, on the call's result, gives t back within three roundings."""
    case = make_case(conv, caps, plan)
    p = case.plan
    f = case.args["freqs"]  # a rotation (whose inverse negates the angle) where a pair's channels share it
    f = pairing.per_channel(f[..., 0::2] if p.interleaved else f[..., :p.d2 // 2], p.interleaved).contiguous()
    there = call(case, fn, freqs=f)
    back = call(case, fn, t=there, freqs=-f)
    x64 = inputs64(case)
    assert_within("inverse", back, x64["t"], x64["t"], p.d2, p.interleaved, 3, "dtype")


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: each row (a sequence of sbhd or bshd with its positions [3, s] or [s], a token of thd
    with its positions [3, 1] or [1]) called alone, and the rows rolled by one with their positions, give bitwise the
    row's results in the whole call and, where the target has a backward, its gradient of t from the same random
    upstream gradient. At least two rows."""
    dim = 1 if plan.tensor_format == "sbhd" else 0  # t's batch dim (thd: its tokens)
    lead = list(plan.lead)
    lead[dim] = max(lead[dim], 2)
    case = make_case(conv, caps, plan._replace(lead=tuple(lead)))
    p = case.plan
    t, positions = case.args["t"], case.args["positions"]
    positions_dim = dim + (0 if p.text else 1)
    row = "token" if p.tensor_format == "thd" else "sequence"
    grads = caps.get("backward", True)
    gen = torch.Generator().manual_seed(plan.seed + 3)
    up = []  # the upstream gradient, drawn for the whole call's result

    def run(take):
        """(result, gradient of t) of one call on take(x, dim) of t and the upstream gradient (along t's batch dim)
        and of positions (along its own); t a new leaf."""
        leaf = take(t, dim).detach().clone().requires_grad_(grads)
        args = {**case.args, "t": leaf, "positions": take(positions, positions_dim)}
        with torch.set_grad_enabled(grads):
            out = dataclasses.replace(case, plan=p._replace(lead=tuple(leaf.shape[:-2])), args=args).call(fn)
        if not grads:
            return out.detach(), None
        if not up:
            up.append(torch.randn(tuple(out.shape), generator=gen, dtype=torch.float64).to(out.dtype).to(out.device))
        grad = torch.autograd.grad(out, leaf, take(up[0], dim))[0] if out.numel() else torch.zeros_like(leaf)
        return out.detach(), grad

    whole, whole_grad = run(lambda x, d: x)
    rows = whole.shape[dim]
    for i in sorted({0, rows - 1, plan.seed % rows}):
        alone, alone_grad = run(lambda x, d, i=i: x.narrow(d, i, 1).clone())
        assert_bitwise(f"batch invariance: {p.tensor_format} {row} {i} alone, against among {rows}", alone,
                       whole.narrow(dim, i, 1))
        if grads:
            assert_bitwise(f"batch invariance: the gradient of {p.tensor_format} {row} {i} alone, against among "
                           f"{rows}", alone_grad, whole_grad.narrow(dim, i, 1))
    rolled, rolled_grad = run(lambda x, d: torch.roll(x, 1, d))
    assert_bitwise(f"batch invariance: the {p.tensor_format} {row}s rolled by one, against the whole call's rolled",
                   rolled, torch.roll(whole, 1, dim))
    if grads:
        assert_bitwise(f"batch invariance: the gradient of the {p.tensor_format} {row}s rolled by one, against the "
                       f"whole call's rolled", rolled_grad, torch.roll(whole_grad, 1, dim))


MRoPE.INVARIANTS = {"batch_rows_alone": batch_rows_alone,
                    "equal_streams": equal_streams, "formats": formats_equivalent,
                    "interleaved": interleaved_equivalent, "inverse": inverse}
CONVENTION = MRoPE()


MRoPE.DOMAIN = {
    "t": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("t"),
          *domains.odd_heads(lambda p: p.h, cap=""),
          *domains.sizes(lambda p: p.lead[0], "empty", "first token dim")),
    "freqs": (*domains.layouts("freqs"), *domains.widths(lambda p: (p.d2, p.d)),
              domains.cls("pairs share an angle", lambda p, c: p.pair_angles),
              domains.cls("one angle per channel", lambda p, c: not p.pair_angles, "elementwise_freqs")),
    "positions": (*domains.index_dtypes(lambda p: p.positions_dtype, "int32_positions"),
                  domains.cls("[3, *tokens]", lambda p, c: not p.text),
                  domains.cls("[*tokens] (text)", lambda p, c: p.text, "text_positions"),
                  *domains.layouts("positions")),
    "mrope_section": (domains.cls("every stream a section", lambda p, c: all(p.section)),
                      domains.cls("a stream with no pairs", lambda p, c: not all(p.section))),
    "tensor_format": (*domains.optional("tensor_format", "sbhd or bshd",
                                        other_off=lambda caps: set(caps["formats"]) <= {"thd"}),
                      *domains.flags(lambda p: p.tensor_format, FORMATS, allowed=lambda caps: caps["formats"])),
    "interleaved": domains.optional("interleaved", "True", other_off=lambda caps: True not in caps["interleaved"]),
    "mrope_interleaved": domains.optional("mrope_interleaved", "True",
                                          other_off=lambda caps: True not in caps["mrope_interleaved"]),
}
