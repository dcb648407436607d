"""Bad input (docs/contract.md section 5) to rope's TransformerEngine-convention call: every rule of sections 2-3,
violated on an otherwise valid drawn call, raises ValueError or TypeError whose message names the argument at
fault, before anything is allocated or launched, and writes nothing; and one verdict on the kernel path and the
CPU reference path.

Each rule takes a valid call and breaks one thing; the rules run as one parametrized property test.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from .cases import DEVICE
from .cases import reference_path as on_path  # the tests' parameter is named reference_path
from .strategies import LIMITS, build, cu_seqlens_of, rope_specs

OTHER_DEVICE = "cpu" if DEVICE != "cpu" else "meta"  # `meta` holds no data: any read of it fails too


class Call(NamedTuple):
    t: object
    freqs: object
    kwargs: dict


def valid_call(case) -> Call:
    return Call(case.t, case.freqs, case.kwargs())


class Rule(NamedTuple):
    name: str
    names: tuple  # the message must name one of these arguments
    specs: object  # strategy of valid specs the rule applies to
    breaks: Callable  # (case, call) -> the call with one thing broken


def _kw(call, **changes):
    kw = dict(call.kwargs)
    for k, v in changes.items():
        if v is None:
            kw.pop(k, None)
        else:
            kw[k] = v
    return kw


def _shorter_freqs(case, call):
    top = case.spec.max_position()
    return call._replace(freqs=case.freqs[:top])  # row `top` is needed: one row short


def _start_past_freqs(case, call):
    spare = case.freqs.shape[0] - case.spec.max_position()  # rows left after the last position
    # every start at max_start + spare: the longest sequence now reaches row s2, one past the end
    sp = torch.full_like(case.start_positions, case.spec.max_start + spare)
    return call._replace(kwargs=_kw(call, start_positions=sp))


def _decreasing_cu(case, call):
    total = int(case.cu_seqlens[-1])
    cu = torch.tensor([0, total + 1, total], dtype=case.cu_seqlens.dtype, device=case.cu_seqlens.device)
    return call._replace(kwargs=_kw(call, cu_seqlens=cu, start_positions=None))


def _indivisible_cu(case, call):
    total = int(case.cu_seqlens[-1])
    cu = torch.tensor([0, 1, total], dtype=case.cu_seqlens.dtype, device=case.cu_seqlens.device)
    start = None if case.start_positions is None else case.start_positions.new_zeros(2)  # one per sequence
    return call._replace(kwargs=_kw(call, cu_seqlens=cu, start_positions=start))


def _negative_start(case, call):
    sp = case.start_positions.clone()
    first = [q for q, n in enumerate(case.spec.local_lengths) if n > 0][0]
    sp[first] = -1
    return call._replace(kwargs=_kw(call, start_positions=sp))


def _odd_local_length(case, call):
    dim = 0 if case.spec.tensor_format == "sbhd" else 1
    return call._replace(t=case.t.narrow(dim, 0, case.spec.s - 1))


def _wider_freqs(case, call):
    d = case.spec.d
    d2 = d + 1 if d % 2 else d + 2  # the smallest even width past d
    return call._replace(freqs=torch.zeros(case.freqs.shape[0], 1, 1, d2, device=case.freqs.device))


def _bump_last(cu, by):
    cu = cu.clone()
    cu[-1] += by
    return cu


def _one_more(sp):
    return torch.cat([sp, torch.zeros(1, dtype=sp.dtype, device=sp.device)])


def _has_tokens(spec):
    return spec.max_position() >= 0


def specs(**kw):
    """Valid calls to break: argument checks do not depend on size, so small ones in every profile."""
    return rope_specs(lim=LIMITS["cpu-interp"], **kw)


_any = specs()
_thd = specs(formats=("thd",))
_dense = specs(formats=("sbhd", "bshd"))

RULES = [
    Rule("t is not a tensor", ("t",), _any, lambda c, k: k._replace(t=torch.zeros(2, 2, 2, 2).tolist())),
    Rule("t has an integer dtype", ("t",), _any, lambda c, k: k._replace(t=c.t.to(torch.int32))),
    Rule("freqs is not a tensor", ("freqs",), _any, lambda c, k: k._replace(freqs=c.freqs.tolist())),
    Rule("freqs has an integer dtype", ("freqs",), _any, lambda c, k: k._replace(freqs=c.freqs.to(torch.int64))),
    Rule("unknown tensor_format", ("tensor_format",), _any,
         lambda c, k: k._replace(kwargs=_kw(k, tensor_format={"sbhd": "sbdh", "bshd": "BSHD", "thd": "tdh"}[
             c.spec.tensor_format]))),
    Rule("t of the wrong rank (3-D for sbhd/bshd)", ("t",), _dense,
         lambda c, k: k._replace(t=c.t.flatten(0, 1))),
    Rule("t of the wrong rank (4-D for thd)", ("t",), _thd, lambda c, k: k._replace(t=c.t.unsqueeze(1))),
    Rule("freqs of the wrong rank", ("freqs",), _any, lambda c, k: k._replace(freqs=c.freqs[:, 0])),
    Rule("freqs not [s2, 1, 1, d2]", ("freqs",), _any,
         lambda c, k: k._replace(freqs=c.freqs.expand(-1, 2, 1, -1))),
    Rule("odd rotary width d2", ("freqs",), _any, lambda c, k: k._replace(freqs=c.freqs[..., :-1])),
    Rule("rotary width d2 = 0", ("freqs",), _any, lambda c, k: k._replace(freqs=c.freqs[..., :0])),
    Rule("rotary width d2 > d", ("freqs",), _any, _wider_freqs),
    Rule("freqs too short", ("freqs",), specs(start=False).filter(_has_tokens), _shorter_freqs),
    Rule("start_positions past the end of freqs", ("freqs", "start_positions"),
         specs(start=True).filter(_has_tokens), _start_past_freqs),
    Rule("freqs on another device", ("freqs",), _any, lambda c, k: k._replace(freqs=c.freqs.to(OTHER_DEVICE))),
    Rule("start_positions on another device", ("start_positions",), specs(start=True),
         lambda c, k: k._replace(kwargs=_kw(k, start_positions=c.start_positions.to(OTHER_DEVICE)))),
    Rule("cu_seqlens on another device", ("cu_seqlens",), _thd,
         lambda c, k: k._replace(kwargs=_kw(k, cu_seqlens=c.cu_seqlens.to(OTHER_DEVICE)))),
    Rule("cu_seqlens missing for thd", ("cu_seqlens",), _thd,
         lambda c, k: k._replace(kwargs=_kw(k, cu_seqlens=None))),
    Rule("cu_seqlens given for sbhd/bshd", ("cu_seqlens",), _dense,
         lambda c, k: k._replace(kwargs=_kw(k, cu_seqlens=cu_seqlens_of([c.spec.s * c.spec.cp_size])))),
    Rule("cu_seqlens not starting at 0", ("cu_seqlens",), _thd,
         lambda c, k: k._replace(kwargs=_kw(k, cu_seqlens=c.cu_seqlens + 2 * c.spec.cp_size))),
    Rule("cu_seqlens decreasing", ("cu_seqlens",), _thd, _decreasing_cu),
    Rule("cu_seqlens total != tokens * cp_size", ("cu_seqlens",), _thd,
         lambda c, k: k._replace(kwargs=_kw(k, cu_seqlens=_bump_last(c.cu_seqlens, 2 * c.spec.cp_size)))),
    Rule("cu_seqlens of a float dtype", ("cu_seqlens",), _thd,
         lambda c, k: k._replace(kwargs=_kw(k, cu_seqlens=c.cu_seqlens.float()))),
    Rule("cu_seqlens not 1-D", ("cu_seqlens",), _thd,
         lambda c, k: k._replace(kwargs=_kw(k, cu_seqlens=c.cu_seqlens[None]))),
    Rule("cu_seqlens lengths not multiples of 2 * cp_size", ("cu_seqlens",),
         specs(formats=("thd",), cp=True).filter(_has_tokens), _indivisible_cu),
    Rule("cp_rank >= cp_size", ("cp_rank",), _any,
         lambda c, k: k._replace(kwargs=_kw(k, cp_size=c.spec.cp_size, cp_rank=c.spec.cp_size))),
    Rule("cp_rank < 0", ("cp_rank",), _any,
         lambda c, k: k._replace(kwargs=_kw(k, cp_size=c.spec.cp_size, cp_rank=-1))),
    Rule("cp_size < 1", ("cp_size",), specs(cp=False),
         lambda c, k: k._replace(kwargs=_kw(k, cp_size=0, cp_rank=0))),
    Rule("odd local sequence length with cp_size > 1", ("t", "cp_size"), specs(formats=("sbhd", "bshd"), cp=True),
         _odd_local_length),
    Rule("start_positions of the wrong length", ("start_positions",), specs(start=True),
         lambda c, k: k._replace(kwargs=_kw(k, start_positions=_one_more(c.start_positions)))),
    Rule("start_positions of a float dtype", ("start_positions",), specs(start=True),
         lambda c, k: k._replace(kwargs=_kw(k, start_positions=c.start_positions.float()))),
    Rule("start_positions negative", ("start_positions",), specs(start=True).filter(_has_tokens),
         _negative_start),
]
RULES_BY_NAME = {r.name: r for r in RULES}


def _names(name, msg):
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", msg) is not None


def check_rejects(rule: Rule, impl, spec):
    case = build(spec)
    call = rule.breaks(case, valid_call(case))
    before = case.t_base.clone()
    try:
        impl(call.t, call.freqs, **call.kwargs)
    except (ValueError, TypeError) as e:
        msg = str(e)
        assert any(_names(n, msg) for n in rule.names), (
            f"{rule.name}: the message does not name {' or '.join(rule.names)}: {type(e).__name__}: {msg}")
    except Exception as e:  # noqa: BLE001 - any other failure is a wrong kind of error
        raise AssertionError(f"{rule.name}: expected ValueError or TypeError, got {type(e).__name__}: {e}") from e
    else:
        raise AssertionError(f"{rule.name}: no error raised")
    assert torch.equal(case.t_base, before), f"{rule.name}: t was written before the error"


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
@given(data=st.data())
def test_bad_input_allocates_and_launches_nothing(rule, data):
    """The checks come before the output is allocated, so before any launch: the launcher's
    allocator (the hook tests/rope/cases.py poisons) raises here if it is reached."""
    import rope
    import rope._launch

    def no_alloc(*args, **kwargs):
        raise AssertionError("an output was allocated for a launch on bad input")

    with mock.patch.object(rope._launch, "empty", no_alloc):
        check_rejects(rule, rope.apply_rotary_pos_emb, data.draw(rule.specs, label="valid spec before breaking it"))


# ---- one verdict on the kernel path and the CPU reference path (docs/contract.md sections 1 and 5) -------

@pytest.mark.parametrize("reference_path", [False, True], ids=["kernel", "reference"])
@pytest.mark.parametrize("flag,value", [("fused", "no"), ("fused", 1), ("inplace", "no"), ("inplace", None),
                                        ("inplace", 0)])
def test_flags_are_bools(flag, value, reference_path):
    """A flag is a bool, as `interleaved` is: "no" is not read as true (which rotated t in place, or ran the
    kernel), on any path; t keeps its values."""
    import rope

    t = torch.randn(4, 2, 2, 8, device=DEVICE)
    before = t.clone()
    freqs = rope.RotaryPositionEmbedding(8, device=DEVICE)(4)
    with on_path(reference_path), pytest.raises(TypeError, match=rf"^{flag}: expected a bool"):
        rope.apply_rotary_pos_emb(t, freqs, **{flag: value})
    if flag == "inplace":
        with on_path(reference_path), pytest.raises(TypeError, match=rf"^{flag}: expected a bool"):
            rope.apply_rotary_pos_emb_qk(t, t.clone(), freqs, **{flag: value})
    assert torch.equal(t, before)


@pytest.mark.parametrize("reference_path", [False, True], ids=["kernel", "reference"])
def test_float64_with_fused_is_refused_on_every_path(reference_path):
    """float64 `t` runs with fused=False only (the reference): fused=True refuses it on a CPU too, so code
    whose CPU tests pass does not fail on the GPU."""
    import rope

    t = torch.randn(4, 2, 2, 8, device=DEVICE, dtype=torch.float64)
    freqs = rope.RotaryPositionEmbedding(8, device=DEVICE)(4)
    with on_path(reference_path):
        for call in (lambda: rope.apply_rotary_pos_emb(t, freqs), lambda: rope.apply_rotary_pos_emb_qk(t, t, freqs)):
            with pytest.raises(TypeError, match=r"^[tq]: expected dtype float32, float16 or bfloat16 \(float64"):
                call()
        assert rope.apply_rotary_pos_emb(t, freqs, fused=False).dtype == torch.float64


@pytest.mark.parametrize("tensor_format", ["sbhd", "thd"])
@pytest.mark.parametrize("starts", [[5, 0], [-1, 0], [-3, 9]], ids=["past", "negative", "both"])
def test_value_checks_off_give_nan_rows_on_every_path(tensor_format, starts):
    """With set_value_checks(False), a token whose position lies outside freqs gets NaN in its rotated
    channels and keeps its pass-through ones, on the kernel path and on the reference path alike (which
    raised IndexError past the table, and read rows from its end for a negative start)."""
    import rope

    gen = torch.Generator().manual_seed(3)
    freqs = (torch.rand(8, 1, 1, 6, generator=gen) * 6).to(DEVICE)
    if tensor_format == "thd":
        t = torch.randn(6, 2, 8, generator=gen).to(DEVICE)
        kw = dict(tensor_format="thd", cu_seqlens=torch.tensor([0, 4, 6], dtype=torch.int32, device=DEVICE))
    else:
        t, kw = torch.randn(4, 2, 2, 8, generator=gen).to(DEVICE), {}
    kw["start_positions"] = torch.tensor(starts, device=DEVICE)
    rope.set_value_checks(False)
    try:
        outs = [rope.apply_rotary_pos_emb(t, freqs, **kw, fused=fused) for fused in (True, False)]
        cache = rope.RoPECache.from_freqs(freqs)
        outs += [rope.apply_rotary_pos_emb(t, cache, **kw, fused=fused) for fused in (True, False)]
    finally:
        rope.set_value_checks(True)
    assert outs[0].isnan().any() and not outs[0][..., 6:].isnan().any()
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], equal_nan=True)
