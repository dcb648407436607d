"""flash-attention's convention (flash_attn.layers.rotary):
    apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None) -> out
x [b, s, h, d], or [total, h, d] with cu_seqlens [b + 1] int32 (sequence i is tokens cu_seqlens[i] ..
cu_seqlens[i + 1]) and max_seqlen (at least the longest sequence). cos, sin [seqlen_ro, rotary_dim / 2]: one angle
per pair, half-split pairs (i, i + rotary_dim / 2) or, interleaved, (2i, 2i + 1); rotary_dim <= d, channels past it
copied. Token j of sequence i reads row j + seqlen_offsets (an int, or a [b] int32/int64 tensor: one per sequence);
flash asserts seqlen_ro >= seqlen (max_seqlen for varlen) and, for an int, offset + seqlen <= seqlen_ro. The result
has x's dtype: a new tensor, or x itself written in place with inplace=True. The gradient flows to x (its backward is
the rotation by -theta). In place on a leaf that requires grad, flash's autograd Function writes x and returns it
without marking it dirty: autograd hands back a new tensor over x's memory, and x.grad is the rotation by -theta of
the upstream gradient (the backward property draws such a leaf: x's memory written and returned, x.grad correct).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import pairing
from ..compare import assert_bitwise, assert_undone, assert_within
from ..contract import Returned, same_memory
from ..run import make_case
from ..tensors import DTYPES, Layout, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, head_and_rotary, small


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    table_dtype: torch.dtype
    varlen: bool  # x [total, h, d] with cu_seqlens (else [b, s, h, d])
    lengths: tuple  # each sequence's length (all equal without varlen)
    h: int
    d: int
    rot: int  # rotary_dim = 2 * cos.shape[1]
    interleaved: bool
    inplace: bool
    offsets: object  # None (the default, not passed), an int, or a tuple: one offset per sequence (a tensor)
    offsets_dtype: torch.dtype
    rows: int  # seqlen_ro
    max_seqlen: object  # int with varlen, else None
    x_layout: Layout
    cos_layout: Layout
    sin_layout: Layout
    offsets_layout: Layout
    leaf: bool = False  # with inplace, the backward property passes x as a leaf that requires grad
    explicit_defaults: bool = False  # the optional arguments passed where they hold their defaults
    no_batch: bool = False  # without varlen: x [0, s, h, d] (lengths holds the one s; a tensor offset has none)

    @property
    def batch(self) -> int:
        return 0 if self.no_batch else len(self.lengths)


def limits():
    if small():
        return dict(n=3, s=5, h=3, dims=(2, 4, 6, 7, 8, 12, 16), off=3)
    return dict(n=4, s=512, h=32, dims=(2, 6, 64, 80, 128, 256), off=64)  # flash: head dim <= 256


def rows_needed(varlen: bool, lengths: tuple, max_seqlen, offsets) -> int:
    """seqlen_ro that flash-attention asserts, and that every token's row fits in."""
    span = max_seqlen if varlen else lengths[0]
    if isinstance(offsets, tuple):  # without varlen every sequence is span long (and there may be none)
        ends = [o + n for o, n in zip(offsets, lengths, strict=True)] if varlen else [o + span for o in offsets]
        return max([span, *ends])
    return span + (offsets or 0)


