"""QK-RMSNorm fused with RoPE in TransformerEngine's layouts (`rope.qknorm.apply_freqs`):
    apply_freqs(q, k, q_weight, k_weight, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                cu_seqlens=None, cp_size=1, cp_rank=0, eps=1e-6, gemma=False) -> (q', k')
q [s, b, hq, d] (sbhd), [b, s, hq, d] (bshd) or [T, hq, d] (thd, sequences cu_seqlens [n + 1], their lengths on all
ranks), k the same with hk heads; weights [d]; freqs [s2, 1, 1, rot] (read as float32; rot <= d even). Per head: y =
R(x r w), r = (mean(x^2) + eps)^(-1/2) over all d channels, w -> 1 + w with gemma, R the rotation of the first rot
channels at TransformerEngine's positions (positions.py: packed sequences restart at 0, the dual-chunk layout of
cp_rank, then start_positions[sequence]). New tensors of q's dtype; gradients for q, k and both weights. The norm's
float64 definition and accuracy model are qknorm_math.py's; the rotation's angles are the float32 freqs' exact cos
and sin, as te_oracle.py has them.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple, Optional

import torch
from hypothesis import strategies as st

from .. import accuracy, pairing
from ..compare import assert_bitwise
from ..contract import Returned, Snapshot
from ..positions import token_positions
from ..run import make_case
from ..tensors import DTYPES, Layout, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, head_and_rotary, qknorm_math, small
from .qknorm import EPS_VALUES, MAGNITUDES, QKNorm, rotation_preserves_norm
from .te import graph_view, laid_out_as

FORMATS = ("sbhd", "bshd", "thd")


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    weight_dtype: torch.dtype
    freqs_dtype: torch.dtype
    tensor_format: str
    s: int  # tokens per sequence on this rank (sbhd, bshd)
    b: int
    lengths: tuple  # thd: the sequences' lengths on all ranks (multiples of 2 cp_size where cp_size > 1)
    hq: int
    hk: int
    d: int
    rot: int
    interleaved: bool
    equal_halves: bool  # the two members of each pair share an angle (RotaryPositionEmbedding's freqs)
    gemma: bool
    eps: float
    magnitude: float
    start_dtype: Optional[torch.dtype]  # None: start_positions not passed
    cp_size: int
    cp_rank: int
    extra_rows: int  # freqs' rows past the last position
    q_layout: Layout
    k_layout: Layout
    freqs_layout: Layout
    explicit_defaults: bool = False  # optional arguments passed where they hold their defaults

    @property
    def table_dtype(self):
        """The angles' cos and sin are evaluated in float32 (rotation_preserves_norm's table error)."""
        return torch.float32


def lead_shape(p: Plan) -> tuple:
    """q's and k's token dims."""
    if p.tensor_format == "thd":
        return (sum(p.lengths) // p.cp_size,)
    return (p.s, p.b) if p.tensor_format == "sbhd" else (p.b, p.s)


def no_tokens(p: Plan, names) -> Plan:
    """The plan without tokens (domains.with_empty): s = 0 or b = 0, or for thd every sequence empty."""
    if p.tensor_format == "thd":
        return p._replace(lengths=(0,) * len(p.lengths))
    return p._replace(**{n: 0 for n in names})


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


class TEQKNorm(Convention):
    NAME = "te-qknorm"
    SIGNATURE = ("q", "k", "q_weight", "k_weight", "freqs", "tensor_format", "start_positions", "interleaved",
                 "cu_seqlens", "cp_size", "cp_rank", "eps", "gemma")
    DIFFERENTIABLE = ("q", "k", "q_weight", "k_weight")
    CAPS = {
        "dtypes": (DTYPES, "dtypes of q and k"),
        "weight_dtypes": ("any", "the weights' dtype: 'any' float dtype (float32 with 16-bit q), or 'q' (q's only)"),
        "freqs_dtypes": (DTYPES, "dtypes of freqs (read as float32)"),
        "formats": (FORMATS, "tensor formats (thd with cu_seqlens)"),
        "partial": (True, "rot < d (freqs narrower than the head), and odd d"),
        "interleaved": (True, "interleaved (GPT-J) pairs"),
        "elementwise_freqs": (True, "angles that differ within a pair (freqs act channel by channel)"),
        "gemma": (True, "the gemma keyword (weights 1 + w)"),
        "start_positions": (True, "start_positions, int32 or int64, one per sequence"),
        "context_parallel": (True, "cp_size > 1: the dual-chunk positions of cp_rank"),
        "strides": (True, "q, k and freqs as views (permuted, padded)"),
        "messages": (True, "bad input refused with TypeError/ValueError whose message starts with the argument"),
        "accuracy": ("float32", "accuracy model (accuracy.py, qknorm_math.py)"),
        "empty": (True, "no tokens: s = 0 or b = 0 (sbhd, bshd), thd whose sequences are all empty"),
    }
    grad_scale = QKNorm.grad_scale

    OPTIONAL = {"tensor_format": "sbhd", "start_positions": None, "interleaved": False, "cu_seqlens": None,
                "cp_size": 1, "cp_rank": 0, "eps": 1e-6, "gemma": False}

    def plans(self, caps):
        # the interpreter's time grows with the tokens (one program each, or per (s, b) with start_positions)
        lim = dict(s=3, b=2, h=3, n=2, len=2, cp=(1, 1, 2), extra=2, dims=(2, 4, 6, 7, 8, 10, 16)) if small() else \
            dict(s=128, b=2, h=17, n=6, len=24, cp=(1, 1, 2, 3), extra=64, dims=(2, 6, 64, 80, 81, 128, 256))

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            d, rot = head_and_rotary(draw, lim["dims"], caps["partial"])
            fmt = draw(st.sampled_from(caps["formats"]))
            cp = draw(st.sampled_from(lim["cp"])) if caps["context_parallel"] else 1
            s = draw(st.integers(1, lim["s"]))
            s = 2 * max(1, s // 2) if cp > 1 else s
            unit = 2 * cp if cp > 1 else 1  # thd: each sequence splits into 2 cp_size chunks
            lengths = tuple(unit * n for n in draw(st.lists(st.integers(0, lim["len"]), min_size=1,
                                                            max_size=lim["n"]))) if fmt == "thd" else ()
            if lengths and not sum(lengths) and not caps["empty"]:  # tokens, where empty tensors are not drawn
                lengths = (unit, *lengths[1:])
            hq = draw(st.integers(1, lim["h"]))
            nd = 3 if fmt == "thd" else 4
            strides = caps["strides"]
            return Plan(
                draw(seeds()), dtype, draw(st.sampled_from(domains.any_dtype(dtype)))
                if caps["weight_dtypes"] == "any" else dtype, draw(st.sampled_from(caps["freqs_dtypes"])), fmt, s,
                draw(st.integers(1, lim["b"])), lengths, hq, draw(st.integers(1, hq)), d, rot,
                caps["interleaved"] and draw(st.booleans()),
                draw(st.booleans()) if caps["elementwise_freqs"] else True, caps["gemma"] and draw(st.booleans()),
                draw(st.sampled_from(EPS_VALUES)), draw(st.sampled_from(MAGNITUDES)),
                draw(st.sampled_from((None, torch.int32, torch.int64))) if caps["start_positions"] else None,
                cp, draw(st.integers(0, cp - 1)), draw(st.integers(0, lim["extra"])),
                draw(layouts(nd)) if strides else contiguous(nd), draw(layouts(nd)) if strides else contiguous(nd),
                draw(layouts(4)) if strides else contiguous(4))

        return domains.with_explicit(domains.with_empty(draw(), caps, no_tokens, ("b", "s")),
                                     caps)

    def build(self, p: Plan, arena, weights=None) -> Case:
        lead = lead_shape(p)

        def heads(h, layout):
            x = torch.randn((*lead, h, p.d), generator=arena.gen, dtype=torch.float64) * p.magnitude
            return arena.place(x.to(p.dtype), layout)

        q, k = heads(p.hq, p.q_layout), heads(p.hk, p.k_layout)
        ws = [arena.randn((p.d,), p.weight_dtype) for _ in range(2)] if weights is None else \
            [arena.place(w.to(p.weight_dtype)) for w in weights]
        thd = p.tensor_format == "thd"
        cu = cu_of(p.lengths) if thd else None
        start = arena.integers(0, 4, (len(p.lengths) if thd else p.b,)) if p.start_dtype is not None else None
        # freqs reach every position: of s tokens even where b = 0 (TE checks s against freqs' rows)
        tokens = lead if thd or p.b else lead_shape(p._replace(b=1))
        pos = token_positions((*tokens, p.hq, p.d), p.tensor_format, start if thd or p.b else None, cu, p.cp_size,
                              p.cp_rank)
        rows = (int(pos.max()) + 1 if pos.numel() else 1) + p.extra_rows  # freqs reach every position
        theta = pairing.per_channel(arena.angles((rows, p.rot // 2)), p.interleaved) if p.equal_halves else \
            arena.angles((rows, p.rot))
        freqs = arena.place(theta.to(p.freqs_dtype).reshape(rows, 1, 1, p.rot), p.freqs_layout)
        args = dict(q=q, k=k, q_weight=ws[0], k_weight=ws[1], freqs=freqs, tensor_format=p.tensor_format)
        if start is not None:
            args["start_positions"] = arena.place(start.to(p.start_dtype))
        if p.interleaved:
            args["interleaved"] = True
        if thd:
            args["cu_seqlens"] = arena.place(cu)
        if p.cp_size > 1:
            args["cp_size"], args["cp_rank"] = p.cp_size, p.cp_rank
        args["eps"] = p.eps
        if p.gemma:
            args["gemma"] = True
        return Case(p, args, 5, arena.buffers)

    def effects(self, case):
        return (), (Returned("q"), Returned("k"))

    def define(self, case, x64):
        p = case.plan
        pos = token_positions(x64["q"].shape, p.tensor_format, x64.get("start_positions"), x64.get("cu_seqlens"),
                              p.cp_size, p.cp_rank)
        theta = x64["freqs"][:, 0, 0, :].float().double()[pos]  # read as float32; [b, s, rot] or [T, rot]
        if p.tensor_format == "sbhd":
            theta = theta.transpose(0, 1)
        cos, sin = theta.cos().unsqueeze(-2), theta.sin().unsqueeze(-2)  # over the heads
        return {name: Expect(qknorm_math.norm_rope(x64[name], x64[f"{name}_weight"], p.eps, p.gemma, cos, sin,
                                                   p.interleaved),
                             qknorm_math.forward_source(x64[name], x64[f"{name}_weight"], p.eps, p.gemma, p.rot,
                                                        p.interleaved), p.d, False, p.dtype)
                for name in ("q", "k")}


# ---------------------------------------------------------------------------------------------- invariants

def call(fn, case, **overrides):
    args = {n: v for n, v in {**case.args, **overrides}.items() if v is not None}
    return Case(case.plan, args, case.positional).call(fn)


def assert_close(what, got, want, x, w, plan):
    """got within twice the forward model of want (both results of the same definition, whose norm may sum in
    another order in another launch: qknorm_math)."""
    want = want.detach().cpu().double()
    a = qknorm_math.norm(x.detach().cpu(), w.detach().cpu(), plan.eps, plan.gemma)[2]
    tol = 2 * accuracy.bound(want, qknorm_math.k_fwd(plan.d) * qknorm_math.elementwise_scale(a, plan.rot,
                                                                                               plan.interleaved),
                             plan.dtype)
    bad = ~((got.detach().cpu().double() - want).abs() <= tol)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond the norm's rounding"


def _seq(plan) -> Plan:
    """The plan as one [1, s, h, d] (bshd) sequence's call."""
    return plan._replace(tensor_format="bshd", b=1, lengths=(), q_layout=contiguous(4), k_layout=contiguous(4))


