"""TransformerEngine's call (docs/contract.md):
    apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=...,
                         cu_seqlens=None, cp_size=1, cp_rank=0) -> out
t [s, b, h, d] (sbhd), [b, s, h, d] (bshd) or [T, h, d] (thd, packed sequences cu_seqlens [n + 1], their lengths on
all ranks); freqs: angles [s2, 1, 1, d2], read as float32, d2 even and <= d, channels d2.. copied. Token j of a
sequence is at position cp_position(j) + start_positions[sequence] (positions.py: packed sequences restart at 0; with
cp_size > 1 a rank holds chunks cp_rank and 2 cp_size - 1 - cp_rank of every sequence). Channel i is
t_i cos f_i + sign_i t_partner(i) sin f_i with f = freqs[position] channel by channel (te_oracle.py); the backward
is its adjoint. The result is a new contiguous tensor of t's shape and dtype; nothing is written.

`fused` is never passed: the implementation's own default runs (TE's named target pins fused=True, as its default
is its unfused path). Every other optional argument is drawn both omitted and passed at its default value, and the
leading ones positionally or by keyword.
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple, Optional

import torch
from hypothesis import strategies as st

from .. import accuracy, pairing, te_oracle
from ..compare import assert_bitwise, assert_undone, assert_within
from ..contract import Returned, Snapshot
from ..positions import token_positions
from ..run import make_case
from ..tensors import DEVICE, DTYPES, Layout, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, small

FORMATS = ("sbhd", "bshd", "thd")
GRAD_LAYOUTS = ("contiguous", "strided", "expanded")


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    freqs_dtype: torch.dtype
    tensor_format: str
    s: int  # tokens per sequence on this rank (sbhd, bshd)
    b: int
    lengths: tuple  # thd: the sequences' lengths on all ranks (multiples of 2 cp_size where cp_size > 1)
    h: int
    d: int
    rot: int  # d2, the rotary width
    interleaved: bool
    equal_halves: bool  # the two members of each pair share an angle (RotaryPositionEmbedding's freqs)
    angle_log2: int  # angles in [-2^k, 2^k] rad (17: 1.3e5 rad, a long context's)
    values: str  # "normal": N(0, 1); "near_max": uniform within half the dtype's largest value
    start_dtype: Optional[torch.dtype]  # None: start_positions not passed
    cp_size: int
    cp_rank: int
    cu_dtype: torch.dtype  # thd: cu_seqlens' dtype
    extra_rows: int  # freqs' rows past the last position
    spelling: str  # "minimal": only what differs from the defaults, by keyword; "explicit": every argument
    positional: int  # explicit: how many leading arguments go positionally (t, freqs, tensor_format, ...)
    t_layout: Layout
    last_stride: int  # t's last-dim stride: 1, or 2 (every other element of a wider buffer)
    freqs_layout: Layout
    grad_layout: str  # the upstream gradient: contiguous, strided (permuted, last-dim stride 2) or expanded

    @property
    def explicit_defaults(self) -> bool:
        """Whether the call passes its optional arguments at their defaults (domains.settle_defaults)."""
        return self.spelling == "explicit"


def max_start() -> int:
    """The largest start position drawn (the interpreter reads few rows; a device, a long prefix)."""
    return 4 if small() else 512


def lead_shape(p: Plan) -> tuple:
    """t's token dims."""
    if p.tensor_format == "thd":
        return (sum(p.lengths) // p.cp_size,)
    return (p.s, p.b) if p.tensor_format == "sbhd" else (p.b, p.s)


def cu_of(lengths, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype)


def index_dtypes(caps, key: str) -> tuple:
    """The index dtypes a target takes (int64 only where it declares `key`)."""
    return (torch.int32, torch.int64) if caps[key] else (torch.int32,)


def place_values(arena, values: torch.Tensor, layout: Layout, last_stride: int) -> torch.Tensor:
    """values as a view with `layout`; last_stride 2: every other element of a buffer twice as wide (NaN between)."""
    if last_stride == 1:
        return arena.place(values, layout)
    wide = torch.full((*values.shape[:-1], values.shape[-1] * last_stride), float("nan"), dtype=values.dtype)
    wide[..., ::last_stride] = values
    return arena.place(wide, layout)[..., ::last_stride]


def angles(gen, shape, angle_log2: int) -> torch.Tensor:
    """float64 angles uniform in [-2^k, 2^k] rad."""
    return (torch.rand(tuple(shape), generator=gen, dtype=torch.float64) * 2 - 1) * 2.0**angle_log2


def rotation_freqs(gen, rows: int, rot: int, interleaved: bool, angle_log2: int) -> torch.Tensor:
    """float32 angles theta[p, k] = p omega_k [rows, 1, 1, rot], one per pair laid out as RotaryPositionEmbedding does
    (cat(theta, theta), or each twice for interleaved pairs). omega_k = m_k 2^e with m_k of at most 23 - log2(rows)
    bits, so every p m_k is exact in float32: theta[m] - theta[n] is exactly (m - n) omega, and the rotations compose
    exactly."""
    p_bits = max(0, math.ceil(math.log2(max(rows, 1))))
    m_bits = min(10, 23 - p_bits)
    m = torch.randint(1, 2**m_bits, (rot // 2,), generator=gen, dtype=torch.int64)
    omega = m.double() * 2.0 ** (angle_log2 - m_bits - p_bits)
    theta = pairing.per_channel(torch.arange(rows, dtype=torch.float64)[:, None] * omega[None, :], interleaved)
    assert torch.equal(theta.float().double(), theta), "rotation angles must be exact in float32"
    return theta.float().reshape(rows, 1, 1, rot)


class TE(Convention):
    NAME = "te"
    PARAMETER_CAPS = {"interleaved": {"interleaved": False}, "start_positions": {"start_positions": False},
                      "cp_size": {"context_parallel": False}}
    SIGNATURE = ("t", "freqs", "tensor_format", "start_positions", "interleaved", "fused", "cu_seqlens", "cp_size",
                 "cp_rank")
    DIFFERENTIABLE = ("t",)
    CAPS = {
        "dtypes": (DTYPES, "dtypes of t"),
        "freqs_dtypes": ((*DTYPES, torch.float64), "dtypes of freqs (read as float32, float64 too)"),
        "formats": (FORMATS, "tensor formats (thd with cu_seqlens)"),
        "partial": (True, "d2 < d: channels d2.. copied; odd head dims"),
        "interleaved": (True, "interleaved (GPT-J) pairs"),
        "elementwise_freqs": (True, "angles that differ within a pair (freqs act channel by channel)"),
        "start_positions": (True, "start_positions, one per sequence"),
        "int64_start_positions": (True, "start_positions of dtype int64 (not only int32)"),
        "int64_cu_seqlens": (True, "cu_seqlens of dtype int64 (not only int32)"),
        "context_parallel": (True, "cp_size > 1: the dual-chunk positions of cp_rank (sbhd, bshd and thd)"),
        "cp_start_positions": (True, "start_positions together with cp_size > 1"),
        "strides": (True, "t as a view: permuted, padded, size-1 dims with odd strides, last-dim stride 2"),
        "freqs_strides": (True, "freqs as a view (a window of wider angles, permuted)"),
        "empty": (True, "tensors with no elements: s = 0, b = 0, h = 0, thd without tokens or without sequences"),
        "backward": (True, "the gradient of t"),
        "bad_input": (True, "bad input refused with TypeError/ValueError whose message starts with the argument, "
                            "before anything is written (docs/contract.md section 5)"),
        "accuracy": ("float32", "accuracy model (accuracy.py): float32 math and one rounding, or dtype math"),
    }

    OPTIONAL = {"tensor_format": "sbhd", "start_positions": None, "interleaved": False, "cu_seqlens": None,
                "cp_size": 1, "cp_rank": 0}

    def plans(self, caps):
        # Triton's interpreter runs one program per token (or token group) after another: few tokens on the CPU.
        # h = 17 and d = 80 (not powers of two) are drawn there too; odd d where partial rotary is a capability.
        lim = dict(s=4, b=2, heads=(1, 2, 3, 17), n=4, units=2, cp=(1, 1, 2, 3), extra=2,
                   dims=(2, 4, 6, 7, 8, 10, 16, 80)) if small() else \
            dict(s=256, b=4, heads=(1, 8, 17, 32), n=8, units=64, cp=(1, 1, 2, 4), extra=64,
                 dims=(2, 6, 64, 80, 81, 96, 128, 256))

        @st.composite
        def draw(draw):
            # first: Hypothesis varies its earliest choices most, and every optional argument's explicit default is
            # a declared class (domains.optional)
            # the format before them: a device-sized thd case is one Hypothesis mutates many times once drawn, so
            # drawn later it can be the only thd case of a hundred (then no plan holds two sequences with tokens)
            fmt = draw(st.sampled_from(caps["formats"]))
            spelling = draw(st.sampled_from(("minimal", "explicit") if caps["explicit_defaults"] else ("minimal",)))
            dtype = draw(st.sampled_from(caps["dtypes"]))
            d = draw(st.sampled_from(lim["dims"] if caps["partial"] else tuple(v for v in lim["dims"] if v % 2 == 0)))
            # d2 = 2 (one pair) and d2 < d drawn as often as the full head
            rot = draw(st.sampled_from((d - d % 2, 2, 2 * draw(st.integers(1, d // 2))))) if caps["partial"] else d
            cp = draw(st.sampled_from(lim["cp"])) if caps["context_parallel"] else 1
            empty = caps["empty"] and draw(st.integers(0, 9)) == 0
            zero = draw(st.sampled_from(("h", "s", "b"))) if empty else ""
            s = 0 if zero == "s" else draw(st.integers(1, lim["s"]))  # s = 1: decode
            s = 2 * ((s + 1) // 2) if cp > 1 else s  # two chunks of s / 2 tokens
            b = 0 if zero == "b" else draw(st.integers(1, lim["b"]))
            lengths = ()
            if fmt == "thd":  # empty and (without cp) one-token sequences; none at all where empty tensors are drawn
                unit = 2 * cp if cp > 1 else 1
                # empty sequences often: half of them, on a device too (0 among 64 unit counts would be drawn
                # once in some 30 sequences, and an empty sequence before a non-empty one, with start_positions,
                # almost never)
                counts = st.sampled_from((0, 0, *range(1, lim["units"] + 1))) if small() else \
                    st.one_of(st.just(0), st.integers(1, lim["units"]))
                lengths = tuple(unit * n for n in draw(st.lists(counts, min_size=0 if empty else 1,
                                                                max_size=lim["n"])))
                if empty and zero != "h":
                    lengths = tuple(0 for _ in lengths)
                elif not empty and not sum(lengths):  # tokens, where tensors without elements are not drawn
                    lengths = (unit, *lengths[1:])
                if not empty and len(lengths) < lim["n"] and draw(st.booleans()):
                    # an empty sequence before one with tokens in half the plans: start_positions index every
                    # sequence, the empty ones too, and a kernel that counts only those with tokens is wrong from
                    # the first empty one on (drawn as above alone, 3 to 12 % of a device's plans had one with
                    # start_positions)
                    last = max(i for i, n in enumerate(lengths) if n > 0)
                    at = draw(st.integers(0, last))
                    lengths = (*lengths[:at], 0, *lengths[at:])
            h = 0 if zero == "h" else draw(st.sampled_from(lim["heads"]))
            start = draw(st.sampled_from((None, *index_dtypes(caps, "int64_start_positions")))) \
                if caps["start_positions"] else None
            if cp > 1 and not caps["cp_start_positions"]:
                start = None
            nd = 3 if fmt == "thd" else 4
            strides = caps["strides"]
            grads = grad_layouts(caps)
            freqs_dtype = draw(st.sampled_from(caps["freqs_dtypes"]))
            angle_log2 = draw(st.sampled_from((3, 3, 1, 17)))
            if freqs_dtype == torch.float16:  # its largest value is 65504: angles to 2^15 rad
                angle_log2 = min(angle_log2, 15)
            return Plan(
                draw(seeds()), dtype, freqs_dtype, fmt, s, b, lengths, h, d, rot,
                caps["interleaved"] and draw(st.booleans()),
                draw(st.booleans()) if caps["elementwise_freqs"] else True,
                angle_log2, draw(st.sampled_from(("normal", "normal", "normal", "near_max"))),
                start, cp, draw(st.integers(0, cp - 1)),
                draw(st.sampled_from(index_dtypes(caps, "int64_cu_seqlens"))), draw(st.integers(0, lim["extra"])),
                spelling, draw(st.integers(2, 5)) if spelling == "explicit" else 2,
                draw(layouts(nd)) if strides else contiguous(nd), draw(st.sampled_from((1, 2))) if strides else 1,
                draw(layouts(4, padded_dims=(0, 3))) if caps["freqs_strides"] else contiguous(4),
                draw(st.sampled_from(grads)))

        return draw()

    def build(self, p: Plan, arena) -> Case:
        shape = (*lead_shape(p), p.h, p.d)
        if p.values == "near_max":  # |x_i| + |x_partner| <= the dtype's largest value: every result is finite
            values = (torch.rand(shape, generator=arena.gen, dtype=torch.float64) * 2 - 1) * \
                (torch.finfo(p.dtype).max / 2)
        else:
            values = torch.randn(shape, generator=arena.gen, dtype=torch.float64)
        t = place_values(arena, values.to(p.dtype), p.t_layout, p.last_stride)
        thd = p.tensor_format == "thd"
        cu = cu_of(p.lengths, p.cu_dtype) if thd else None
        n = len(p.lengths) if thd else p.b
        start = arena.integers(0, max_start() + 1, (n,)) if p.start_dtype is not None else None
        pos = token_positions(shape, p.tensor_format, start, cu, p.cp_size, p.cp_rank)
        if not thd and p.b == 0:  # TE checks s cp_size <= s2 from the shapes alone: the rows of a batch of one
            one = (p.s, 1) if p.tensor_format == "sbhd" else (1, p.s)
            pos = token_positions((*one, p.h, p.d), p.tensor_format, None, None, p.cp_size, p.cp_rank)
        rows = (int(pos.max()) + 1 if pos.numel() else 0) + p.extra_rows  # freqs reach every position
        theta = pairing.per_channel(angles(arena.gen, (rows, p.rot // 2), p.angle_log2), p.interleaved) \
            if p.equal_halves else angles(arena.gen, (rows, p.rot), p.angle_log2)
        freqs = arena.place(theta.to(p.freqs_dtype).reshape(rows, 1, 1, p.rot), p.freqs_layout)
        args = dict(t=t, freqs=freqs)
        explicit = p.spelling == "explicit"
        if explicit or p.tensor_format != "sbhd":
            args["tensor_format"] = p.tensor_format
        if explicit or start is not None:
            args["start_positions"] = None if start is None else arena.place(start.to(p.start_dtype))
        if explicit or p.interleaved:
            args["interleaved"] = p.interleaved
        if explicit or thd:
            args["cu_seqlens"] = arena.place(cu) if thd else None
        if explicit or p.cp_size > 1:
            args["cp_size"], args["cp_rank"] = p.cp_size, p.cp_rank
        return Case(p, args, p.positional, arena.buffers)

    def effects(self, case):
        return (), Returned("out")

    def define(self, case, x64):
        p = case.plan
        out = te_oracle.apply_rotary_pos_emb(x64["t"], x64["freqs"], p.tensor_format, x64.get("start_positions"),
                                             p.interleaved, cu_seqlens=x64.get("cu_seqlens"), cp_size=p.cp_size,
                                             cp_rank=p.cp_rank)
        return {"out": Expect(out, x64["t"], p.rot, p.interleaved, p.dtype)}

    def outside(self, plan, caps):
        nd = 3 if plan.tensor_format == "thd" else 4
        needs = {
            f"dtype {plan.dtype}": plan.dtype not in caps["dtypes"],
            f"freqs dtype {plan.freqs_dtype}": plan.freqs_dtype not in caps["freqs_dtypes"],
            f"format {plan.tensor_format}": plan.tensor_format not in caps["formats"],
            "partial rotary": (plan.rot < plan.d or plan.d % 2) and not caps["partial"],
            "interleaved": plan.interleaved and not caps["interleaved"],
            "elementwise freqs": not plan.equal_halves and not caps["elementwise_freqs"],
            "start_positions": plan.start_dtype is not None and not caps["start_positions"],
            "int64 start_positions": plan.start_dtype == torch.int64 and not caps["int64_start_positions"],
            "int64 cu_seqlens": plan.tensor_format == "thd" and plan.cu_dtype == torch.int64
            and not caps["int64_cu_seqlens"],
            "context parallelism": plan.cp_size > 1 and not caps["context_parallel"],
            "start_positions with cp": plan.cp_size > 1 and plan.start_dtype is not None
            and not caps["cp_start_positions"],
            "strides": (plan.t_layout != contiguous(nd) or plan.last_stride != 1) and not caps["strides"],
            "freqs strides": plan.freqs_layout != contiguous(4) and not caps["freqs_strides"],
            "gradient strides": plan.grad_layout not in grad_layouts(caps),
            "empty tensors": 0 in (*lead_shape(plan), plan.h) and not caps["empty"],
        }
        return next((why for why, lacking in needs.items() if lacking), None)

    def grad_of(self, case, arg):
        return "out"

    def upstream(self, case, name, g):
        """The plan's own gradient layout where the backward property passes a contiguous one (the invariants lay
        out theirs from the plan too)."""
        return upstream_as(case.plan.grad_layout, g) if g.is_contiguous() else g


def pin(tensor_format="sbhd", dtype=torch.float32, s=4, b=2, lengths=(), h=2, d=16, rot=None, seed=0, **fields):
    """A pinned plan: a plain call of these sizes (full rotation, random angles within 8 rad, contiguous tensors,
    only what differs from the defaults passed), with `fields` replaced."""
    plan = Plan(seed, dtype, torch.float32, tensor_format, 0 if tensor_format == "thd" else s, b, tuple(lengths), h,
                d, d - d % 2 if rot is None else rot, False, False, 3, "normal", None, 1, 0, torch.int32, 0,
                "minimal", 2, contiguous(3 if tensor_format == "thd" else 4), 1, contiguous(4), "contiguous")
    return plan._replace(**fields)


TRANSPOSED = Layout((1, 0, 2, 3), (0, 0, 0, 0))
WINDOW = Layout((0, 1, 2), (0, 0, 24))  # a window of a wider last dim (q out of a fused projection)
# Edges every profile runs first (test_native.py, test_pinned): one pair, s = 1, h = 17, d = 80, empty and one-token
# sequences, context parallel with empty sequences, long-context angles, values near the dtype's maximum.
TE.PINS = (
    pin("sbhd", s=3, d=8, rot=2, seed=1),  # d2 = 2: one pair
    pin("bshd", torch.bfloat16, s=1, b=3, start_dtype=torch.int64, seed=2),  # s = 1 (decode), start_positions
    pin("sbhd", torch.float16, b=1, h=3, d=20, rot=6, interleaved=True, seed=3),  # d2 < d
    pin("sbhd", torch.bfloat16, s=2, b=1, h=17, d=80, rot=64, seed=4),  # h = 17, d = 80
    pin("bshd", s=3, h=1, d=96, interleaved=True, equal_halves=True, seed=5),  # h = 1, d = 96, rotations
    pin("thd", lengths=(3, 0, 1, 4), rot=8, start_dtype=torch.int32, seed=6),  # empty and one-token sequences
    pin("thd", torch.bfloat16, lengths=(0, 4, 8, 0), d=12, cp_size=2, cp_rank=1, seed=7),  # cp, empty sequences
    pin("sbhd", s=5, angle_log2=17, seed=8),  # angles to 1.3e5 rad
    pin("thd", torch.bfloat16, lengths=(5, 2), h=3, d=32, angle_log2=17, interleaved=True, seed=9),
    pin("sbhd", torch.float16, s=3, values="near_max", seed=10),  # |t| to 32752
    pin("bshd", torch.float16, h=3, rot=8, grad_layout="expanded", seed=11),  # an expanded upstream gradient
    pin("thd", lengths=(2, 3), t_layout=WINDOW, grad_layout="expanded", interleaved=True, seed=12),
    pin("sbhd", torch.bfloat16, d=10, rot=4, cp_size=2, extra_rows=3, t_layout=TRANSPOSED, grad_layout="strided",
        seed=13),
    pin("sbhd", b=3, cp_size=2, cp_rank=1, start_dtype=torch.int64, seed=14),  # start_positions with cp
    pin("bshd", torch.bfloat16, s=6, h=3, rot=8, cp_size=3, cp_rank=2, start_dtype=torch.int32, interleaved=True,
        spelling="explicit", positional=5, seed=15),
    pin("thd", lengths=(8, 0, 4, 12), cp_size=2, start_dtype=torch.int64, cu_dtype=torch.int64, seed=16),
    pin("sbhd", s=0, freqs_dtype=torch.float64, seed=17),  # no tokens
    pin("thd", lengths=(), h=3, spelling="explicit", positional=4, seed=18),  # no sequences
)


def grad_layouts(caps) -> tuple:
    """The upstream-gradient layouts a target takes (the generic strided_grads and expanded_grads capabilities)."""
    return tuple(k for k, cap in zip(GRAD_LAYOUTS, ("", "strided_grads", "expanded_grads"), strict=True)
                 if not cap or caps[cap])


def upstream_as(kind: str, g: torch.Tensor) -> torch.Tensor:
    """g's values laid out as `kind` (domains.lay_out_upstream: contiguous, strided or expanded with stride 0, the
    gradient of a broadcast, whose repeated values then replace g's own)."""
    return g if kind == "contiguous" or g.numel() == 0 else domains.lay_out_upstream(g, kind)


# ---------------------------------------------------------------------------------------------- invariants
# Results of two calls that must compute the same value (another layout, another format, a rank's shard of the
# sequence) agree within two roundings of it: each is within one model bound B(|r|) of the exact r, and B taken at
# the other result's magnitude is larger by a factor 1 + EPS at most, so within 3 B of each other.
ROUNDINGS = 3.0


def _empty_before_tokens(lengths) -> bool:
    """Whether an empty sequence comes before one with tokens (start_positions index both)."""
    return any(n == 0 and any(lengths[i + 1:]) for i, n in enumerate(lengths))


def call(fn, case, **overrides):
    """The case's call with arguments replaced (a new name goes by keyword)."""
    return Case(case.plan, {**case.args, **overrides}, case.positional).call(fn)


def laid_out_as(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` (x's shape) as the same view as x (shape, strides, offset) of a new NaN-filled buffer."""
    size = x.storage_offset() + sum((n - 1) * st_ for n, st_ in zip(x.shape, x.stride(), strict=True)) + 1 \
        if x.numel() else 1
    base = torch.full((size,), float("nan"), dtype=x.dtype, device=x.device)
    view = base.as_strided(x.shape, x.stride(), x.storage_offset())
    view.copy_(values)
    return view


def graph_view(x: torch.Tensor):
    """(view, leaf): x's values as the same view (shape, strides, offset) of a new buffer, now computed from `leaf`
    (contiguous, requires grad), as a projection's output reaches RoPE inside a graph."""
    leaf = x.detach().clone().requires_grad_()
    return laid_out_as(x, leaf), leaf


def forward_backward(fn, case, up=None, **overrides):
    """(out, grad of t for upstream `up`, up) of one call with t as a view in the graph; up: random (seeded by the
    plan), laid out as the plan's grad_layout, unless given. Neither the call nor its backward may write the case's
    buffers (freqs, start_positions, cu_seqlens, t's) or the upstream gradient."""
    snap = Snapshot(case.buffers)
    t = overrides.pop("t", case.args["t"])
    view, leaf = graph_view(t)
    out = call(fn, case, t=view, **overrides)
    if up is None:
        gen = torch.Generator().manual_seed(case.plan.seed + 2)
        up = upstream_as(case.plan.grad_layout, torch.randn(tuple(out.shape), generator=gen, dtype=torch.float64)
                         .to(out.dtype).to(out.device))
    up_snap = Snapshot([up])
    grad = torch.autograd.grad(out, leaf, up, allow_unused=True)[0] if out.numel() else torch.zeros_like(leaf)
    assert grad is not None, "backward: no gradient for t"
    snap.check_unchanged()
    up_snap.check_unchanged()
    return out.detach(), grad, up


def model(caps) -> str:
    return caps.get("accuracy", "float32")


def unit(dtype, caps) -> float:
    """U: the largest error of one output element per unit of its pair's scale s (|ref| <= s), less the underflow
    term ETA."""
    return accuracy.bound(torch.tensor(1.0), torch.tensor(1.0), dtype, model(caps)).item() - accuracy.ETA[dtype]


def agree(what, got, want, source, plan, caps):
    assert_within(what, got, want, source, plan.rot, plan.interleaved, ROUNDINGS, model(caps))


def seq_dim(fmt: str) -> int:
    return 1 if fmt == "bshd" else 0


def pairs(x, rot: int, interleaved: bool):
    """(first members, second members) of every pair, [..., rot / 2] each, float64 on the CPU."""
    x = x.detach().cpu().double()[..., :rot]
    partner, sign = pairing.partner_and_sign(rot, interleaved)
    first = sign < 0
    return x[..., first], x[..., partner[first]]


def pair_norms_preserved(conv, fn, caps, plan):
    """With angles shared within each pair (a rotation) every pair keeps its norm, forward and backward: each element
    errs by at most B(s) = U s + ETA (s = |x_i| + |x_partner|, the exact rotation keeps the norm exactly), so a pair's
    norm by sqrt(2) B(s); float64 norms add a relative 2^-50."""
    case = make_case(conv, caps, plan._replace(equal_halves=True))
    out, grad, up = forward_backward(fn, case)
    u, eta = unit(plan.dtype, caps), accuracy.ETA[plan.dtype]
    for what, y, x in (("forward", out, case.args["t"]), ("backward", grad, up)):
        (a, b), (xa, xb) = pairs(y, plan.rot, plan.interleaved), pairs(x, plan.rot, plan.interleaved)
        got, want, s = torch.hypot(a, b), torch.hypot(xa, xb), xa.abs() + xb.abs()
        bad = ~((got - want).abs() <= math.sqrt(2) * (u * s + eta) + 2.0**-50 * s)
        assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} pair norms changed by a rotation; first " \
                              f"{got[bad][0].item()!r} against {want[bad][0].item()!r}"


def inverse(conv, fn, caps, plan):
    """With angles shared within each pair, the call with -freqs undoes the call (compare.assert_undone); the
    backward at upstream gradient y = the call's result gives t back as well (the adjoint of a rotation is the
    rotation back)."""
    case = make_case(conv, caps, plan._replace(equal_halves=True))
    t, freqs = case.args["t"], case.args["freqs"]
    y = call(fn, case).detach()
    _, back, _ = forward_backward(fn, case, up=y)
    undone = call(fn, case, t=y, freqs=-freqs)
    # the angles are exact float32 values, negated exactly: no table rounding (float64's EPS stands for none)
    assert_undone("forward with -freqs", undone, t, plan.rot, plan.interleaved, torch.float64, model(caps))
    assert_undone("backward at the call's own result", back, t, plan.rot, plan.interleaved, torch.float64,
                  model(caps))


def relative_position(conv, fn, caps, plan):
    """<R(m) q, R(n) k> depends on m - n only: three copies of one q and one k at positions shifted together (by
    start_positions, or by freqs' rows where the target has none) give the same dot products per head. Rotation
    angles p omega, exact in float32 (rotation_freqs). Per pair, |<a', b'> - <a, b>| <= ||a' - a|| ||b'|| +
    ||a|| ||b' - b|| <= 3 U s_q s_k (each element within U s + ETA); two copies differ by twice that, plus the
    underflow terms and float64 summation."""
    gen = torch.Generator().manual_seed(plan.seed)
    fmt, h, d, rot, il = plan.tensor_format, max(plan.h, 1), plan.d, plan.rot, plan.interleaved
    copies, length = 3, max(1, min(plan.s, 3))
    q, k = (torch.randn((1, length, h, d), generator=gen, dtype=torch.float64).to(plan.dtype)
            .expand(copies, length, h, d).contiguous() for _ in range(2))
    m0, n0 = (int(v) for v in torch.randint(0, 6, (2,), generator=gen))
    shift = torch.randint(1, 6, (copies,), generator=gen)
    shift[0] = 0
    freqs = rotation_freqs(gen, max(m0, n0) + int(shift.max()) + length, rot, il, plan.angle_log2).to(DEVICE)
    flags = dict(tensor_format=fmt, interleaved=il)

    def rotated(x, first):
        x = to_format(x.to(DEVICE), fmt)
        extra = dict(cu_seqlens=cu_of([length] * copies, plan.cu_dtype).to(DEVICE)) if fmt == "thd" else {}
        if caps["start_positions"]:
            starts = (first + shift).to(plan.start_dtype or torch.int64).to(DEVICE)
            return from_format(fn(x, freqs, start_positions=starts, **flags, **extra), fmt, copies, length)
        outs = []  # one call per copy, its freqs starting at the copy's first position
        for c in range(copies):
            one = to_format(from_format(x, fmt, copies, length)[c:c + 1], fmt)
            one_extra = dict(cu_seqlens=cu_of([length], plan.cu_dtype).to(DEVICE)) if fmt == "thd" else {}
            outs.append(from_format(fn(one, freqs[first + int(shift[c]):], **flags, **one_extra), fmt, 1, length))
        return torch.cat(outs)

    oq, ok = rotated(q, m0).detach().cpu().double(), rotated(k, n0).detach().cpu().double()
    dots = (oq * ok).sum(-1)
    (qa, qb), (ka, kb) = pairs(q, rot, il), pairs(k, rot, il)
    sq, sk = qa.abs() + qb.abs(), ka.abs() + kb.abs()
    eta = accuracy.ETA[plan.dtype]
    bound = 6 * unit(plan.dtype, caps) * (sq * sk).sum(-1) + 2 * (2 * eta * (sq + sk) + 4 * eta**2).sum(-1) \
        + 2.0**-48 * d * (oq * ok).abs().sum(-1)
    dev = (dots - dots[:1]).abs()
    bad = ~(dev <= bound)
    assert not bad.any(), f"relative position: copies at positions shifted together give dot products " \
                          f"{dots[bad][0].item()!r}, copy 0 {dots[:1].expand_as(dots)[bad][0].item()!r}"


def to_format(x, fmt):
    """[B, L, h, d] -> the format's layout (thd: B sequences of L tokens, one after another)."""
    if fmt == "bshd":
        return x.contiguous()
    if fmt == "sbhd":
        return x.transpose(0, 1).contiguous()
    return x.reshape(-1, *x.shape[2:]).contiguous()


def from_format(y, fmt, B, L):
    if fmt == "bshd":
        return y
    if fmt == "sbhd":
        return y.transpose(0, 1)
    return y.reshape(B, L, *y.shape[1:])


def pass_through_bitwise(conv, fn, caps, plan):
    """Channels d2.. are copies: the forward's are t's and the backward's the upstream gradient's, bitwise."""
    if not caps["partial"]:
        return
    p = plan if plan.rot < plan.d else plan._replace(d=plan.d + 2 if plan.d == 2 else plan.d, rot=2)
    case = make_case(conv, caps, p)
    out, grad, up = forward_backward(fn, case)
    assert_bitwise("forward: channels past d2 against t's", out[..., p.rot:], case.args["t"][..., p.rot:])
    assert_bitwise("backward: channels past d2 against the upstream gradient's", grad[..., p.rot:], up[..., p.rot:])


def formats_agree(conv, fn, caps, plan):
    """The same B sequences of L tokens as sbhd, bshd and thd (one packed sequence per batch entry, L cp_size tokens
    each on all ranks) give the same rotation of the same tokens, forward and backward."""
    formats = [f for f in FORMATS if f in caps["formats"]]
    if len(formats) < 2:
        return
    p = plan._replace(tensor_format="bshd", s=max(plan.s, 2 if plan.cp_size > 1 else 1), b=max(plan.b, 1),
                      h=max(plan.h, 1), lengths=(), t_layout=contiguous(4), last_stride=1, grad_layout="contiguous")
    case = make_case(conv, caps, p)
    x, B, L = case.args["t"], p.b, p.s
    gen = torch.Generator().manual_seed(plan.seed + 3)
    g = torch.randn(tuple(x.shape), generator=gen, dtype=torch.float64).to(p.dtype).to(x.device)
    results = {}
    for fmt in formats:
        extra = dict(cu_seqlens=cu_of([L * p.cp_size] * B, p.cu_dtype).to(x.device)) if fmt == "thd" else \
            dict(cu_seqlens=None)
        out, grad, _ = forward_backward(fn, case, up=to_format(g, fmt), t=to_format(x, fmt), tensor_format=fmt,
                                        **extra)
        results[fmt] = from_format(out, fmt, B, L), from_format(grad, fmt, B, L)
    ref = formats[0]
    for fmt in formats[1:]:
        agree(f"forward: {fmt} against {ref}", results[fmt][0], results[ref][0], x, p, caps)
        agree(f"backward: {fmt} against {ref}", results[fmt][1], results[ref][1], g, p, caps)


def shard_tokens(lengths, cp_size: int, rank: int) -> torch.Tensor:
    """The global token indices rank `rank` holds: chunks rank and 2 cp_size - 1 - rank of every sequence."""
    idx, offset = [], 0
    for n in lengths:
        c = n // (2 * cp_size)
        for chunk in (rank, 2 * cp_size - 1 - rank):
            idx.extend(range(offset + chunk * c, offset + (chunk + 1) * c))
        offset += n
    return torch.tensor(idx, dtype=torch.int64)


def cp_shards(conv, fn, caps, plan):
    """Every rank's call (cp_size, cp_rank) on its two chunks of each sequence gives the unsharded call's result at
    those tokens, forward and backward, start_positions included (they shift a sequence after the mapping)."""
    if not caps["context_parallel"]:
        return
    size = plan.cp_size if plan.cp_size > 1 else 2
    thd = plan.tensor_format == "thd"
    unit = 2 * plan.cp_size if plan.cp_size > 1 else 1
    lengths = tuple(2 * size * min(n // unit, 1 if small() else n) for n in plan.lengths) if thd else ()
    s = 2 * size * max(1, plan.s // 2)
    start = plan.start_dtype if caps["cp_start_positions"] else None
    full = make_case(conv, caps, plan._replace(s=s, lengths=lengths, cp_size=1, cp_rank=0, start_dtype=start,
                                               grad_layout="contiguous"))
    x = full.args["t"]
    dim = seq_dim(plan.tensor_format)
    gen = torch.Generator().manual_seed(plan.seed + 4)
    g = torch.randn(tuple(x.shape), generator=gen, dtype=torch.float64).to(plan.dtype).to(x.device)
    want, want_grad, _ = forward_backward(fn, full, up=g)
    ranks = range(size) if not small() else (plan.seed % size,)  # on the CPU one rank per example, drawn
    for rank in ranks:
        tokens = shard_tokens(lengths if thd else (s,), size, rank).to(x.device)
        local, local_g = x.index_select(dim, tokens), g.index_select(dim, tokens)
        out, grad, _ = forward_backward(fn, full, up=local_g, t=local, cp_size=size, cp_rank=rank)
        agree(f"forward: rank {rank} of {size} against the unsharded call's tokens", out,
              want.index_select(dim, tokens), local, plan, caps)
        agree(f"backward: rank {rank} of {size} against the unsharded call's tokens", grad,
              want_grad.index_select(dim, tokens), local_g, plan, caps)


def whole_and_sequences(conv, fn, caps, plan):
    """(case, out, grad, up, [(i, index, cu_seqlens)]) of one forward and backward call of the plan (sbhd, bshd: at
    least two batch entries) and each of its sequences with tokens (a batch entry, or a packed thd sequence; the
    first two on the CPU): its index into t and, for thd, its own cu_seqlens [0, length] (else {})."""
    p = plan._replace(b=max(plan.b, 2), grad_layout="contiguous") if plan.tensor_format != "thd" else \
        plan._replace(grad_layout="contiguous")
    case = make_case(conv, caps, p)
    out, grad, up = forward_backward(fn, case)
    if p.tensor_format == "thd":
        cu = case.args["cu_seqlens"].tolist()
        local = [v // p.cp_size for v in cu]
        spans = [(i, slice(a, e)) for i, (a, e) in enumerate(zip(local[:-1], local[1:], strict=True)) if e > a]
    else:
        spans = [(i, slice(i, i + 1)) for i in range(p.b)]
    dim = 1 if p.tensor_format == "sbhd" else 0
    device = case.args["t"].device
    sequences = [(i, (slice(None),) * dim + (span,),
                  dict(cu_seqlens=torch.tensor([0, cu[i + 1] - cu[i]], dtype=p.cu_dtype, device=device))
                  if p.tensor_format == "thd" else {})
                 for i, span in (spans[:2] if small() else spans)]
    return case, out, grad, up, sequences


def sequences_independent(conv, fn, caps, plan):
    """Each sequence (a batch entry, or a packed thd sequence) called alone gives its tokens' results, forward and
    backward; a start position k alone is the angles from row k on (freqs[k:]) without start_positions."""
    case, out, grad, up, sequences = whole_and_sequences(conv, fn, caps, plan)
    p, t, freqs, start = case.plan, case.args["t"], case.args["freqs"], case.args.get("start_positions")
    for i, index, extra in sequences:
        k = 0 if start is None else int(start[i])
        o, g, _ = forward_backward(fn, case, up=up[index], t=t[index], freqs=freqs[k:], start_positions=None, **extra)
        agree(f"forward: sequence {i} alone (start {k} as freqs[{k}:])", o, out[index], t[index], p, caps)
        agree(f"backward: sequence {i} alone (start {k} as freqs[{k}:])", g, grad[index], up[index], p, caps)


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: each sequence (a batch entry, or a packed thd sequence) called alone, its own tensors
    and its own start position given as start_positions (the whole call's mechanism), gives bitwise its results in
    the whole call, forward and backward (what an RL trainer needs of the rollout engine's kernel); sbhd and bshd
    also with the batch rolled by one (each sequence at another index)."""
    case, out, grad, up, sequences = whole_and_sequences(conv, fn, caps, plan)
    p, t, start = case.plan, case.args["t"], case.args.get("start_positions")
    for i, index, extra in sequences:
        if start is not None:
            extra = {**extra, "start_positions": start[i:i + 1].clone()}
        o, g, _ = forward_backward(fn, case, up=up[index].clone(), t=t[index].clone(), **extra)
        assert_bitwise(f"batch invariance: sequence {i} alone, against in the whole call", o, out[index])
        assert_bitwise(f"batch invariance: the gradient of sequence {i} alone, against in the whole call", g,
                       grad[index])
    if p.tensor_format != "thd":
        dim = 1 if p.tensor_format == "sbhd" else 0
        extra = {} if start is None else dict(start_positions=torch.roll(start, 1, 0))
        o, g, _ = forward_backward(fn, case, up=torch.roll(up, 1, dim), t=torch.roll(t, 1, dim), **extra)
        assert_bitwise("batch invariance: the batch rolled by one, against the whole call rolled", o,
                       torch.roll(out, 1, dim))
        assert_bitwise("batch invariance: the gradients of the batch rolled by one, against the whole call's rolled",
                       g, torch.roll(grad, 1, dim))


def channel_order(d: int, rot: int) -> torch.Tensor:
    """Interleaved channels as half-split ones: pairs (2k, 2k + 1) become (k, k + d2 / 2); the rest in place."""
    return torch.tensor(list(range(0, rot, 2)) + list(range(1, rot, 2)) + list(range(rot, d)))


def interleaved_is_permuted_half_split(conv, fn, caps, plan):
    """Interleaved on channels (2k, 2k + 1) is half-split on the channels reordered to (k, k + d2 / 2), with the
    angles reordered the same way: the same products, forward and backward."""
    if not caps["interleaved"]:
        return
    p = plan._replace(interleaved=True, grad_layout="contiguous")
    case = make_case(conv, caps, p)
    t, freqs = case.args["t"], case.args["freqs"]
    order = channel_order(p.d, p.rot).to(t.device)
    out_i, grad_i, up = forward_backward(fn, case)
    x_h, up_h, f_h = t[..., order], up[..., order].contiguous(), freqs[..., order[:p.rot]].contiguous()
    out_h, grad_h, _ = forward_backward(fn, case, up=up_h, t=x_h, freqs=f_h, interleaved=False)
    half = p._replace(interleaved=False)
    agree("forward: interleaved (reordered) against half-split", out_i[..., order], out_h, x_h, half, caps)
    agree("backward: interleaved (reordered) against half-split", grad_i[..., order], grad_h, up_h, half, caps)


def layouts_agree(conv, fn, caps, plan):
    """t as a view (permuted, padded, last-dim stride 2) and a strided or expanded upstream gradient give the results
    of their contiguous copies; the output is a new contiguous tensor of t's shape and dtype and the gradient has t's
    shape and dtype, whatever the layouts."""
    p = plan
    if caps["strides"] and p.t_layout == contiguous(len(p.t_layout.order)) and p.last_stride == 1:
        nd = len(p.t_layout.order)
        p = p._replace(t_layout=Layout((1, 0, *range(2, nd)), (1,) + (0,) * (nd - 1)), last_stride=2)
    other = grad_layouts(caps)[1:]
    if other and p.grad_layout == "contiguous":
        p = p._replace(grad_layout=other[plan.seed % len(other)])
    case = make_case(conv, caps, p)
    t = case.args["t"]
    out, grad, up = forward_backward(fn, case)
    out_c, grad_c, _ = forward_backward(fn, case, up=up.contiguous(), t=t.contiguous())
    for what, y in (("output", out), ("output of the contiguous copy", out_c)):
        assert tuple(y.shape) == tuple(t.shape) and y.dtype == t.dtype, \
            f"{what}: {tuple(y.shape)} {y.dtype}, expected t's {tuple(t.shape)} {t.dtype}"
        assert y.is_contiguous(), f"{what}: a new contiguous tensor was promised, got strides {y.stride()}"
    assert tuple(grad.shape) == tuple(t.shape) and grad.dtype == t.dtype, \
        f"gradient: {tuple(grad.shape)} {grad.dtype}, expected t's {tuple(t.shape)} {t.dtype}"
    agree(f"forward: t laid out {p.t_layout}, last stride {p.last_stride}, against its contiguous copy", out, out_c,
          t, p, caps)
    agree(f"backward: a {p.grad_layout} upstream gradient against its contiguous copy", grad, grad_c, up, p, caps)


def deterministic(conv, fn, caps, plan):
    """The same inputs give bitwise the same output and gradient (docs/contract.md section 4)."""
    case = make_case(conv, caps, plan)
    out1, grad1, up = forward_backward(fn, case)
    out2, grad2, _ = forward_backward(fn, case, up=up)
    assert_bitwise("forward: a second call", out2, out1)
    assert_bitwise("backward: a second call", grad2, grad1)


def adjoint(conv, fn, caps, plan):
    """The backward is the forward's adjoint, for any angles: <out, g> = <t, grad>. By the model each element of out
    errs by at most U s(t) + ETA and each of grad by U s(g) + ETA, so the two sums differ by at most
    U (sum s(t) |g| + sum s(g) |t|) + ETA (sum |g| + sum |t|), plus float64 summation."""
    case = make_case(conv, caps, plan)
    out, grad, up = forward_backward(fn, case)
    t64, g64, o64, r64 = (v.detach().cpu().double() for v in (case.args["t"], up, out, grad))
    rot, il = plan.rot, plan.interleaved
    lhs, rhs = (o64 * g64).sum(), (t64 * r64).sum()
    u, eta = unit(plan.dtype, caps), accuracy.ETA[plan.dtype]
    bound = u * ((pairing.pair_scale(t64, rot, il) * g64.abs()).sum() + (pairing.pair_scale(g64, rot, il) *
                                                                          t64.abs()).sum())
    bound += eta * (g64.abs().sum() + t64.abs().sum()) + 4 * max(o64.numel(), 1) * 2.0**-53 * (
        (o64 * g64).abs().sum() + (t64 * r64).abs().sum())
    assert (lhs - rhs).abs() <= bound, f"adjoint: <out, g> = {lhs.item()!r} but <t, grad> = {rhs.item()!r} " \
                                       f"(difference {(lhs - rhs).abs().item():.3g} > bound {bound.item():.3g})"


# |alpha| + |beta| <= 1: alpha x + beta y stays within the range of near-maximal values; each exact in float64
COEFFICIENTS = ((0.5, 0.5), (0.75, -0.25), (-0.5, 0.25), (0.25, -0.75))


def values_like(x, plan, gen):
    """Another tensor of x's shape, dtype and kind of values (N(0, 1), or near the dtype's largest)."""
    if plan.values == "near_max":
        v = (torch.rand(tuple(x.shape), generator=gen, dtype=torch.float64) * 2 - 1) * (torch.finfo(x.dtype).max / 2)
    else:
        v = torch.randn(tuple(x.shape), generator=gen, dtype=torch.float64)
    return v.to(x.dtype).to(x.device)


def assert_linear(what, got_z, got_x, got_y, alpha, beta, z, x, y, plan, caps):
    """z = alpha x + beta y rounded to the dtype, rho = z - (alpha x + beta y) exactly (float64). Then
    f(z) - alpha f(x) - beta f(y) is the three calls' errors plus R rho: elementwise at most
    U (s(z) + |alpha| s(x) + |beta| s(y)) + s(rho), plus (1 + |alpha| + |beta|) ETA for underflow and the float64
    sums; on the copied channels exactly rho."""
    x64, y64, z64 = (v.detach().cpu().double() for v in (x, y, z))
    rho = z64 - (alpha * x64 + beta * y64)
    got = got_z.detach().cpu().double()
    want = alpha * got_x.detach().cpu().double() + beta * got_y.detach().cpu().double()
    rot, il = plan.rot, plan.interleaved

    def sc(v):
        return pairing.pair_scale(v, rot, il)

    bound = unit(plan.dtype, caps) * (sc(z64) + abs(alpha) * sc(x64) + abs(beta) * sc(y64)) + sc(rho)
    bound += (1 + abs(alpha) + abs(beta)) * accuracy.ETA[plan.dtype]
    bound[..., rot:] = rho[..., rot:].abs()
    bound += 12 * 2.0**-53 * (got.abs() + want.abs())
    bad = ~((got - want).abs() <= bound)
    if bad.any():
        i = tuple(int(v) for v in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements of f(alpha x + beta y) differ from "
                             f"alpha f(x) + beta f(y); first at {i}: {got[i].item()!r} against {want[i].item()!r}")


def linearity(conv, fn, caps, plan):
    """The call is linear in t and its backward in the upstream gradient: f(alpha x + beta y) = alpha f(x) +
    beta f(y) within the calls' roundings (assert_linear)."""
    case = make_case(conv, caps, plan)
    alpha, beta = COEFFICIENTS[plan.seed % len(COEFFICIENTS)]
    gen = torch.Generator().manual_seed(plan.seed + 5)
    x = case.args["t"]
    out_x, grad_x, g = forward_backward(fn, case)
    y, g2 = values_like(x, plan, gen), values_like(g, plan._replace(values="normal"), gen)
    z = (alpha * x.double() + beta * y.double()).to(plan.dtype)
    g3 = (alpha * g.double() + beta * g2.double()).to(plan.dtype)
    out_y, grad_y, _ = forward_backward(fn, case, up=g2, t=y)
    out_z, grad_z, _ = forward_backward(fn, case, up=g3, t=z)
    assert_linear("forward", out_z, out_x, out_y, alpha, beta, z, x, y, plan, caps)
    assert_linear("backward", grad_z, grad_x, grad_y, alpha, beta, g3, g, g2, plan, caps)


def zero_angles_identity(conv, fn, caps, plan):
    """cos 0 = 1 and sin 0 = 0 exactly: with all angles 0 the forward and the backward give their input back; with
    only row 0 zeroed, the first token of every sequence (position 0: no start_positions, rank 0) is unchanged."""
    p = plan._replace(start_dtype=None, cp_rank=0)
    case = make_case(conv, caps, p)
    t, freqs = case.args["t"], case.args["freqs"]
    out, grad, up = forward_backward(fn, case, freqs=torch.zeros_like(freqs))
    agree("forward with zero angles against t", out, t, t, p, caps)
    agree("backward with zero angles against the upstream gradient", grad, up, up, p, caps)
    if freqs.shape[0] == 0:
        return
    first_zero = freqs.clone()
    first_zero[0] = 0
    out = call(fn, case, freqs=first_zero, start_positions=None, cp_rank=0)
    if p.tensor_format == "thd":
        local = [v // p.cp_size for v in case.args["cu_seqlens"].tolist()]
        firsts = torch.tensor([a for a, e in zip(local[:-1], local[1:], strict=True) if e > a], dtype=torch.int64)
        got, x = out[firsts.to(out.device)], t[firsts.to(t.device)]
    else:
        dim = seq_dim(p.tensor_format)
        got, x = out.narrow(dim, 0, min(1, out.shape[dim])), t.narrow(dim, 0, min(1, t.shape[dim]))
    agree("the first token of every sequence (position 0, angle 0) against t", got, x, x, p, caps)


# ---- bad input -------------------------------------------------------------------------------------------

def other_device():
    """A device other than the tensors': the CPU beside a GPU; beside the CPU `meta` (it holds no data)."""
    return "cpu" if DEVICE.type != "cpu" else "meta"


def bad_inputs(case, caps) -> list:
    """(names the message may start with, the exception the contract's table gives, argument overrides) for every
    class of bad argument of docs/contract.md section 5 that applies to the case: each breaks one thing of a valid
    call."""
    p, a = case.plan, case.args
    t, freqs = a["t"], a["freqs"]
    dev = t.device
    thd, fmt = p.tensor_format == "thd", p.tensor_format
    n = len(p.lengths) if thd else p.b
    shape = (*lead_shape(p), p.h, p.d)
    start = a.get("start_positions")
    cu = a.get("cu_seqlens")
    top = token_positions(shape, fmt, start, cu, p.cp_size, p.cp_rank)  # every token's position
    rows = freqs.shape[0]
    some = torch.zeros(n, dtype=torch.int64, device=dev)  # valid start_positions where the case has none
    wrong_fmt = {"sbhd": "sbdh", "bshd": "BSHD", "thd": "tdh"}[fmt]
    bad = [
        (("t",), TypeError, dict(t=t.detach().cpu().tolist())),
        (("t",), TypeError, dict(t=t.to(torch.int32))),
        (("freqs",), TypeError, dict(freqs=freqs.detach().cpu().tolist())),
        (("freqs",), TypeError, dict(freqs=freqs.to(torch.int64))),
        (("tensor_format",), ValueError, dict(tensor_format=wrong_fmt)),
        (("t",), ValueError, dict(t=t.unsqueeze(1) if thd else t.flatten(0, 1))),
        (("freqs",), ValueError, dict(freqs=freqs[:, 0])),
        (("freqs",), ValueError, dict(freqs=freqs.expand(-1, 2, 1, -1))),
        (("freqs",), ValueError, dict(freqs=freqs[..., :-1])),  # d2 odd
        (("freqs",), ValueError, dict(freqs=freqs[..., :0])),  # d2 = 0
        (("freqs",), ValueError, dict(freqs=torch.zeros(rows, 1, 1, p.d + 2 - p.d % 2, device=dev))),  # d2 > d
        (("freqs",), ValueError, dict(freqs=freqs.to(other_device()))),
        (("interleaved",), TypeError, dict(interleaved="yes")),
        (("cp_rank",), ValueError, dict(cp_size=p.cp_size, cp_rank=p.cp_size)),
        (("cp_rank",), ValueError, dict(cp_size=p.cp_size, cp_rank=-1)),
        (("cp_size",), ValueError, dict(cp_size=0, cp_rank=0)),
        (("cp_size",), ValueError, dict(cp_size=True, cp_rank=0)),
    ]
    starts = caps["start_positions"]
    if starts:
        bad += [
            (("start_positions",), TypeError, dict(start_positions=[0] * n)),
            (("start_positions",), TypeError, dict(start_positions=some.float())),
            (("start_positions",), ValueError, dict(start_positions=some[None])),
            (("start_positions",), ValueError, dict(start_positions=torch.cat([some, some.new_zeros(1)]))),
            (("start_positions",), ValueError, dict(start_positions=some.to(other_device()))),
        ]
    if top.numel():
        bad.append((("freqs",), ValueError, dict(freqs=freqs[:int(top.max())])))  # one row short
    if top.numel() and starts:
        # every start moved past the rows left: the furthest token now reaches row s2, one past the end
        spare = rows - int(top.max())
        base = some if start is None else start.long()
        bad.append((("freqs", "start_positions"), ValueError, dict(start_positions=base + spare)))
        lengths = p.lengths if thd else (p.s,) * p.b
        first = next(i for i, m in enumerate(lengths) if m > 0)
        negative = base.clone()
        negative[first] = -1
        bad.append((("start_positions",), ValueError, dict(start_positions=negative)))
    if thd:
        total = int(cu[-1])
        bad += [
            (("cu_seqlens",), ValueError, dict(cu_seqlens=None)),
            (("cu_seqlens",), TypeError, dict(cu_seqlens=cu.tolist())),
            (("cu_seqlens",), TypeError, dict(cu_seqlens=cu.float())),
            (("cu_seqlens",), ValueError, dict(cu_seqlens=cu[None])),
            (("cu_seqlens",), ValueError, dict(cu_seqlens=cu[:0])),
            (("cu_seqlens",), ValueError, dict(cu_seqlens=cu.to(other_device()))),
            (("cu_seqlens",), ValueError, dict(cu_seqlens=cu + 2 * p.cp_size)),  # not starting at 0
            (("cu_seqlens",), ValueError, dict(cu_seqlens=torch.cat([cu[:-1], cu[-1:] + 2 * p.cp_size]))),
            (("cu_seqlens",), ValueError, dict(cu_seqlens=torch.tensor([0, total + 2 * p.cp_size, total],
                                                                       dtype=cu.dtype, device=dev),
                                               start_positions=None)),  # decreasing
        ]
        if p.cp_size > 1 and total:
            bad.append((("cu_seqlens",), ValueError, dict(cu_seqlens=torch.tensor([0, 1, total], dtype=cu.dtype,
                                                                                  device=dev), start_positions=None)))
    else:
        bad.append((("cu_seqlens",), ValueError, dict(cu_seqlens=cu_of([p.s * p.cp_size]).to(dev))))
        if p.cp_size > 1 and p.s:
            bad.append((("t", "cp_size"), ValueError, dict(t=t.narrow(seq_dim(fmt), 0, p.s - 1))))
    return bad


def refuses_bad_input(conv, fn, caps, plan):
    """Every class of bad argument raises the contract's exception (TypeError or ValueError) whose message starts
    with the argument at fault, and leaves every buffer of the case as it was (nothing written, on the way to the
    error either)."""
    if not caps["bad_input"]:
        return
    case = make_case(conv, caps, plan)
    for names, exc, over in bad_inputs(case, caps):
        what = ", ".join(f"{k} = {type(v).__name__ if not isinstance(v, torch.Tensor) else tuple(v.shape)}"
                         for k, v in over.items())
        snap = Snapshot(case.buffers)
        try:
            with torch.no_grad():
                call(fn, case, **over)
        except (TypeError, ValueError) as e:
            assert isinstance(e, exc), f"bad {names[0]} ({what}): expected {exc.__name__}, got {type(e).__name__}: {e}"
            assert str(e).startswith(names), f"bad {names[0]} ({what}): the message does not start with " \
                                             f"{' or '.join(names)}: {e}"
        except Exception as e:  # noqa: BLE001 - any other exception is the wrong kind of error
            raise AssertionError(f"bad {names[0]} ({what}): expected {exc.__name__}, got {type(e).__name__}: "
                                 f"{e}") from e
        else:
            raise AssertionError(f"bad {names[0]} ({what}): no error raised")
        snap.check_unchanged()


TE.INVARIANTS = {
    "pair_norms_preserved": pair_norms_preserved,
    "inverse": inverse,
    "relative_position": relative_position,
    "pass_through_bitwise": pass_through_bitwise,
    "formats_agree": formats_agree,
    "cp_shards": cp_shards,
    "sequences_independent": sequences_independent,
    "batch_rows_alone": batch_rows_alone,
    "interleaved_is_permuted_half_split": interleaved_is_permuted_half_split,
    "layouts_agree": layouts_agree,
    "deterministic": deterministic,
    "adjoint": adjoint,
    "linearity": linearity,
    "zero_angles_identity": zero_angles_identity,
    "refuses_bad_input": refuses_bad_input,
}
CONVENTION = TE()


TE.DOMAIN = {
    "t": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("t"),
          *domains.sizes(lambda p: p.s if p.tensor_format != "thd" else sum(p.lengths) // p.cp_size, "empty",
                         "tokens"),
          *domains.sizes(lambda p: p.h, "empty", "heads"),
          *domains.odd_heads(lambda p: p.d)),
    "freqs": (*domains.dtypes(lambda p: p.freqs_dtype, "freqs_dtypes",
                              (torch.float32, torch.float16, torch.bfloat16, torch.float64)),
              *domains.layouts("freqs", "freqs_strides"),
              *domains.widths(lambda p: (p.rot, p.d)),
              domains.cls("pairs share an angle", lambda p, c: p.equal_halves),
              domains.cls("one angle per channel", lambda p, c: not p.equal_halves, "elementwise_freqs")),
    "tensor_format": (*domains.optional("tensor_format", "bshd or thd",
                                        other_off=lambda caps: set(caps["formats"]) <= {"sbhd"}),
                      *domains.flags(lambda p: p.tensor_format, FORMATS, allowed=lambda caps: caps["formats"])),
    "start_positions": (*domains.optional("start_positions", "a tensor [b]", "start_positions"),
                        domains.cls("int32", lambda p, c: p.start_dtype == torch.int32, "start_positions"),
                        domains.cls("int64", lambda p, c: p.start_dtype == torch.int64, "int64_start_positions")),
    "interleaved": domains.optional("interleaved", "True", "interleaved"),
    # never passed: the implementation's own default runs (TE's named target pins fused=True)
    "fused": (domains.cls("omitted", lambda p, c: "fused" not in c.args),),
    "cu_seqlens": (*domains.optional("cu_seqlens", "a tensor [n + 1] (thd)",
                                     other_off=lambda caps: "thd" not in caps["formats"]),
                   domains.cls("int32", lambda p, c: p.tensor_format == "thd" and p.cu_dtype == torch.int32,
                               off=lambda caps: "thd" not in caps["formats"]),
                   domains.cls("int64", lambda p, c: p.tensor_format == "thd" and p.cu_dtype == torch.int64,
                               "int64_cu_seqlens",
                               off=lambda caps: "thd" not in caps["formats"] or not caps["int64_cu_seqlens"]),
                   domains.cls("an empty sequence", lambda p, c: p.tensor_format == "thd" and 0 in p.lengths,
                               off=lambda caps: "thd" not in caps["formats"]),
                   domains.cls("an empty sequence before one with tokens, with start_positions",
                               lambda p, c: p.tensor_format == "thd" and p.start_dtype is not None
                               and _empty_before_tokens(p.lengths),
                               off=lambda caps: "thd" not in caps["formats"] or not caps["start_positions"]),
                   domains.cls("two sequences with tokens, and heads",
                               lambda p, c: p.tensor_format == "thd" and p.h > 0 and sum(map(bool, p.lengths)) > 1,
                               off=lambda caps: "thd" not in caps["formats"])),
    "cp_size": domains.optional("cp_size", "2 or more", "context_parallel"),
    "cp_rank": domains.optional("cp_rank", "rank > 0", "context_parallel"),
}