class Flash(Convention):
    NAME = "flash"
    SIGNATURE = ("x", "cos", "sin", "interleaved", "inplace", "seqlen_offsets", "cu_seqlens", "max_seqlen")
    DIFFERENTIABLE = ("x",)
    CAPS = {
        "dtypes": (DTYPES, "dtypes of x"),
        "float32_tables": (True, "cos/sin in float32 with 16-bit x (flash-attention asserts x's dtype)"),
        "interleaved": ((False, True), "the pairings: half-split (False), interleaved (True)"),
        "inplace": (True, "inplace=True: x written and returned"),
        "inplace_leaf": (True, "inplace=True on x a leaf that requires grad (backward): x written, its memory "
                               "returned, x.grad the inverse rotation of the upstream gradient"),
        "tensor_offsets": (True, "seqlen_offsets as a [b] int32/int64 tensor, one offset per sequence"),
        "varlen": (True, "x [total, h, d] with cu_seqlens and max_seqlen"),
        "empty_sequences": (True, "varlen sequences of length 0 (equal consecutive cu_seqlens)"),
        "partial": (True, "rotary_dim < d: the channels past it copied (and odd d)"),
        "strides": (True, "views: x permuted and padded, cos/sin and seqlen_offsets sliced from wider buffers"),
        "backward": (True, "the gradient of x"),
        "accuracy": ("float32", "accuracy model (accuracy.py): float32 math and one rounding, or dtype math"),
        "mixed_tables": (True, "cos/sin in the other 16-bit dtype than x (float16 with bfloat16, the reverse), or "
                               "16-bit with float32 x"),
        "empty": (True, "x [b, s, h, d] without elements: s = 0 or b = 0"),
    }
    OPTIONAL = {"interleaved": False, "inplace": False, "seqlen_offsets": 0, "cu_seqlens": None, "max_seqlen": None}

    def plans(self, caps):
        lim = limits()

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            table_dtype = draw(st.sampled_from(domains.table_dtypes(dtype, caps)))
            varlen = draw(st.booleans()) if caps["varlen"] else False
            zero = domains.empty_dims(draw, caps["empty"], ("s", "b"), 10)  # [b, s, h, d] only (below)
            n = draw(st.integers(1, lim["n"]))
            if varlen:
                low = 0 if caps["empty_sequences"] else 1
                # on a device, the shortest length (an empty sequence where allowed) as often as all the others
                # together: one in 513 would leave empty sequences out of every run
                length = st.sampled_from(range(low, lim["s"] + 1)) if small() else \
                    st.one_of(st.just(low), st.integers(low, lim["s"]))
                lengths = tuple(draw(length) for _ in range(n))
                if not sum(lengths):
                    lengths = (1, *lengths[1:])
                max_seqlen = max(lengths) + draw(st.sampled_from((0, 0, 1)))
            else:
                lengths, max_seqlen = (draw(st.integers(1, lim["s"])),) * n, None
            d, rot = head_and_rotary(draw, lim["dims"], caps["partial"])
            kinds = ("default", "int") + (("tensor",) if caps["tensor_offsets"] else ())
            kind = draw(st.sampled_from(kinds))
            offsets = None if kind == "default" else draw(st.integers(0, lim["off"])) if kind == "int" else \
                tuple(draw(st.integers(0, lim["off"])) for _ in range(n))
            rows = rows_needed(varlen, lengths, max_seqlen, offsets) + draw(st.sampled_from((0, 0, 1, 3)))
            strides = caps["strides"]
            ndim = 3 if varlen else 4
            inplace = draw(st.booleans()) if caps["inplace"] else False
            p = Plan(
                draw(seeds()), dtype, table_dtype, varlen, lengths, draw(st.integers(1, lim["h"])), d, rot,
                draw(st.sampled_from(caps["interleaved"])), inplace,
                offsets, draw(st.sampled_from((torch.int32, torch.int64))), rows, max_seqlen,
                draw(layouts(ndim)) if strides else contiguous(ndim),
                draw(layouts(2)) if strides else contiguous(2), draw(layouts(2)) if strides else contiguous(2),
                draw(layouts(1, spaced=True)) if strides and kind == "tensor" else contiguous(1),  # any: made dense
                draw(st.booleans()) if inplace and caps["inplace_leaf"] else False,
                domains.explicit_defaults(draw, caps))
            if p.inplace and caps["inplace_leaf"]:
                # x a leaf: its boolean crossed with the head count's parity. Drawn after inplace's, the boolean alone
                # could stay false over a run (Hypothesis repeats choices): 9 in-place plans of 50, none a leaf
                p = p._replace(leaf=p.leaf != (p.h % 2 == 0))
            # [b, s, h, d] with s = 0, b = 0 or both (drawn above)
            zero = () if p.varlen else zero
            if "s" in zero:
                p = p._replace(lengths=(0,) * len(p.lengths), rows=p.rows - p.lengths[0])
            if "b" in zero:  # lengths keeps the one s; a tensor offset has no element
                offsets = () if isinstance(p.offsets, tuple) else p.offsets
                return p._replace(lengths=p.lengths[:1], offsets=offsets, no_batch=True)
            return p

        return draw()

    def build(self, p: Plan, arena) -> Case:
        shape = (sum(p.lengths), p.h, p.d) if p.varlen else (p.batch, p.lengths[0], p.h, p.d)
        x = arena.randn(shape, p.dtype, p.x_layout)
        theta = arena.angles((p.rows, p.rot // 2))
        cos = arena.place(torch.cos(theta).to(p.table_dtype), p.cos_layout)
        sin = arena.place(torch.sin(theta).to(p.table_dtype), p.sin_layout)
        args = dict(x=x, cos=cos, sin=sin, interleaved=p.interleaved, inplace=p.inplace)
        if isinstance(p.offsets, tuple):
            args["seqlen_offsets"] = arena.place(torch.tensor(p.offsets, dtype=p.offsets_dtype), p.offsets_layout)
        elif p.offsets is not None:
            args["seqlen_offsets"] = p.offsets
        if p.varlen:
            starts = torch.tensor((0, *p.lengths)).cumsum(0).to(torch.int32)
            args["cu_seqlens"] = arena.place(starts)
            args["max_seqlen"] = p.max_seqlen
        return Case(p, args, 3, arena.buffers)

    def leaf_args(self, case):
        return ("x",) if case.plan.inplace and case.plan.leaf else ()

    def effects(self, case):
        if case.plan.inplace:
            return ("x",), Returned("x", "x", same="memory")
        return (), Returned("x")

    def define(self, case, x64):
        p = case.plan
        rows = table_rows(case, x64)
        cos, sin = (pairing.per_channel(x64[n][rows], p.interleaved).unsqueeze(-2) for n in ("cos", "sin"))
        return {"x": Expect(pairing.rotate(x64["x"], cos, sin, p.interleaved), x64["x"], p.rot, p.interleaved,
                            p.dtype)}


def table_rows(case, x64) -> torch.Tensor:
    """The row of cos/sin each token reads (int64: [b, s], or [total] with varlen), from the arguments as given."""
    p, args = case.plan, case.args
    offsets = args.get("seqlen_offsets", 0)
    offsets = x64["seqlen_offsets"] if isinstance(offsets, torch.Tensor) else torch.tensor(offsets)
    if not p.varlen:
        n, s = x64["x"].shape[:2]
        return torch.arange(s).expand(n, s) + (offsets[:, None] if offsets.dim() else offsets)
    cu = x64["cu_seqlens"]
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    return torch.arange(len(seq)) - cu[seq] + (offsets[seq] if offsets.dim() else offsets)


# ---- the convention's own invariants ---------------------------------------------------------------------


def call(fn, caps, plan, **changes):
    """(the case, the call's result) for `plan` with its arguments as built, `changes` overriding some."""
    case = make_case(CONVENTION, caps, plan)
    case.args.update(changes)
    with torch.no_grad():
        return case, case.call(fn)


def result_of(case, result):
    assert isinstance(result, torch.Tensor), f"expected a tensor, got {type(result).__name__}"
    if case.plan.inplace:
        assert same_memory(result, case.args["x"]), "inplace=True: expected x's memory returned"
    return result


def assert_close(what, got, want, rot, interleaved, caps, roundings=3.0):
    """Two results of one definition, within `roundings` bounds of each other (a kernel may contract either
    product); the pair scale from `want` (a rotation keeps a pair's norm)."""
    assert_within(what, got, want, want, rot, interleaved, roundings, caps.get("accuracy", "float32"))


def first_offset(plan) -> int:
    """The first sequence's offset (0 where there is none: the default, or a tensor offset of b = 0)."""
    if isinstance(plan.offsets, tuple):
        return plan.offsets[0] if plan.offsets else 0
    return plan.offsets or 0


def inplace_equals_out_of_place(conv, fn, caps, plan):
    """inplace=True writes into x exactly what inplace=False returns."""
    if not caps["inplace"]:
        return
    case, new = call(fn, caps, plan._replace(inplace=False))
    new = result_of(case, new)
    case, written = call(fn, caps, plan._replace(inplace=True))
    written = result_of(case, written)
    assert_bitwise("inplace=True against inplace=False", written, new)


def int_offset_equals_tensor(conv, fn, caps, plan):
    """An int seqlen_offsets k equals the tensor [k] * b (in either index dtype), and k = 0 the default."""
    if not caps["tensor_offsets"]:
        return
    k = first_offset(plan)
    n = plan.batch
    as_int = plan._replace(offsets=k)
    rows = max(plan.rows, rows_needed(plan.varlen, plan.lengths, plan.max_seqlen, k))
    case, want = call(fn, caps, as_int._replace(rows=rows))
    want = result_of(case, want)
    case, got = call(fn, caps, as_int._replace(offsets=(k,) * n, rows=rows))
    what = f"seqlen_offsets=tensor([{k}] * {n}, {str(plan.offsets_dtype).replace('torch.', '')}) against {k}"
    assert_close(what, result_of(case, got), want, plan.rot, plan.interleaved, caps)
    if k == 0:
        case, default = call(fn, caps, as_int._replace(offsets=None, rows=rows))
        assert_close("seqlen_offsets omitted against 0", result_of(case, default), want, plan.rot,
                     plan.interleaved, caps)


def offset_is_table_shift(conv, fn, caps, plan):
    """An int seqlen_offsets k reads the rows of cos[k:], sin[k:] with offset 0 (token j reads row j + k)."""
    k = first_offset(plan)
    k = max(k, 1)
    rows = max(plan.rows, rows_needed(plan.varlen, plan.lengths, plan.max_seqlen, k))
    shifted = plan._replace(offsets=k, rows=rows)
    case, want = call(fn, caps, shifted)
    want = result_of(case, want)
    cos, sin = case.args["cos"], case.args["sin"]
    case, got = call(fn, caps, shifted, cos=cos[k:], sin=sin[k:], seqlen_offsets=0)
    assert_close(f"seqlen_offsets={k} against cos[{k}:], sin[{k}:] with 0", result_of(case, got), want,
                 plan.rot, plan.interleaved, caps)


def varlen_one_sequence_equals_batch(conv, fn, caps, plan):
    """x [s, h, d] with cu_seqlens [0, s] equals x [1, s, h, d] (the same tokens, the same offset)."""
    if not caps["varlen"]:
        return
    s = max(plan.lengths[0], 1)
    offsets = (plan.offsets[:1] or (0,)) if isinstance(plan.offsets, tuple) else plan.offsets
    one = plan._replace(lengths=(s,), offsets=offsets, no_batch=False)
    rows = max(plan.rows, rows_needed(True, (s,), s, offsets))
    case, want = call(fn, caps, one._replace(varlen=False, max_seqlen=None, rows=rows, x_layout=contiguous(4)))
    want = result_of(case, want)
    case, got = call(fn, caps, one._replace(varlen=True, max_seqlen=s, rows=rows, x_layout=contiguous(3)))
    assert_close("[s, h, d] with cu_seqlens [0, s] against [1, s, h, d]", result_of(case, got), want[0],
                 plan.rot, plan.interleaved, caps)


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: each sequence (a batch entry, or a varlen sequence) called alone, its own tokens and
    its own offset given as the whole call gives it, and, without varlen, the batch rolled by one, give bitwise its
    results in the whole call."""
    lengths = plan.lengths if len(plan.lengths) > 1 else plan.lengths * 2
    offsets = plan.offsets
    if isinstance(offsets, tuple):
        offsets = offsets if len(offsets) == len(lengths) else (offsets[:1] or (0,)) * len(lengths)
    max_seqlen = max(lengths) if plan.varlen else None
    p = plan._replace(lengths=lengths, offsets=offsets, no_batch=False, max_seqlen=max_seqlen,
                      rows=max(plan.rows, rows_needed(plan.varlen, lengths, max_seqlen, offsets)))
    case = make_case(conv, caps, p)
    x, off = case.args["x"].clone(), case.args.get("seqlen_offsets")
    per_sequence = isinstance(off, torch.Tensor)

    def run_on(**args):
        one = Case(p, {**case.args, **args}, case.positional, caps=case.caps, omit=case.omit, optional=case.optional)
        with torch.no_grad():
            return result_of(one, one.call(fn))

    whole = run_on(x=x.clone())
    if p.varlen:
        cu = case.args["cu_seqlens"].tolist()
        spans = [(i, slice(a, e)) for i, (a, e) in enumerate(zip(cu[:-1], cu[1:], strict=True)) if e > a]
    else:
        spans = [(i, slice(i, i + 1)) for i in range(len(lengths))]
    for i, span in spans:
        args = dict(x=x[span].clone())
        if per_sequence:
            args["seqlen_offsets"] = off[i:i + 1].clone()
        if p.varlen:
            args["cu_seqlens"] = torch.tensor([0, span.stop - span.start], dtype=case.args["cu_seqlens"].dtype,
                                              device=x.device)
        assert_bitwise(f"batch invariance: sequence {i} alone, against in the whole call", run_on(**args), whole[span])
    if not p.varlen:
        args = dict(x=torch.roll(x, 1, 0))
        if per_sequence:
            args["seqlen_offsets"] = torch.roll(off, 1, 0)
        assert_bitwise("batch invariance: the batch rolled by one, against the whole call's rolled", run_on(**args),
                       torch.roll(whole, 1, 0))


def inverse(conv, fn, caps, plan):
    """The call with -sin undoes the call (R(-theta) R(theta) = I), within two roundings and the tables'."""
    case = make_case(conv, caps, plan)
    x0 = case.args["x"].cpu().clone()  # the input as it was (an in-place call writes it)
    with torch.no_grad():
        out = result_of(case, case.call(fn))
        case.args.update(x=out, sin=-case.args["sin"])
        back = result_of(case, case.call(fn))
    assert_undone("inverse", back, x0, plan.rot, plan.interleaved, plan.table_dtype, caps.get("accuracy", "float32"))


def pairing_orders(rot: int, d: int):
    """(neox, to_interleaved): channel indices such that y[..., neox] puts the interleaved form's pairs (2i, 2i + 1)
    at (i, i + rot/2), and x[..., to_interleaved] the other way; channels past rot stay."""
    neox = torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, d)])
    return neox, torch.argsort(neox)