def thd_equals_per_sequence(conv, fn, caps, plan):
    """thd: each packed sequence's tokens get the result of a bshd call of that sequence alone (its positions
    restart at 0, then its start_positions and the rank's chunks)."""
    if "thd" not in caps["formats"] or "bshd" not in caps["formats"]:
        return
    lengths = plan.lengths or (plan.s * plan.cp_size,) * plan.b
    lengths = lengths[:2] if small() else lengths  # the interpreter: a program per token, one after another
    if sum(n > 0 for n in lengths) == 1:  # positions that do not restart differ only after a sequence with tokens
        lengths = (*lengths, max(lengths))
    p = plan._replace(tensor_format="thd", lengths=lengths, q_layout=contiguous(3), k_layout=contiguous(3))
    case = make_case(conv, caps, p)
    got = call(fn, case)
    cu = [int(v) // p.cp_size for v in case.args["cu_seqlens"].tolist()]
    for i, (a, e) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        if e == a:
            continue
        one = {n: case.args[n][a:e].unsqueeze(0) for n in ("q", "k")}
        start = case.args.get("start_positions")
        want = call(fn, case, **one, tensor_format="bshd", cu_seqlens=None,
                    start_positions=None if start is None else start[i:i + 1])
        for name, g, w in zip(("q", "k"), got, want, strict=True):
            assert_close(f"thd sequence {i}: {name} against its own bshd call", g[a:e], w[0], one[name][0],
                         case.args[f"{name}_weight"], p)


def start_positions_shift(conv, fn, caps, plan):
    """start_positions[i] = P gives sequence i the result of freqs shifted by P rows without start_positions."""
    if not caps["start_positions"] or "bshd" not in caps["formats"]:
        return
    p = _seq(plan)._replace(b=1 if small() else plan.b, start_dtype=plan.start_dtype or torch.int64, cp_size=1,
                            cp_rank=0)
    case = make_case(conv, caps, p)
    got = call(fn, case)
    for i, start in enumerate(case.args["start_positions"].tolist()):
        # fresh tensors: each sequence's call and each shift has the same alignment (one kernel specialization)
        one = {n: case.args[n][i:i + 1].clone() for n in ("q", "k")}
        want = call(fn, case, **one, freqs=case.args["freqs"][start:].clone(), start_positions=None)
        for name, g, w in zip(("q", "k"), got, want, strict=True):
            assert_close(f"sequence {i}: {name} with freqs shifted by start_positions {start}", g[i:i + 1], w,
                         one[name], case.args[f"{name}_weight"], p)


def cp_shards(conv, fn, caps, plan):
    """A rank's call (cp_size, cp_rank) on its two chunks of each sequence equals the unsharded call at those
    tokens."""
    if not caps["context_parallel"] or "bshd" not in caps["formats"]:
        return
    size = plan.cp_size if plan.cp_size > 1 else 2
    rank, chunk = plan.seed % size, max(1, plan.s // 2)
    full = make_case(conv, caps, _seq(plan)._replace(b=1 if small() else plan.b, s=2 * size * chunk, cp_size=1,
                                                     cp_rank=0))
    tokens = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                        torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)])
    local = {n: full.args[n].index_select(1, tokens.to(full.args[n].device)) for n in ("q", "k")}
    want = call(fn, full)
    got = call(fn, full, **local, cp_size=size, cp_rank=rank)
    for name, g, w in zip(("q", "k"), got, want, strict=True):
        assert_close(f"rank {rank} of {size}: {name} against the unsharded call's tokens", g,
                     w.index_select(1, tokens.to(w.device)), local[name], full.args[f"{name}_weight"], full.plan)


