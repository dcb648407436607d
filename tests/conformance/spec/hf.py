"""transformers' convention (Llama and most decoder models):
    apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1) -> (q_embed, k_embed)
    q_embed = cat(q_rot * cos.unsqueeze(unsqueeze_dim) + rotate_half(q_rot) * sin.unsqueeze(unsqueeze_dim), q_pass)
q [b, hq, s, d] and k [b, hk, s, d] (unsqueeze_dim=1), or [b, s, h, d] (unsqueeze_dim=2); cos, sin [b or 1, s, r],
gathered by position already, in any dtype: the result has torch's promotion of q's and cos's dtypes, as the
expression gives. r = cos.shape[-1] is the rotary width (even, <= d): q_rot = q[..., :r] is rotated with pairs
(i, i + r/2), q_pass = q[..., r:] passes through (GPT-NeoX, Phi, StableLM, Qwen3-Next; r = d in Llama), and d may
then be odd. position_ids is unused (transformers 4.x passed it; 5 dropped it). New tensors; the gradient
flows to q and k.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from .. import pairing
from ..compare import assert_bitwise, assert_undone, assert_within
from ..contract import Returned, Snapshot
from ..run import make_case
from ..tensors import DTYPES, Layout, channel_layouts, contiguous, layouts, seeds
from . import Case, Convention, Expect, domains, small


class Plan(NamedTuple):
    seed: int
    dtype: torch.dtype
    table_dtype: torch.dtype
    b: int
    hq: int
    hk: int
    s: int
    d: int
    unsqueeze_dim: int
    cos_batch: int
    equal_halves: bool
    q_layout: Layout
    k_layout: Layout
    cos_layout: object  # a Layout, or "expanded" (a [1, s, d] table expanded over the batch: stride 0)
    position_ids: bool
    rotary: int  # r, the tables' width
    explicit_defaults: bool = False  # position_ids and unsqueeze_dim passed where they hold their default


def rotary_widths(d: int, small_shapes: bool) -> list:
    """Rotary widths below d to draw: every even one on the CPU; on a device the models' (32, 48, 64: Qwen3-Next,
    Phi-4-mini's 0.75 of 96 = 72, GLM's half) and the smallest."""
    if small_shapes:
        return list(range(2, d, 2))
    return sorted({w for w in (2, 32, 48, 64, d // 4 * 2, 3 * d // 8 * 2) if 2 <= w < d})


class HF(Convention):
    NAME = "hf"
    SIGNATURE = ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim")
    DIFFERENTIABLE = ("q", "k")
    CAPS = {
        "dtypes": (DTYPES, "dtypes of q and k"),
        "float32_tables": (True, "cos/sin in float32 with 16-bit q and k (the result is float32, as promoted)"),
        "gqa": (True, "k with another head count than q"),
        "unsqueeze_dim": ((1, 2), "the layouts: 1 for [b, h, s, d], 2 for [b, s, h, d]"),
        "cos_batch": (True, "cos/sin with a batch of b (one table per sequence), not only 1"),
        "elementwise_tables": (True, "cos/sin whose two halves differ (the formula reads one per channel)"),
        "strides": (True, "views: permuted, sliced and expanded tensors"),
        "position_ids": (True, "accepts the unused position_ids argument"),
        "backward": (True, "gradients for q and k"),
        "accuracy": ("float32", "accuracy model (accuracy.py): float32 math and one rounding, or dtype math"),
        "in_place": (False, "may write q's and k's memory with the result and return views of it (Liger's kernel)"),
        "partial": (True, "cos/sin narrower than the head: rotary width = their width, the rest passed through"),
        "mixed_tables": (True, "cos/sin in the other 16-bit dtype than q and k (float16 with bfloat16, the reverse: "
                               "the result is float32, as promoted), or in a 16-bit dtype with float32 q and k"),
        "empty": (True, "s = 0: empty q, k, cos and sin"),
    }
    OPTIONAL = {"position_ids": None, "unsqueeze_dim": 1}
    INTERLEAVED = False  # the rotary pairs: (i, i + r/2); GLM's convention pairs (2i, 2i + 1)

    def plans(self, caps):
        lim = dict(b=2, h=3, s=5, dims=(2, 4, 6, 8, 12, 16), odd=(5, 9)) if small() else \
            dict(b=4, h=32, s=512, dims=(2, 6, 64, 80, 96, 128, 256), odd=(81,))
        # A subclass with a rotary width of its own (Liger's `rot`) draws even heads only: odd ones need partial rotary.
        own_width = type(self).table_width is HF.table_width
        partial = caps.get("partial", False)

        @st.composite
        def draw(draw):
            dtype = draw(st.sampled_from(caps["dtypes"]))
            # the other 16-bit dtype too (mixed_tables): torch's promotion decides the result's dtype
            table_dtype = draw(st.sampled_from(domains.table_dtypes(dtype, caps)))
            hq = draw(st.integers(1, lim["h"]))
            hk = draw(st.integers(1, hq)) if caps.get("gqa") else hq
            d = draw(st.sampled_from(lim["dims"] + (lim["odd"] if partial and own_width else ())))
            rotary = draw(st.sampled_from(rotary_widths(d, small()))) if partial and (d % 2 or d > 2 and draw(
                st.booleans())) else d
            # decode (s = 1) half the time: the serving case, and the one where PyTorch leaves the sequence dim's
            # stride free (a kernel taking its row stride from it rotates the wrong rows)
            # and s = 0 (an empty batch of tokens) where the target takes it
            b = draw(st.integers(1, lim["b"]))
            s = draw(domains.lengths((1, 3, 1, 2, 1, lim["s"], 1), caps.get("empty", False), lim["s"], small()))
            strides = caps["strides"]
            cos_layout = draw(st.one_of(layouts(3, padded_dims=(1, 2)), st.just("expanded"))) if strides \
                else contiguous(3)
            return Plan(
                draw(seeds()), dtype, table_dtype, b, hq, hk, s, d,
                draw(st.sampled_from(caps["unsqueeze_dim"])),
                draw(st.sampled_from((1, b))) if caps["cos_batch"] else 1,
                draw(st.booleans()) if caps["elementwise_tables"] else True,
                draw(channel_layouts(4)) if strides else contiguous(4),
                draw(channel_layouts(4)) if strides else contiguous(4),
                cos_layout, draw(st.booleans()) if caps.get("position_ids") else False, rotary,
                domains.explicit_defaults(draw, caps))

        return draw()

    def build(self, p: Plan, arena) -> Case:
        q = arena.randn(self.heads_shape(p, p.hq), p.dtype, p.q_layout)
        k = arena.randn(self.heads_shape(p, p.hk), p.dtype, p.k_layout)
        args = dict(q=q, k=k, **self.tables(p, arena))
        if p.position_ids:
            args["position_ids"] = arena.place(torch.arange(p.s).expand(p.b, p.s).clone())
        args["unsqueeze_dim"] = p.unsqueeze_dim
        return Case(p, args, 4, arena.buffers)

    def heads_shape(self, p, h) -> tuple:
        return (p.b, h, p.s, p.d) if p.unsqueeze_dim == 1 else (p.b, p.s, h, p.d)

    def tables(self, p, arena) -> dict:
        """cos and sin [b or 1, s, r] from angles cat(theta, theta) (the halves differ unless p.equal_halves)."""
        width = self.table_width(p)
        theta = arena.angles((p.cos_batch, p.s, width // 2))
        theta = torch.cat([theta, theta if p.equal_halves else arena.angles(theta.shape)], dim=-1)
        tables = []
        for fn in (torch.cos, torch.sin):
            values = fn(theta).to(p.table_dtype)
            if p.cos_layout == "expanded":
                tables.append(arena.place(values[:1]).expand(p.b, p.s, width))
            else:
                tables.append(arena.place(values, p.cos_layout))
        return dict(cos=tables[0], sin=tables[1])

    def table_width(self, p) -> int:
        """The width of cos/sin: the rotary width."""
        return p.rotary

    def effects(self, case):
        if case.caps.get("in_place"):
            return ("q", "k"), (Returned("q", "q", same=False), Returned("k", "k", same=False))
        return (), (Returned("q"), Returned("k"))

    def define(self, case, x64):
        return self.rotate_heads(case, x64, x64["cos"], x64["sin"])

    def rotate_heads(self, case, x64, cos, sin):
        """q and k (or x) rotated by per-channel tables [b or 1, s, r] (r, the rotary width, is the tables' width)."""
        p = case.plan
        out_dtype = torch.promote_types(p.dtype, p.table_dtype)
        if case.caps.get("in_place"):
            out_dtype = p.dtype  # written into q and k
        cos, sin = cos.unsqueeze(p.unsqueeze_dim), sin.unsqueeze(p.unsqueeze_dim)
        rot, il = cos.shape[-1], self.INTERLEAVED
        return {name: Expect(pairing.rotate(x64[name], cos, sin, il), x64[name], rot, il, out_dtype)
                for name in rotated(case)}


# ---------------------------------------------------------------------------------------------- invariants
# Oracle-free properties of transformers' convention, each in its own terms. Every call goes through `call`, which
# passes q and k as copies where the convention writes them, so that one case serves several calls.

def rotated(case) -> list:
    """The rotated arguments: q and k, or x (the one-tensor form)."""
    return [n for n in ("q", "k", "x") if n in case.args]


def refusing(bad_inputs):
    """The invariant `refuses_bad_input` of a convention whose bad calls `bad_inputs(case)` lists: each raises a
    TypeError or ValueError whose message starts with the argument at fault, and leaves every buffer of the case as
    it was (`refuses_each`)."""
    def refuses_bad_input(conv, fn, caps, plan):
        if caps["bad_input"]:
            case = make_case(conv, caps, plan)
            refuses_each(fn, case, bad_inputs(case))
    return refuses_bad_input


def refuses_each(fn, case, bad) -> None:
    """Every bad call of `bad` ((names, overrides): the argument at fault and its aliases, the arguments that replace
    the case's) raises a TypeError or ValueError whose message starts with one of the names, and leaves every
    buffer of the case as it was (nothing written on the way to the error)."""
    for names, over in bad:
        what = ", ".join(f"{k} {tuple(v.shape) if isinstance(v, torch.Tensor) else v!r}" for k, v in over.items())
        snap = Snapshot(case.buffers)
        try:
            with torch.no_grad():
                call(fn, case, **over)
        except (TypeError, ValueError) as e:
            assert str(e).startswith(names), f"bad {names[0]} ({what}): the message does not start with " \
                                             f"{' or '.join(names)}: {e}"
        except Exception as e:  # noqa: BLE001 - any other exception is the wrong kind of error
            raise AssertionError(f"bad {names[0]} ({what}): expected TypeError or ValueError, got "
                                 f"{type(e).__name__}: {e}") from e
        else:
            raise AssertionError(f"bad {names[0]} ({what}): no error raised")
        snap.check_unchanged()


def call(fn, case, **overrides):
    """fn on the case's arguments with `overrides` replacing some; its results as a tuple ((q, k), or (x,))."""
    args = {**case.args, **overrides}
    if case.caps.get("in_place"):
        args = {n: v.clone() if n in ("q", "k", "x") else v for n, v in args.items()}
    out = replace(case, args=args).call(fn)
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def heads_dim(case) -> int:
    return case.plan.unsqueeze_dim


def unsqueeze_dim_transposed(conv, fn, caps, plan):
    """unsqueeze_dim=1 on the [b, h, s, d] view of a [b, s, h, d] tensor equals unsqueeze_dim=2 on the tensor
    itself, bitwise: the flag says where the heads are, not how to compute."""
    if not {1, 2} <= set(caps["unsqueeze_dim"]) or not caps["strides"]:
        return
    case = make_case(conv, caps, plan._replace(unsqueeze_dim=2))
    names = rotated(case)
    want = call(fn, case)
    got = call(fn, case, unsqueeze_dim=1, **{n: case.args[n].transpose(1, 2) for n in names})
    for name, g, w in zip(names, got, want, strict=True):
        assert_bitwise(f"unsqueeze_dim: {name} with 1 on the transposed view, against 2", g.transpose(1, 2), w)


def tables_batch_broadcast(conv, fn, caps, plan):
    """cos/sin with batch 1 equal the same table given for every sequence: expanded to batch b (stride 0) and
    repeated in memory, bitwise."""
    case = make_case(conv, caps, plan._replace(cos_batch=1))
    cos, sin = (case.args[n] if case.args[n].dim() == 3 else case.args[n].unsqueeze(0) for n in ("cos", "sin"))
    cos, sin = cos[:1], sin[:1]
    want = call(fn, case, cos=cos, sin=sin)
    b = plan.b
    variants = []
    if caps["strides"]:
        variants.append(("expanded", cos.expand(b, -1, -1), sin.expand(b, -1, -1)))
    if caps["cos_batch"]:
        variants.append(("repeated", cos.expand(b, -1, -1).contiguous(), sin.expand(b, -1, -1).contiguous()))
    for what, c, s in variants:
        got = call(fn, case, cos=c, sin=s)
        for name, g, w in zip(rotated(case), got, want, strict=True):
            assert_bitwise(f"tables {what} to batch {b}: {name}, against batch 1", g, w)


def other_head_count(plan, caps) -> int:
    """A head count for a second k: another one where GQA is drawn and q has heads enough."""
    others = [h for h in range(1, plan.hq + 1) if h != plan.hk] if caps["gqa"] else []
    return others[plan.seed % len(others)] if others else plan.hk


def q_k_independent(conv, fn, caps, plan):
    """q's result does not depend on k (another k, with another head count where GQA is drawn, leaves it bitwise
    unchanged), and k's result is what the same tensor gives in q's place (within two roundings: q's and k's
    paths may contract their products differently)."""
    case = make_case(conv, caps, plan)
    q1, _ = call(fn, case)
    k = case.args["k"]
    shape = list(k.shape)
    shape[heads_dim(case)] = other_head_count(plan, caps)
    gen = torch.Generator().manual_seed(plan.seed + 2)
    k2 = torch.randn(shape, generator=gen, dtype=torch.float64).to(k.dtype).to(k.device)
    q2, k2_out = call(fn, case, k=k2)
    assert_bitwise("q after k was changed", q2, q1)
    as_q, _ = call(fn, case, q=k2, k=k2)
    assert_within(f"k with {shape[heads_dim(case)]} heads, against the same tensor in q's place", k2_out, as_q, k2,
                  case.args["cos"].shape[-1], conv.INTERLEAVED, 2, caps.get("accuracy", "float32"))


def swap_q_k(conv, fn, caps, plan):
    """fn(k, q) returns fn(q, k)'s results swapped (equal head counts: some kernels need hq >= hk), within two
    roundings of each other: a kernel may evaluate q's and k's products in other orders (fused multiply-adds),
    each within the accuracy model of the same exact value."""
    case = make_case(conv, caps, plan._replace(hk=plan.hq))
    q_in, k_in = case.args["q"].detach().clone(), case.args["k"].detach().clone()
    q1, k1 = call(fn, case)
    q2, k2 = call(fn, case, q=case.args["k"], k=case.args["q"])
    rot = case.args["cos"].shape[-1]
    model = caps.get("accuracy", "float32")
    assert_within("q's result with q and k swapped, against k's", q2, k1, k_in, rot, conv.INTERLEAVED, 2, model)
    assert_within("k's result with q and k swapped, against q's", k2, q1, q_in, rot, conv.INTERLEAVED, 2, model)


def inverse(conv, fn, caps, plan):
    """(cos, -sin) on the result gives back the input, within two roundings and the tables' rounding
    (compare.assert_undone). Equal pair halves only: with elementwise tables the call is no rotation."""
    case = make_case(conv, caps, plan._replace(equal_halves=True))
    names = rotated(case)
    once = call(fn, case)
    twice = call(fn, case, sin=-case.args["sin"], **dict(zip(names, once, strict=True)))
    for name, back in zip(names, twice, strict=True):
        # x0 in the result's dtype (promoted: an exact conversion), so that passed-through channels compare bitwise
        assert_undone(f"inverse: {name}", back, case.args[name].to(back.dtype), case.args["cos"].shape[-1],
                      conv.INTERLEAVED, case.args["cos"].dtype, caps.get("accuracy", "float32"))


def partial_is_sliced(conv, fn, caps, plan):
    """Partial rotary (tables of width r < d): channels :r of the result are the call on q[..., :r] and k[..., :r]
    with the same tables (a whole-head rotation of the slice), within two roundings (the two calls are compiled for
    other shapes and may contract their products in other orders, as q's and k's paths may), and channels r.. are
    q's and k's as given (converted to the result's dtype), bitwise."""
    case = make_case(conv, caps, plan)
    names, r = rotated(case), case.args["cos"].shape[-1]
    if r == case.args[names[0]].shape[-1]:
        return
    got = call(fn, case)
    sliced = call(fn, case, **{n: case.args[n][..., :r] for n in names})
    for name, g, w in zip(names, got, sliced, strict=True):
        assert_within(f"partial rotary: {name}[..., :{r}] against the call on {name}[..., :{r}]", g[..., :r], w,
                      case.args[name][..., :r], r, conv.INTERLEAVED, 2, caps.get("accuracy", "float32"))
        assert_bitwise(f"partial rotary: channels {r}.. of {name}, passed through", g[..., r:],
                       case.args[name][..., r:].to(g.dtype))


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance: a sequence's results are bitwise the same computed in the whole batch, alone (batch 1, its
    own tensors) and at another batch index (the batch rolled by one), and so are its gradients from the same
    upstream gradients, where the convention has a backward (what an RL trainer needs of the rollout engine's
    kernel). A batch of at least two; per-sequence tables go with their sequence."""
    b = max(plan.b, 2)
    case = make_case(conv, caps, plan._replace(b=b, cos_batch=b if plan.cos_batch > 1 else 1))
    names = rotated(case)
    grads = caps.get("backward", True) and not caps.get("in_place")
    gen = torch.Generator().manual_seed(plan.seed + 3)
    ups = None

    def run(args):
        """fn's results on `args` (the case's, some replaced) and, with grads, the gradients of the rotated inputs
        (leaves copied from them) from the upstream gradients given with them (`ups` sliced or rolled alike)."""
        leaves = {n: args[n].detach().clone().requires_grad_(grads) for n in names}
        with torch.set_grad_enabled(grads):
            outs = call(fn, case, **{n: v for n, v in {**args, **leaves}.items() if not n.startswith("_up_")})
        if not grads:
            return outs, ()
        torch.autograd.backward(outs, [args["_up_" + n] for n in names])
        return outs, tuple(leaves[n].grad for n in names)

    per_sequence = [n for n in ("cos", "sin", "position_ids") if isinstance(case.args.get(n), torch.Tensor)
                    and case.args[n].dim() >= 2 + (n != "position_ids") and case.args[n].shape[0] == b]
    whole = {n: case.args[n] for n in names + per_sequence}
    if grads:
        outs = call(fn, case)
        ups = {"_up_" + n: torch.randn(tuple(o.shape), generator=gen, dtype=torch.float64).to(o.dtype).to(o.device)
               for n, o in zip(names, outs, strict=True)}
    ups = ups or {}
    want, want_grads = run({**whole, **ups})
    rolled = {n: torch.roll(x, 1, 0) for n, x in {**whole, **ups}.items()}
    got_rolled, grads_rolled = run(rolled)
    for i in sorted({0, b - 1, plan.seed % b}):
        alone, alone_grads = run({n: x[i:i + 1].clone() for n, x in {**whole, **ups}.items()})
        j = (i + 1) % b
        for name, w, a, r in zip(names, want, alone, got_rolled, strict=True):
            assert_bitwise(f"batch invariance: {name} of sequence {i} alone, against in the batch of {b}", a[0], w[i])
            assert_bitwise(f"batch invariance: {name} of sequence {i} at index {j}, against at {i}", r[j], w[i])
        for name, w, a, r in zip(names, want_grads, alone_grads, grads_rolled, strict=True) if grads else ():
            assert_bitwise(f"batch invariance: the gradient of {name} of sequence {i} alone, against in the batch "
                           f"of {b}", a[0], w[i])
            assert_bitwise(f"batch invariance: the gradient of {name} of sequence {i} at index {j}, against at {i}",
                           r[j], w[i])


def _rotate_half(x):
    """transformers' rotate_half: the halves (x1, x2) as (-x2, x1)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _expression(x, cos, sin, math, partner=_rotate_half):
    """transformers' `apply_rotary_pos_emb` on one tensor, partial rotary sliced and concatenated as GPT-NeoX's form
    writes it: with `math` None in the input dtypes, each operation rounded to torch's promotion of its operands (as
    eager PyTorch runs the expression); else in `math`, rounded once to the promotion of x's and cos's dtypes.
    `partner`: the form's rotate_half (GLM's pairs its channels interleaved)."""
    r = cos.shape[-1]
    out = torch.promote_types(x.dtype, cos.dtype)
    x_rot, x_pass = x[..., :r], x[..., r:]
    if math is not None:
        x_rot, cos, sin = x_rot.to(math), cos.to(math), sin.to(math)
    embed = (x_rot * cos) + (partner(x_rot) * sin)
    return torch.cat([embed.to(out), x_pass.to(out)], dim=-1)


