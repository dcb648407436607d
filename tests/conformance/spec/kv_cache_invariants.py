"""Invariants of RoPE fused with the KV-cache write, for both forms (spec/vllm_cache.py, spec/sglang_cache.py): a
convention names its arguments in ARGS (q, k, v, key cache, value cache, slots) and reads q, k, v as [T, h, d]
(`heads`); plans carry t, hk, d, rot, is_neox, fp8, scales, n_given, n_padded and n_slots."""
from __future__ import annotations

from dataclasses import replace

import torch

from .. import pairing
from ..compare import assert_bitwise, assert_within
from ..run import make_case
from . import kv_cache_common as kvc


def _call(conv, fn, case) -> dict:
    """Run the call; {q, k: [T, h, d] copies, kc, vc: the caches' bits [n_slots, h, d]}."""
    with torch.no_grad():
        result = case.call(fn)
    assert result is None, f"expected None (everything is written in place), got {type(result).__name__}"
    return _state(conv, case)


def _state(conv, case) -> dict:
    p, a = case.plan, conv.ARGS
    out = {n: conv.heads(case, a[n], case.args[a[n]]).detach().cpu().clone() for n in ("q", "k", "v")}
    for n in ("kc", "vc"):
        out[n] = kvc.cache_bits(case.args[a[n]].reshape(p.n_slots, p.hk, p.d))
    return out


def equals_rope_then_write(conv, fn, caps, plan):
    """q and k within the accuracy model of the float64 rotation of vLLM's convention (the cache's halves as cos and
    sin, the rows at the positions) on the same inputs, and the caches bitwise the index write of the call's own
    results: at each stored token's slot its rotated k (as written back to the live k) and its v, as the cache
    stores them; every other slot as it was."""
    case = make_case(conv, caps, plan)
    a = conv.ARGS
    before = _state(conv, case)
    table, pos = case.args["cos_sin_cache"].detach().cpu(), case.args["positions"].detach().cpu().long()
    half, il = table.shape[1] // 2, not plan.is_neox
    cos, sin = (pairing.per_channel(t[pos], il).unsqueeze(-2) for t in (table[:, :half], table[:, half:]))
    got = _call(conv, fn, case)
    for n in ("q", "k"):
        want = pairing.rotate(before[n], cos, sin, il)
        assert_within(f"{a[n]} against vLLM's rotation in float64", got[n], want, before[n], plan.rot,
                      not plan.is_neox, 1, caps.get("accuracy", "float32"))
    mask, token = kvc.written(case.args[a["slots"]], plan.n_slots)
    cdt = kvc.FP8 if plan.fp8 else got["k"].dtype
    for n, x, scale in (("kc", got["k"], plan.scales[0]), ("vc", got["v"], plan.scales[1])):
        new = kvc.stored(x.double(), scale, plan.fp8).to(cdt)
        new = new[token] if x.shape[0] else new.new_zeros((plan.n_slots, *new.shape[1:]))  # no token: none written
        want = torch.where(mask[:, None, None], kvc.cache_bits(new), before[n])
        assert_bitwise(f"{a[n]}: the index write of the call's {'k' if n == 'kc' else 'v'}", got[n], want)


def unstored_tokens_rotated(conv, fn, caps, plan):
    """Tokens without a slot (-1, or past a short mapping) are rotated as when every token has one: q and k of the
    two calls bitwise equal (the same inputs; the slots drawn last)."""
    if not (caps.get("short_slot_mapping") or caps.get("padded_slots")) or plan.t < 2:
        return
    given = plan.t - 1 if caps.get("short_slot_mapping") else plan.t
    some = plan._replace(n_given=given, n_padded=1 if caps.get("padded_slots") else 0)
    every = plan._replace(n_given=plan.t, n_padded=0)
    a, b = _call(conv, fn, make_case(conv, caps, some)), _call(conv, fn, make_case(conv, caps, every))
    for n in ("q", "k"):
        assert_bitwise(f"{conv.ARGS[n]} of tokens without a slot against with slots", a[n], b[n])