def interleaved_moves_channels(conv, fn, caps, plan):
    """interleaved=True on channels rearranged (i, i + rot/2) -> (2i, 2i + 1) equals interleaved=False, rearranged
    back: the flag moves channels, nothing else (within two roundings: a kernel may contract either product)."""
    if set(caps["interleaved"]) != {False, True}:
        return
    case, half_split = call(fn, caps, plan._replace(interleaved=False))
    want = result_of(case, half_split)
    neox, to_interleaved = pairing_orders(plan.rot, plan.d)
    x = make_case(conv, caps, plan).args["x"]
    moved = x[..., to_interleaved.to(x.device)].contiguous()
    case, got = call(fn, caps, plan._replace(interleaved=True), x=moved)
    got = result_of(case, got)[..., neox.to(moved.device)]
    assert_close("interleaved=True on rearranged channels against interleaved=False", got, want, plan.rot, False,
                 caps)


Flash.INVARIANTS = {
    "interleaved_moves_channels": interleaved_moves_channels,
    "inplace_equals_out_of_place": inplace_equals_out_of_place,
    "int_offset_equals_tensor": int_offset_equals_tensor,
    "offset_is_table_shift": offset_is_table_shift,
    "varlen_one_sequence_equals_batch": varlen_one_sequence_equals_batch,
    "batch_rows_alone": batch_rows_alone,
    "inverse": inverse,
}
def pin(varlen, lengths, offsets, **fields) -> Plan:
    """A pinned call: float32, two heads of 16 channels rotated whole, contiguous, tables as long as needed."""
    max_seqlen = max(lengths) if varlen else None
    base = dict(seed=0, dtype=torch.float32, table_dtype=torch.float32, varlen=varlen, lengths=lengths, h=2, d=16,
                rot=16, interleaved=False, inplace=False, offsets=offsets, offsets_dtype=torch.int32,
                rows=rows_needed(varlen, lengths, max_seqlen, offsets), max_seqlen=max_seqlen,
                x_layout=contiguous(3 if varlen else 4), cos_layout=contiguous(2), sin_layout=contiguous(2),
                offsets_layout=contiguous(1))
    return Plan(**{**base, **fields})