def schedule_of(math, tables=lambda tab: tab, partner=_rotate_half):
    """The schedule (`math` as `_expression`) of a form whose unsqueezed cos/sin it reads as `tables` gives them."""
    def schedule(case):
        p = case.plan
        cos, sin = (tables(case.args[n].unsqueeze(p.unsqueeze_dim)) for n in ("cos", "sin"))
        with torch.no_grad():
            return {n: _expression(case.args[n], cos, sin, math, partner) for n in rotated(case)}
    return schedule


# --rope-schedule: `eager`, the expression as transformers' models run it; `float32`, float32 math and one rounding
# (each product and the sum rounded to float32 in turn: PyTorch's operations, not a fused multiply-add)
SCHEDULES = {"eager": schedule_of(None), "float32": schedule_of(torch.float32)}
HF.SCHEDULES = SCHEDULES


INVARIANTS = {
    "unsqueeze_transposed": unsqueeze_dim_transposed,
    "batch_rows_alone": batch_rows_alone,
    "tables_batch_broadcast": tables_batch_broadcast,
    "q_k_independent": q_k_independent,
    "swap_q_k": swap_q_k,
    "inverse": inverse,
    "partial_is_sliced": partial_is_sliced,
}
HF.INVARIANTS = INVARIANTS


def heads_domain(x: str) -> tuple:
    """q's (or x's) classes: its dtype, its sequence length, its layout (its channels too may be strided: the
    expression takes any tensor)."""
    return (*domains.dtypes(lambda p: p.dtype),
            *domains.sizes(lambda p: p.s, "empty", "s"),
            *domains.layouts(x), domains.spaced(x))


