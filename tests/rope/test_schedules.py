"""rope's schedules (`schedule=`, docs/contract.md "Schedules"): with "eager" the forward of transformers' and vLLM's
calls is bitwise the convention's PyTorch expression run eagerly, with "float32" bitwise its float32 operations; the
default (None) is the float32 schedule too (no plan fuses a multiply-add, on any device), and not the eager one where
16-bit outputs tell them apart. The verdicts are the suite's own (`run.schedule`, the
schedules of spec/hf.py and spec/vllm.py, written from the conventions' definitions) on the suite's drawn cases:
strided views, per-sequence tables, GQA, partial rotary, every dtype pairing the convention allows.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import rope

from ..conformance import run, spec
from ..conformance.draws import no_local_constants
from ..conformance.registry import resolve
from .cases import DEVICE

CONVENTIONS = ("hf", "hf-single", "hf-glm", "vllm")
SCHEDULES = ("eager", "float32")
# (registry target, the schedule it is held to): each named schedule, and the default held to float32's
TARGETS = (("rope-eager", "eager"), ("rope-float32", "float32"), ("rope", "float32"))
# the CPU interpreter runs each drawn case through the kernel once; the gpu profile's own count applies on a device
MAX_EXAMPLES = 15 if DEVICE == "cpu" else 60


@pytest.mark.parametrize("impl,schedule", TARGETS, ids=[t for t, _ in TARGETS])
@pytest.mark.parametrize("name", CONVENTIONS)
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_schedule_is_bitwise(name, impl, schedule, data):
    target = resolve(impl)
    conv = spec.load(name)
    caps = conv.caps(target.caps[name])
    run.schedule(conv, target.fns[name], caps, data.draw(conv.plans(caps), label="plan"), schedule)


@pytest.mark.parametrize("impl,passes", [("rope", False), ("rope-eager", True)], ids=["default", "eager"])
@pytest.mark.parametrize("name", CONVENTIONS)
def test_eager_verdict_on_16bit_draws(name, impl, passes):
    """On 16-bit draws, where the eager expression's roundings differ from float32 math's: rope's default fails the
    eager verdict on some draw (the verdict can fail, and the report names the schedule), and `schedule="eager"`
    passes it on every one (on the other draws both schedules agree, so a call that ignored `schedule` could pass
    test_schedule_is_bitwise's few CPU examples)."""
    target = resolve(impl)
    conv = spec.load(name)
    # 16-bit q and k (transformers' forms: with tables of their dtype; tables of another dtype widen the result to
    # float32, where both are the reference's float32 operations)
    narrow = {"dtypes": (torch.bfloat16, torch.float16), "empty": False}
    if name != "vllm":
        narrow.update(float32_tables=False, mixed_tables=False)
    caps = conv.caps({**target.caps[name], **narrow})
    failures = []

    @settings(max_examples=40, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def probe(data):
        try:
            run.schedule(conv, target.fns[name], caps, data.draw(conv.plans(caps)), "eager")
        except AssertionError as e:
            failures.append(e)

    with no_local_constants():
        probe()
    if passes:
        assert not failures, f"{impl} {name} fails the eager schedule: {failures[0]}"
    else:
        assert failures, f"rope's default {name} passed the eager schedule on every draw"
        assert "schedule eager" in str(failures[0])


def _hf_args(dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 16, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
    k = torch.randn(2, 5, 2, 16, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
    angles = torch.rand(2, 5, 8, generator=gen) * 40
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype).to(DEVICE) for f in (torch.cos, torch.sin))
    return q, k, cos, sin


@pytest.mark.parametrize("schedule", ["fast", "EAGER", 1, True, torch.float32])
def test_unknown_schedule_is_refused(schedule):
    """A schedule that is not None, "eager" or "float32" is a ValueError naming `schedule`, before anything runs or
    is written (vLLM's call writes query and key in place)."""
    q, k, cos, sin = _hf_args()
    with pytest.raises(ValueError, match="^schedule:"):
        rope.hf.apply_rotary_pos_emb(q, k, cos, sin, schedule=schedule)
    with pytest.raises(ValueError, match="^schedule:"):
        rope.hf.apply_rotary_pos_emb_single(q, cos, sin, schedule=schedule)
    query, key = q.transpose(1, 2).reshape(10, 64).clone(), k.transpose(1, 2).reshape(10, 32).clone()
    before = (query.clone(), key.clone())
    cache = torch.rand(16, 16, device=DEVICE)
    positions = torch.arange(10, device=DEVICE)
    with pytest.raises(ValueError, match="^schedule:"):
        rope.vllm.rotary_embedding(positions, query, key, 16, cache, True, schedule=schedule)
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_backward_is_the_default(schedule, dtype):
    """A schedule names the forward's rounding; the gradients are the default's, bitwise."""
    grads = []
    for sched in (None, schedule):
        q, k, cos, sin = _hf_args(dtype)
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        qo, ko = rope.hf.apply_rotary_pos_emb(q, k, cos, sin, schedule=sched)
        gen = torch.Generator().manual_seed(1)
        (qo * torch.randn(qo.shape, generator=gen).to(qo)).sum().backward()
        (ko * torch.randn(ko.shape, generator=gen).to(ko)).sum().backward()
        grads.append((q.grad, k.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_compiled_keeps_the_schedule(schedule):
    """Traced code (torch.compile, fullgraph) gives the schedule's result bitwise, which differs from the default's on
    this bfloat16 case (the custom op carries the schedule with the convention's flags)."""
    q, k, cos, sin = _hf_args()

    def f(q, k):
        return rope.hf.apply_rotary_pos_emb(q, k, cos, sin, schedule=schedule)

    torch._dynamo.reset()
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k)
    want = f(q, k)
    default = rope.hf.apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    if schedule == "eager":
        assert not all(torch.equal(w, d) for w, d in zip(want, default, strict=True))