def preserves_norm(conv, fn, caps, plan):
    """qknorm's rotation_preserves_norm (every weight c, eps -> 0: each output head holds sum y^2 = d c^2) on angles
    equal within each pair: only then is the map a rotation."""
    rotation_preserves_norm(conv, fn, caps, plan._replace(equal_halves=True))


def forward_backward(fn, case, ups=None, **overrides):
    """((q', k'), (q's gradient, k's), ups) of one call as training makes it: q and k views in the graph in their
    layouts (te.graph_view), the weights leaves that require grad; ups: random upstream gradients (seeded by the
    plan) unless given. The weights' gradients are computed with the others and not returned."""
    views, leaves = zip(*(graph_view(overrides.pop(n, case.args[n])) for n in ("q", "k")), strict=True)
    weights = {n: case.args[n].detach().clone().requires_grad_() for n in ("q_weight", "k_weight")}
    outs = call(fn, case, **dict(zip(("q", "k"), views, strict=True)), **weights, **overrides)
    if ups is None:
        gen = torch.Generator().manual_seed(case.plan.seed + 2)
        ups = tuple(torch.randn(tuple(o.shape), generator=gen, dtype=torch.float64).to(o.dtype).to(o.device)
                    for o in outs)
    if any(o.numel() for o in outs):
        torch.autograd.backward(outs, ups)
    grads = tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves)
    return tuple(o.detach() for o in outs), grads, ups