def tokens_permuted(conv, fn, caps, plan):
    """Tokens permuted with their positions and slots: q and k permuted alike, the caches the same, bitwise."""
    plan = plan._replace(n_given=plan.t) if "n_given" in plan._fields else plan
    first, second = make_case(conv, caps, plan), make_case(conv, caps, plan)
    perm = torch.randperm(plan.t, generator=torch.Generator().manual_seed(plan.seed + 3))
    names = [conv.ARGS[n] for n in ("q", "k", "v", "slots")] + ["positions"]
    for n in names:
        second.args[n].copy_(first.args[n][perm.to(first.args[n].device)])
    x, y = _call(conv, fn, first), _call(conv, fn, second)
    for n in ("q", "k"):
        assert_bitwise(f"{conv.ARGS[n]} of permuted tokens", y[n], x[n][perm])
    for n in ("kc", "vc"):
        assert_bitwise(f"{conv.ARGS[n]} after permuted tokens", y[n], x[n])


def batch_rows_alone(conv, fn, caps, plan):
    """Batch invariance, bitwise: each token called alone (its own q, k, v, position and slot) and the tokens rolled
    by one give bitwise the token's results in the whole call: its rotated q and k and what its slot holds (the
    rotated k and the v, as the cache stores them); a token without a slot (-1, or past a short mapping) alone too.
    A call alone writes one slot, so its caches are compared at the token's own slot only; the rolled call writes
    every slot the whole call does, so its caches are compared whole. The tokens with a slot roll among themselves
    and those past a short mapping among themselves, each keeping its slot. q, k and v lie in buffers of their own
    (in their forms); every call writes fresh caches of the plan's layout, as they were before the whole call."""
    p = conv.with_tokens(plan, max(plan.t, 2))
    a = conv.ARGS
    names = (a["q"], a["k"], a["v"], "positions", a["slots"])
    given = {n: x.clone(memory_format=torch.contiguous_format) for n, x in make_case(conv, caps, p).args.items()
             if n in names}

    def call_on(args, t):
        """_call's state after fn on the token tensors `args` (t tokens) and fresh caches."""
        case = make_case(conv, caps, p)
        return _call(conv, fn, replace(case, plan=case.plan._replace(t=t), args={**case.args, **args}))

    whole = call_on({n: x.clone() for n, x in given.items()}, p.t)
    slots = given[a["slots"]].long().cpu()
    t, m = p.t, slots.shape[0]
    unstored = [i for i in range(t) if i >= m or slots[i] < 0]
    for i in sorted({0, t - 1, plan.seed % t, *unstored[:1]}):
        alone = call_on({n: x[i:i + 1].clone() for n, x in given.items()}, 1)  # slots: empty past a short mapping
        for n in ("q", "k"):
            assert_bitwise(f"batch invariance: {a[n]} of token {i} alone, against among {t}", alone[n][0],
                           whole[n][i])
        slot = int(slots[i]) if i < m else -1
        if 0 <= slot < p.n_slots:
            for n in ("kc", "vc"):
                assert_bitwise(f"batch invariance: {a[n]} at slot {slot} written by token {i} alone, against "
                               f"among {t}", alone[n][slot], whole[n][slot])
    perm = torch.cat([torch.roll(torch.arange(m), 1), torch.roll(torch.arange(m, t), 1)])
    rolled_args = {n: x[perm[:x.shape[0]].to(x.device)] for n, x in given.items()}  # slots: the first m of perm
    rolled = call_on(rolled_args, t)
    for n in ("q", "k"):
        assert_bitwise(f"batch invariance: {a[n]} with the tokens rolled by one, against the whole call's rolled",
                       rolled[n], whole[n][perm])
    for n in ("kc", "vc"):
        assert_bitwise(f"batch invariance: {a[n]} after the tokens rolled by one, against after the whole call",
                       rolled[n], whole[n])


INVARIANTS = {"batch_rows_alone": batch_rows_alone, "equals_rope_then_write": equals_rope_then_write,
              "unstored_tokens_rotated": unstored_tokens_rotated, "tokens_permuted": tokens_permuted}
