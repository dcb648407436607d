"""transformers' multimodal RoPE (Qwen2-VL, Qwen2.5-VL):
    apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1) -> (q_embed, k_embed)
    cos = cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section * 2, dim=-1))], dim=-1)  (sin alike)
    q_embed = q * cos.unsqueeze(unsqueeze_dim) + rotate_half(q) * sin.unsqueeze(unsqueeze_dim)
cos, sin [3, b or 1, s, r]: one table per position stream (temporal, height, width), each cat(theta, theta) as
the model's rotary module builds it; mrope_section: rotary pairs per stream, summing to r/2 (the list doubled
covers both halves, so pair (i, i + r/2) reads one stream at both of its channels). r = cos.shape[-1] is the
rotary width: channels r.. pass through (partial rotary, as in spec/hf.py; r = d in Qwen2-VL). q, k as in
spec/hf.py. New tensors in torch's promotion of q's and cos's dtypes; the gradient flows to q and k.

The section helpers here (the stream each pair reads, the sections a strategy draws, the selection of a
per-channel table out of three) are shared by the other multimodal conventions (qwen3vl-mrope, vllm-mrope,
mrope). Qwen3-VL's interleaved layout: pair i reads stream i % 3 while i < 3 * mrope_section[i % 3], else 0.
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
from ..tensors import Layout, channel_layouts, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, small
from .hf import HF, rotary_widths

# ---- sections: shared by every multimodal convention -------------------------------------------------------


def stream_of_pair(section, pairs: int, interleaved_layout: bool) -> torch.Tensor:
    """The stream (0 temporal, 1 height, 2 width) each of `pairs` rotary pairs reads. Consecutive sections
    (Qwen2-VL), or Qwen3-VL's interleaved layout: pairs m, m + 3, ... below 3 * section[m] read stream m
    (m = 1, 2), every other pair stream 0."""
    if not interleaved_layout:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(list(section)))
    stream = torch.zeros(pairs, dtype=torch.int64)
    for m in (1, 2):
        stream[m:3 * section[m]:3] = m
    return stream


def select(tables, stream_of_channel: torch.Tensor):
    """One per-channel table [..., r] out of three [3, ..., r]: channel c from table stream_of_channel[c]."""
    stream = stream_of_channel.to(tables.device)
    return torch.where(stream == 0, tables[0], torch.where(stream == 1, tables[1], tables[2]))


def stream_of_channel(section, rot: int, interleaved_layout: bool, interleaved_pairs: bool) -> torch.Tensor:
    """The stream each of the `rot` rotated channels reads: its pair's (pairs (2i, 2i + 1) or (i, i + rot/2))."""
    stream = stream_of_pair(section, rot // 2, interleaved_layout)
    channel = torch.arange(rot)
    return stream[channel // 2 if interleaved_pairs else channel % (rot // 2)]


def pairs_per_stream_at_most(pairs: int, m: int) -> int:
    """Interleaved: how many pairs m, m + 3, ... lie below `pairs` (the most stream m can hold)."""
    return len(range(m, pairs, 3))


def interleaved_sections(pairs: int) -> list:
    """The sections the interleaved layout can hold; of them, those under which some pair reads another stream than
    under consecutive sections (so that taking one layout for the other shows), where there are any. First those
    whose 3 * section bound leaves a pair past it to stream 0 (Qwen3-VL's [24, 20, 20] over 64 pairs: pair 61 reads
    stream 0, not 61 % 3 = 1), so that a few examples draw one; then the largest streams 1 and 2."""
    valid = [(pairs - s1 - s2, s1, s2) for s1 in range(pairs_per_stream_at_most(pairs, 1), -1, -1)
             for s2 in range(pairs_per_stream_at_most(pairs, 2), -1, -1)]
    differ = [c for c in valid if not torch.equal(stream_of_pair(c, pairs, True), stream_of_pair(c, pairs, False))]
    unbounded = torch.arange(pairs) % 3
    return sorted(differ or valid, key=lambda c: torch.equal(stream_of_pair(c, pairs, True), unbounded))


@st.composite
def sections(draw, pairs: int, interleaved_layout: bool):
    """Three counts of pairs summing to `pairs` (zeros included), each one the layout can hold: interleaved,
    stream m in (1, 2) takes pairs m, m + 3, ... below 3 * section[m], which must hold section[m] of them."""
    if interleaved_layout:
        return draw(st.sampled_from(interleaved_sections(pairs)))
    elif pairs >= 3 and draw(st.booleans()):  # every stream a section, as the models' are
        s1 = draw(st.integers(1, pairs - 2))
        s2 = draw(st.integers(1, pairs - 1 - s1))
    else:
        s1 = draw(st.integers(0, pairs))
        s2 = draw(st.integers(0, pairs - s1))
    return (pairs - s1 - s2, s1, s2)


def other_sections(section, interleaved_layout: bool) -> tuple:
    """A different valid split of the same pairs (for the equal-streams invariant), when there is one."""
    pairs = sum(section)
    candidates = [(pairs, 0, 0)]
    if interleaved_layout:
        candidates.append((pairs - pairs_per_stream_at_most(pairs, 1) - pairs_per_stream_at_most(pairs, 2),
                           pairs_per_stream_at_most(pairs, 1), pairs_per_stream_at_most(pairs, 2)))
    else:
        candidates += [(0, pairs, 0), (0, 0, pairs), (pairs // 3, pairs // 3, pairs - 2 * (pairs // 3))]
    for c in candidates:
        if c != tuple(section):
            return c
    return tuple(section)


# ---- transformers' convention -------------------------------------------------------------------------------


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    table_dtype: torch.dtype
    b: int
    hq: int
    hk: int
    s: int
    d: int
    section: tuple  # rotary pairs per stream (temporal, height, width)
    unsqueeze_dim: int
    cos_batch: int
    equal_halves: bool
    q_layout: Layout
    k_layout: Layout
    cos_layout: object  # a Layout of [3, b, s, r], or "expanded" (a [3, 1, s, r] table expanded over the batch)
    rot: int  # r, the tables' width
    explicit_defaults: bool = False  # unsqueeze_dim passed where it holds its default


class HFMRoPE(Convention):
    NAME = "hf-mrope"
    INTERLEAVED_LAYOUT = False  # Qwen3-VL's layout (qwen3vl-mrope) is the subclass's
    SIGNATURE = ("q", "k", "cos", "sin", "mrope_section", "unsqueeze_dim")
    DIFFERENTIABLE = ("q", "k")
    CAPS = {**{k: v for k, v in HF.CAPS.items() if k != "position_ids"},
            "in_place": (False, "may write q's and k's memory with the result and return views of it (Liger's kernel)")}
    OPTIONAL = {"unsqueeze_dim": 1}

    def plans(self, caps):
        lim = dict(b=2, h=3, s=4, dims=(2, 6, 8, 12, 16), odd=(7,)) if small() else \
            dict(b=4, h=32, s=512, dims=(2, 6, 64, 80, 128, 256), odd=(81,))
        partial = caps.get("partial", False)

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            table_dtype = draw(st.sampled_from(domains.table_dtypes(dtype, caps)))
            hq = draw(st.integers(1, lim["h"]))
            hk = draw(st.integers(1, hq)) if caps["gqa"] else hq
            b = draw(st.integers(1, lim["b"]))
            s = draw(domains.lengths((1, 3, 1, 2, lim["s"]), caps.get("empty", False), lim["s"], small()))
            d = draw(st.sampled_from(lim["dims"] + (lim["odd"] if partial else ())))
            rot = draw(st.sampled_from(rotary_widths(d, small()))) if partial and (d % 2 or d > 2 and draw(
                st.booleans())) else d
            strides = caps["strides"]
            cos_layout = draw(st.one_of(layouts(4), st.just("expanded"))) if strides else contiguous(4)
            return Plan(
                draw(seeds()), dtype, table_dtype, b, hq, hk, s, d, draw(sections(rot // 2, self.INTERLEAVED_LAYOUT)),
                draw(st.sampled_from(caps["unsqueeze_dim"])),
                draw(st.sampled_from((1, b))) if caps["cos_batch"] else 1,
                draw(st.booleans()) if caps["elementwise_tables"] else True,
                draw(channel_layouts(4)) if strides else contiguous(4),
                draw(channel_layouts(4)) if strides else contiguous(4),
                cos_layout, rot, domains.explicit_defaults(draw, caps))

        return draw()

    def build(self, p: Plan, arena) -> Case:
        def heads_shape(h):
            return (p.b, h, p.s, p.d) if p.unsqueeze_dim == 1 else (p.b, p.s, h, p.d)

        q = arena.randn(heads_shape(p.hq), p.dtype, p.q_layout)
        k = arena.randn(heads_shape(p.hk), p.dtype, p.k_layout)
        theta = arena.angles((3, p.cos_batch, p.s, p.rot // 2))
        theta = torch.cat([theta, theta if p.equal_halves else arena.angles(theta.shape)], dim=-1)
        tables = []
        for fn in (torch.cos, torch.sin):
            values = fn(theta).to(p.table_dtype)
            if p.cos_layout == "expanded":
                tables.append(arena.place(values[:, :1]).expand(3, p.b, p.s, p.rot))
            else:
                tables.append(arena.place(values, p.cos_layout))
        args = dict(q=q, k=k, cos=tables[0], sin=tables[1], mrope_section=list(p.section),
                    unsqueeze_dim=p.unsqueeze_dim)
        return Case(p, args, 5, arena.buffers)

    def effects(self, case):
        if case.caps.get("in_place"):
            return ("q", "k"), (Returned("q", "q", same=False), Returned("k", "k", same=False))
        return (), (Returned("q"), Returned("k"))

    def out_dtype(self, case):
        p = case.plan
        return p.dtype if case.caps.get("in_place") else torch.promote_types(p.dtype, p.table_dtype)

    def define(self, case, x64):
        p = case.plan
        channel_stream = stream_of_channel(p.section, p.rot, self.INTERLEAVED_LAYOUT, False)
        cos, sin = (select(x64[n], channel_stream).unsqueeze(p.unsqueeze_dim) for n in ("cos", "sin"))
        return {name: Expect(pairing.rotate(x64[name], cos, sin, False), x64[name], p.rot, False, self.out_dtype(case))
                for name in ("q", "k")}

    INVARIANTS = {}



def _mrope_domain() -> dict:
    from .hf import heads_domain, k_domain, tables_domain, unsqueeze_domain

    return {
        "q": heads_domain("q"),
        "k": k_domain(),
        "cos": tables_domain(),
        "sin": tables_domain("sin"),
        "mrope_section": (domains.cls("every stream a section", lambda p, c: all(p.section)),
                          domains.cls("a stream with no pairs", lambda p, c: not all(p.section))),
        "unsqueeze_dim": unsqueeze_domain(),
    }


# ---- invariants (shared with qwen3vl-mrope) -------------------------------------------------------------------


def fresh(case, **changes):
    """The case's arguments as new tensors (q and k cloned: an in-place target writes them), some replaced."""
    args = {n: (v.detach().clone() if n in ("q", "k") else v) for n, v in case.args.items()}
    return dataclasses.replace(case, args={**args, **changes})


def call_pair(case, fn):
    with torch.no_grad():
        out = fresh(case).call(fn)
    assert isinstance(out, (tuple, list)) and len(out) == 2, f"expected (q_embed, k_embed), got {type(out).__name__}"
    return out


def equal_streams(conv, fn, caps, plan):
    """All three tables equal stream 0's: the plain formula (spec/hf.py's) on that table, and any other
    section split gives the same result, bitwise."""
    case = make_case(conv, caps, plan)
    p = case.plan
    cos, sin = (case.args[n][:1].expand_as(case.args[n]).contiguous() for n in ("cos", "sin"))
    base = fresh(case, cos=cos, sin=sin)
    q_out, k_out = call_pair(base, fn)
    other = list(other_sections(p.section, conv.INTERLEAVED_LAYOUT))
    q2, k2 = call_pair(fresh(base, mrope_section=other), fn)
    assert_bitwise(f"equal streams, sections {list(p.section)} vs {other}: q", q2, q_out)
    assert_bitwise(f"equal streams, sections {list(p.section)} vs {other}: k", k2, k_out)
    c64, s64 = (t[0].detach().double().cpu().unsqueeze(p.unsqueeze_dim) for t in (cos, sin))
    model = caps.get("accuracy", "float32")
    for name, got in (("q", q_out), ("k", k_out)):
        x64 = case.args[name].detach().double().cpu()
        assert_within(f"equal streams vs plain RoPE: {name}", got, pairing.rotate(x64, c64, s64, False), x64, p.rot,
                      False, 1, model)


def inverse(conv, fn, caps, plan):
    """The call with sin negated, on the call's result, gives q and k back within three roundings of the
    float64 composition (q and k scaled by cos^2 + sin^2 of the tables as rounded to their dtype)."""
    case = make_case(conv, caps, plan)
    half = case.plan.rot // 2  # a rotation (whose inverse negates sin) where both channels of a pair share an angle
    cos, sin = (torch.cat([case.args[n][..., :half]] * 2, dim=-1) for n in ("cos", "sin"))
    case = fresh(case, cos=cos, sin=sin)
    q_out, k_out = call_pair(case, fn)
    back = fresh(case, q=q_out, k=k_out, sin=-sin)  # a promoted result is float32, as the tables
    q_back, k_back = call_pair(back, fn)
    x64 = inputs64(case)
    there = conv.define(case, x64)
    again = conv.define(back, {**x64, "q": there["q"].value, "k": there["k"].value, "sin": -x64["sin"]})
    for name, got in (("q", q_back), ("k", k_back)):  # the first result's rounding is relative to the pair's scale
        assert_within(f"inverse: {name}", got, again[name].value, x64[name], case.plan.rot, False, 3, "dtype")


def q_k_independent(conv, fn, caps, plan):
    """q's result does not depend on k, nor k's on q: each equal, bitwise, to the call with the other
    replaced by new values (of its shape)."""
    case = make_case(conv, caps, plan)
    q_out, k_out = call_pair(case, fn)
    gen = torch.Generator().manual_seed(plan.seed + 7)
    other = {n: (torch.randn(case.args[n].shape, generator=gen).to(case.args[n].dtype).to(case.args[n].device))
             for n in ("q", "k")}
    assert_bitwise("q independent of k", call_pair(fresh(case, k=other["k"]), fn)[0], q_out)
    assert_bitwise("k independent of q", call_pair(fresh(case, q=other["q"]), fn)[1], k_out)


def unsqueeze_dim_equivalent(conv, fn, caps, plan):
    """unsqueeze_dim 1 on [b, h, s, d] equals unsqueeze_dim 2 on its [b, s, h, d] transpose, bitwise."""
    if set(caps["unsqueeze_dim"]) != {1, 2}:
        return
    case = make_case(conv, caps, plan)
    p = case.plan
    other = 3 - p.unsqueeze_dim
    q_out, k_out = call_pair(case, fn)
    q, k = (case.args[n].transpose(1, 2) for n in ("q", "k"))
    if not caps["strides"]:
        q, k = q.contiguous(), k.contiguous()
    flipped = fresh(case, q=q, k=k, unsqueeze_dim=other)
    q2, k2 = call_pair(flipped, fn)
    assert_bitwise(f"unsqueeze_dim {other} on the transpose: q", q2.transpose(1, 2), q_out)
    assert_bitwise(f"unsqueeze_dim {other} on the transpose: k", k2.transpose(1, 2), k_out)


def relabel_streams(conv, fn, caps, plan):
    """Consecutive sections: the streams permuted together with their sections, q's and k's pairs and the
    tables' channels moved to the new section order, give the result with its pairs moved alike, bitwise."""
    case = make_case(conv, caps, plan)
    p = case.plan
    perm = torch.randperm(3, generator=torch.Generator().manual_seed(plan.seed + 3)).tolist()
    bounds = torch.tensor([0, *torch.tensor(p.section).cumsum(0).tolist()])
    pair_order = torch.cat([torch.arange(bounds[m], bounds[m + 1]) for m in perm])  # new pair j = old pair
    rotated = torch.cat([pair_order, pair_order + p.rot // 2]).to(case.args["q"].device)
    channels = torch.cat([rotated, torch.arange(p.rot, p.d, device=rotated.device)])  # passed-through stay
    q_out, k_out = call_pair(case, fn)
    moved = fresh(case, q=case.args["q"][..., channels], k=case.args["k"][..., channels],
                  cos=case.args["cos"][perm][..., rotated], sin=case.args["sin"][perm][..., rotated],
                  mrope_section=[p.section[m] for m in perm])
    q2, k2 = call_pair(moved, fn)
    assert_bitwise(f"streams relabelled {perm}: q", q2, q_out[..., channels])
    assert_bitwise(f"streams relabelled {perm}: k", k2, k_out[..., channels])


def partial_is_sliced(conv, fn, caps, plan):
    """Partial rotary (tables of width r < d): channels :r of the result are, bitwise, the call on q[..., :r] and
    k[..., :r] with the same tables and sections, and channels r.. are q's and k's as given (in the result's
    dtype), bitwise."""
    case = make_case(conv, caps, plan)
    r = case.plan.rot
    if r == case.plan.d:
        return
    got = call_pair(case, fn)
    sliced = call_pair(fresh(case, q=case.args["q"][..., :r], k=case.args["k"][..., :r]), fn)
    for name, g, w in zip(("q", "k"), got, sliced, strict=True):
        assert_bitwise(f"partial rotary: {name}[..., :{r}] against the call on {name}[..., :{r}]", g[..., :r], w)
        assert_bitwise(f"partial rotary: channels {r}.. of {name}, passed through", g[..., r:],
                       case.args[name][..., r:].to(g.dtype))


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: a sequence's results are the same computed in the whole batch, alone (its own q and
    k, its rows of per-sequence tables [3, b, s, r]) and at another batch index (the batch rolled by one, the tables'
    rows with it), and so are its gradients for q and k from the same random upstream gradients, where the target has
    a backward and returns new tensors (not q and k written in place). A batch of at least two."""
    b = max(plan.b, 2)
    case = make_case(conv, caps, plan._replace(b=b, cos_batch=b if plan.cos_batch > 1 else 1))
    grads = caps.get("backward", True) and not caps.get("in_place")
    per_sequence = [n for n in ("cos", "sin") if case.args[n].shape[1] == b]
    gen = torch.Generator().manual_seed(plan.seed + 3)
    ups = []  # the upstream gradients of q_embed and k_embed, drawn for the whole call's results

    def run(take):
        """(results, gradients of q and k) of one call on take(x, dim) of every per-sequence argument (q, k along
        dim 0, per-sequence tables along dim 1) and of the upstream gradients; q and k new leaves."""
        leaves = {n: take(case.args[n], 0).detach().clone().requires_grad_(grads) for n in ("q", "k")}
        rows = {n: take(case.args[n], 1) for n in per_sequence}
        with torch.set_grad_enabled(grads):
            out = dataclasses.replace(case, args={**case.args, **leaves, **rows}).call(fn)
        assert isinstance(out, (tuple, list)) and len(out) == 2, \
            f"expected (q_embed, k_embed), got {type(out).__name__}"
        if not grads:
            return tuple(o.detach() for o in out), ()
        if not ups:
            ups.extend(torch.randn(tuple(o.shape), generator=gen, dtype=torch.float64).to(o.dtype).to(o.device)
                       for o in out)
        live = [(o, take(u, 0)) for o, u in zip(out, ups, strict=True) if o.numel()]
        if live:
            torch.autograd.backward([o for o, _ in live], [u for _, u in live])
        return (tuple(o.detach() for o in out),
                tuple(leaf.grad if leaf.numel() else torch.zeros_like(leaf) for leaf in leaves.values()))

    whole, whole_grads = run(lambda x, dim: x)
    for i in sorted({0, b - 1, plan.seed % b}):
        alone, alone_grads = run(lambda x, dim, i=i: x.narrow(dim, i, 1).clone())
        for name, a, w in zip(("q", "k"), alone, whole, strict=True):
            assert_bitwise(f"batch invariance: {name} of sequence {i} alone, against in the batch of {b}", a[0], w[i])
        for name, a, w in zip(("q", "k"), alone_grads, whole_grads, strict=True):
            assert_bitwise(f"batch invariance: the gradient of {name} of sequence {i} alone, against in the batch of "
                           f"{b}", a[0], w[i])
    rolled, rolled_grads = run(lambda x, dim: torch.roll(x, 1, dim))
    for name, r, w in zip(("q", "k"), rolled, whole, strict=True):
        assert_bitwise(f"batch invariance: {name} with the batch rolled by one, against the whole call's rolled", r,
                       torch.roll(w, 1, 0))
    for name, r, w in zip(("q", "k"), rolled_grads, whole_grads, strict=True):
        assert_bitwise(f"batch invariance: the gradient of {name} with the batch rolled by one, against the whole "
                       f"call's rolled", r, torch.roll(w, 1, 0))


HFMRoPE.INVARIANTS = {"batch_rows_alone": batch_rows_alone,
                      "equal_streams": equal_streams, "inverse": inverse, "q_k_independent": q_k_independent,
                      "unsqueeze_dim": unsqueeze_dim_equivalent, "relabel_streams": relabel_streams,
                      "partial_is_sliced": partial_is_sliced}

CONVENTION = HFMRoPE()

HFMRoPE.DOMAIN = _mrope_domain()