def _batched(plan) -> Plan:
    """The plan with at least two sequences that hold tokens: b >= 2 and s >= 1 (sbhd, bshd), or thd with sequences
    of one unit (2 cp_size tokens under context parallelism) added."""
    if plan.tensor_format != "thd":
        return plan._replace(b=max(plan.b, 2), s=plan.s or (2 if plan.cp_size > 1 else 1))
    lengths = plan.lengths
    while sum(n > 0 for n in lengths) < 2:
        lengths = (*lengths, 2 * plan.cp_size if plan.cp_size > 1 else 1)
    return plan._replace(lengths=lengths)


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: each sequence (a batch entry, or a packed thd sequence with cu_seqlens of its own)
    called alone (its own new tensors), its own start position given as start_positions, and the sequences rolled by
    one (each at another batch index or packed offset, start_positions rolled with them; in the whole call's layout,
    so that the rolled call is the whole call's kernel specialization) give bitwise its results in the whole call: q'
    and k', and q's and k's gradients from the same random upstream gradients. The norm's sum runs over one head of
    one token, so nothing of another sequence may enter it; the weights' gradients are a sum over every token of
    the call by definition and are not compared."""
    p = _batched(plan)
    case = make_case(conv, caps, p)
    outs, grads, ups = forward_backward(fn, case)
    start = case.args.get("start_positions")
    thd = p.tensor_format == "thd"
    dim = 1 if p.tensor_format == "sbhd" else 0
    device = case.args["q"].device
    if thd:
        cu = case.args["cu_seqlens"].tolist()
        local = [v // p.cp_size for v in cu]
        spans = [slice(a, e) for a, e in zip(local[:-1], local[1:], strict=True)]
    else:
        spans = [slice(i, i + 1) for i in range(p.b)]
    held = [i for i, span in enumerate(spans) if span.stop > span.start]
    for i in sorted({held[0], held[-1], held[p.seed % len(held)]}):
        index = (slice(None),) * dim + (spans[i],)
        extra = {} if start is None else dict(start_positions=start[i:i + 1].clone())
        if thd:
            extra["cu_seqlens"] = torch.tensor([0, cu[i + 1] - cu[i]], dtype=case.args["cu_seqlens"].dtype,
                                               device=device)
        o, g, _ = forward_backward(fn, case, tuple(u[index].clone() for u in ups),
                                   **{n: case.args[n][index].clone() for n in ("q", "k")}, **extra)
        for name, alone, whole in zip(("q", "k"), o, outs, strict=True):
            assert_bitwise(f"batch invariance: {name} of sequence {i} alone, against in the whole call", alone,
                           whole[index])
        for name, alone, whole in zip(("q", "k"), g, grads, strict=True):
            assert_bitwise(f"batch invariance: the gradient of {name} of sequence {i} alone, against in the whole "
                           f"call", alone, whole[index])
    order = torch.roll(torch.arange(len(spans)), 1)
    perm = torch.cat([torch.arange(spans[j].start, spans[j].stop) for j in order.tolist()]).to(device)
    extra = {} if start is None else dict(start_positions=start.index_select(0, order.to(start.device)))
    if thd:
        extra["cu_seqlens"] = cu_of([p.lengths[j] for j in order.tolist()]).to(device)
    o, g, _ = forward_backward(fn, case, tuple(u.index_select(dim, perm) for u in ups),
                               **{n: laid_out_as(case.args[n], case.args[n].index_select(dim, perm))
                                  for n in ("q", "k")}, **extra)
    for what, got, want in (("", o, outs), ("the gradient of ", g, grads)):
        for name, r, w in zip(("q", "k"), got, want, strict=True):
            assert_bitwise(f"batch invariance: {what}{name} with the sequences rolled by one, against the whole "
                           f"call's rolled", r, w.index_select(dim, perm))


def refuses(fn, case, bad: dict, caps):
    """Each (argument, exception type, overrides) of `bad` raises that exception, its message starting with the
    argument's name (caps "messages"), and leaves every buffer of the case as it was."""
    for name, exc, over in bad:
        snap = Snapshot(case.buffers)
        try:
            with torch.no_grad():
                call(fn, case, **over)
        except (TypeError, ValueError) as e:
            assert isinstance(e, exc), f"bad {name}: expected {exc.__name__}, got {type(e).__name__}: {e}"
            assert not caps["messages"] or str(e).startswith(name), f"bad {name}: the message does not start " \
                                                                     f"with {name!r}: {e}"
        else:
            raise AssertionError(f"bad {name} ({', '.join(over)} = {list(over.values())!r:.80}): no error raised")
        snap.check_unchanged()


def refuses_bad_input(conv, fn, caps, plan):
    """Bad input refused by name before anything is written: eps <= 0, weights of the wrong length or dtype (or
    not tensors), float64 q, a flag that is no bool, freqs wider than the head, cu_seqlens outside thd."""
    case = make_case(conv, caps, plan)
    q, w = case.args["q"], case.args["q_weight"]
    freqs = case.args["freqs"]
    bad = [("eps", ValueError, dict(eps=0.0)), ("eps", ValueError, dict(eps=-plan.eps)),
           ("q_weight", ValueError, dict(q_weight=torch.cat([w, w[:1]]))),
           ("k_weight", TypeError, dict(k_weight=w.double())), ("k_weight", TypeError, dict(k_weight=[1.0] * plan.d)),
           ("q", TypeError, dict(q=q.double())), ("gemma", TypeError, dict(gemma="yes")),
           ("freqs", ValueError, dict(freqs=freqs.new_zeros(freqs.shape[0], 1, 1, plan.d + 2)))]
    if plan.tensor_format != "thd":
        bad.append(("cu_seqlens", ValueError, dict(cu_seqlens=torch.tensor([0, 1], dtype=torch.int32,
                                                                            device=q.device))))
    refuses(fn, case, bad, caps)


TEQKNorm.INVARIANTS = {
    "batch_rows_alone": batch_rows_alone,
    "rotation_preserves_norm": preserves_norm,
    "thd_equals_per_sequence": thd_equals_per_sequence,
    "start_positions_shift": start_positions_shift,
    "cp_shards": cp_shards,
    "refuses_bad_input": refuses_bad_input,
}
CONVENTION = TEQKNorm()


def _weight_domain() -> tuple:
    return domains.pairings(lambda p: (p.dtype, p.weight_dtype), "", "weight_dtypes",
                            mixed_off=lambda caps: caps["weight_dtypes"] != "any",
                            float32_off=lambda caps: caps["weight_dtypes"] != "any")


TEQKNorm.DOMAIN = {
    "q": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("q"),
          *domains.odd_heads(lambda p: p.d),
          domains.cls("s = 0 (empty)", lambda p, c: p.tensor_format != "thd" and p.s == 0, "empty"),
          domains.cls("b = 0 (empty)", lambda p, c: p.tensor_format != "thd" and p.b == 0, "empty"),
          domains.cls("thd without tokens (empty)", lambda p, c: p.tensor_format == "thd" and not sum(p.lengths),
                      "empty")),
    "k": (*domains.layouts("k"), *domains.head_counts(lambda p: (p.hq, p.hk), cap="")),
    "q_weight": _weight_domain(),
    "k_weight": _weight_domain(),
    "freqs": (*domains.dtypes(lambda p: p.freqs_dtype, "freqs_dtypes"), *domains.layouts("freqs"),
              *domains.widths(lambda p: (p.rot, p.d)),
              domains.cls("pairs share an angle", lambda p, c: p.equal_halves),
              domains.cls("one angle per channel", lambda p, c: not p.equal_halves, "elementwise_freqs")),
    "tensor_format": (*domains.optional("tensor_format", "bshd or thd",
                                        other_off=lambda caps: set(caps["formats"]) <= {"sbhd"}),
                      *domains.flags(lambda p: p.tensor_format, FORMATS, allowed=lambda caps: caps["formats"])),
    "start_positions": (*domains.optional("start_positions", "a tensor", "start_positions"),
                        *domains.index_dtypes(lambda p: p.start_dtype or torch.int64, "start_positions")),
    "interleaved": domains.optional("interleaved", "True", "interleaved"),
    "cu_seqlens": (*domains.optional("cu_seqlens", "a tensor (thd)",
                                     other_off=lambda caps: "thd" not in caps["formats"]),
                   domains.cls("an empty sequence", lambda p, c: 0 in p.lengths,
                               off=lambda caps: "thd" not in caps["formats"])),
    "cp_size": domains.optional("cp_size", "2", "context_parallel"),
    "cp_rank": domains.optional("cp_rank", "rank > 0", "context_parallel"),
    "eps": (*domains.optional("eps", "another eps"),),
    "gemma": domains.optional("gemma", "True", "gemma"),
}