def tables_domain(arg: str = "cos") -> tuple:
    """cos's (and sin's) classes: the dtype pairing with q, the layout, the batch, the width, the halves."""
    def pair(p):
        return p.dtype, p.table_dtype

    return (*domains.pairings(pair),
            domains.table_16bit_float32_input(pair, "mixed_tables"),
            *domains.layouts(arg, expanded=True),
            domains.cls("batch 1", lambda p, c: p.cos_batch == 1),
            domains.cls("batch b > 1", lambda p, c: p.cos_batch > 1, "cos_batch"),
            domains.cls("whole head", lambda p, c: c.args["cos"].shape[-1] == p.d),
            domains.cls("narrower than the head", lambda p, c: c.args["cos"].shape[-1] < p.d, "partial"),
            domains.cls("halves equal", lambda p, c: p.equal_halves),
            domains.cls("halves differ", lambda p, c: not p.equal_halves, "elementwise_tables"))


def unsqueeze_domain() -> tuple:
    return domains.optional("unsqueeze_dim", "2", other_off=lambda caps: 2 not in caps["unsqueeze_dim"])


def k_domain() -> tuple:
    return (*domains.layouts("k"), domains.spaced("k"),
            domains.cls("as many heads as q", lambda p, c: p.hk == p.hq),
            domains.cls("fewer heads than q (GQA)", lambda p, c: p.hk < p.hq, "gqa"))


HF.DOMAIN = {
    "q": heads_domain("q"),
    "k": k_domain(),
    "cos": tables_domain(),
    "sin": tables_domain("sin"),
    "position_ids": domains.optional("position_ids", "a tensor", cap="position_ids"),
    "unsqueeze_dim": unsqueeze_domain(),
}

CONVENTION = HF()