# Per-sequence offsets that differ (the first neither the smallest nor the largest), in [b, s, h, d] and in varlen
# with an empty sequence: each sequence reads its own offset, on every profile.
Flash.PINS = (pin(False, (4, 4, 4), (2, 0, 5), seed=1),
              pin(True, (3, 0, 5), (1, 4, 0), interleaved=True, seed=2))

CONVENTION = Flash()


def _tables_domain(layout: str) -> tuple:  # layout: the argument, cos or sin
    def pair(p):
        return p.dtype, p.table_dtype

    return (*domains.pairings(pair), domains.table_16bit_float32_input(pair, "mixed_tables"),
            *domains.layouts(layout),
            domains.cls("the whole head", lambda p, c: p.rot == p.d),
            domains.cls("narrower than the head", lambda p, c: p.rot < p.d, "partial"))


Flash.DOMAIN = {
    "x": (*domains.dtypes(lambda p: p.dtype), *domains.layouts("x"),
          domains.cls("[b, s, h, d]", lambda p, c: not p.varlen),
          domains.cls("[total, h, d] (varlen)", lambda p, c: p.varlen, "varlen"),
          domains.cls("a sequence of length 0", lambda p, c: p.varlen and 0 in p.lengths, "empty_sequences"),
          *domains.sizes(lambda p: p.lengths[0], "", "the first sequence's length", empty=False),
          domains.cls("s = 0 (empty [b, s, h, d])", lambda p, c: not p.varlen and p.lengths[0] == 0, "empty"),
          domains.cls("b = 0 (empty [b, s, h, d])", lambda p, c: not p.varlen and p.batch == 0, "empty"),
          domains.cls("a leaf that requires grad (inplace)", lambda p, c: p.leaf, "inplace_leaf")),
    "cos": _tables_domain("cos"),
    "sin": _tables_domain("sin"),
    "interleaved": domains.optional("interleaved", "True", other_off=lambda caps: True not in caps["interleaved"]),
    "inplace": domains.optional("inplace", "True", "inplace"),
    "seqlen_offsets": (*domains.optional("seqlen_offsets", "an int or a tensor"),
                       domains.cls("a tensor [b]", lambda p, c: isinstance(p.offsets, tuple), "tensor_offsets"),
                       domains.spaced("seqlen_offsets")),
    "cu_seqlens": domains.optional("cu_seqlens", "a tensor", "varlen"),
    "max_seqlen": domains.optional("max_seqlen", "an int", "varlen"),
}
