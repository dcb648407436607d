"""The generic checks, one call each: what test_native.py runs per drawn plan, and test_zoo.py on planted bugs.

forward(conv, fn, caps, plan): the call's outputs (returned, and written in place) within the accuracy model of
    the float64 definition; the promised objects returned; nothing else written (contract.py).
backward(conv, fn, caps, plan): the differentiable arguments given as views of tensors that require grad (as
    a projection's q and k are), or as leaves that require grad where the convention says so (conv.leaf_args: then
    the call must accept them, and its outputs are checked as the forward's too), random upstream gradients on every
    output, contiguous, strided views or expanded (stride 0), as drawn (`upstream`, then conv.upstream where the
    convention's plans draw layouts of their own); each gradient within the accuracy model of the float64
    definition's vector-Jacobian product; the upstream gradients left as they were.
inverse(conv, fn, caps, plan): the convention's own call with the angles negated undoes the first (oracle-free).
schedule(conv, fn, caps, plan, name): the outputs bitwise equal to a named PyTorch schedule of the convention
    (`--rope-schedule`).
determinism(conv, fn, caps, plan, upstream): two identical calls, each on inputs built alike from the plan's seed,
    give bitwise the same outputs (returned and written in place) and, where the convention has a backward, the same
    gradients from the same upstream gradients (oracle-free).
"""
from __future__ import annotations

import torch

from . import accuracy, pairing
from .compare import assert_bitwise
from .contract import Returned, Snapshot, bits, check_returned
from .spec.domains import lay_out_upstream, settle_defaults
from .tensors import Arena


def make_case(conv, caps, plan, device=None):
    arena = Arena(plan.seed) if device is None else Arena(plan.seed, device)
    case = conv.build(plan, arena)
    case.caps = caps
    return settle_defaults(conv, case)


def inputs64(case, grad=()):
    """Every floating tensor argument as float64 (as given: already rounded to its dtype), on the CPU; those
    named in `grad` as leaves that require grad. Integer tensors (positions, offsets) as int64, on the CPU."""
    out = {}
    for name, v in case.args.items():
        if isinstance(v, torch.Tensor):
            w = v.detach().cpu()
            w = w.double() if w.is_floating_point() else w.long()
            out[name] = w.clone().requires_grad_(name in grad)
    return out


def outputs(conv, case, result, x64=None):
    """{output name: tensor} from what the call returned and what it wrote, after the side-effect checks on
    the returned objects. An argument that may be written (Returned(same=False)) and was holds the result, bitwise
    (x64: the arguments as they were, to tell)."""
    writes, promise = conv.effects(case)
    got = check_returned(result, promise, case.args, case.buffers)
    may = [r for r in ((promise,) if isinstance(promise, Returned) else promise or ()) if r and r.arg and not r.same]
    for r in may if x64 is not None else ():
        arg = case.args[r.arg]
        if not torch.equal(arg.detach().cpu().double(), x64[r.arg].detach()):
            assert torch.equal(bits(arg), bits(got[r.name])), \
                f"side effect: {r.arg} was written, but not with the result {r.name} returned"
    for name in writes:
        if name not in got and case.args.get(name) is not None:
            got[name] = case.args[name]
    return got, [case.args[n] for n in writes if case.args.get(n) is not None]


def compare(conv, case, expect: dict, got: dict, what: str):
    model = case.caps.get("accuracy", "float32")
    for name, e in expect.items():
        assert name in got, f"{what}: no output {name!r}"
        value = conv.read(case, name, got[name])
        copied = pairing.copied_mask(e.value.shape[-1], e.rot)
        scale = pairing.pair_scale(e.source, e.rot, e.interleaved)
        accuracy.check(f"{what} {name}", value, e.value, scale, e.dtype, model, copied)


def forward(conv, fn, caps, plan):
    case = make_case(conv, caps, plan)
    x64 = inputs64(case)
    snap = Snapshot(case.buffers)
    with torch.no_grad():
        result = case.call(fn)
    got, written = outputs(conv, case, result, x64)
    snap.check_unchanged(written)
    compare(conv, case, conv.define(case, x64), got, "forward:")


def backward(conv, fn, caps, plan, upstream: str = "contiguous"):
    case = make_case(conv, caps, conv.backward_plan(plan, caps))
    names = [n for n in conv.DIFFERENTIABLE if case.args.get(n) is not None]
    x64 = inputs64(case, grad=names)
    leaves, own = {}, conv.leaf_args(case)
    for n in names:  # the argument stays a view in its layout, now of a tensor in the graph, or is the leaf itself
        if n in own:
            leaves[n] = case.args[n].requires_grad_()
            continue
        leaves[n] = case.args[n].detach().clone().requires_grad_()
        case.args[n].copy_(leaves[n])
    try:
        result = case.call(fn)
    except (TypeError, ValueError, RuntimeError) as e:
        if not own:
            raise
        raise AssertionError(f"backward: the call refused {', '.join(own)} as a leaf that requires grad: "
                             f"{type(e).__name__}: {e}") from e
    got, _ = outputs(conv, case, result)
    expect = conv.define(case, x64)
    if own:  # what a leaf's call wrote and returned, as the forward property checks it without autograd
        compare(conv, case, expect, got, "backward (the forward on a leaf):")
    gen = torch.Generator().manual_seed(plan.seed + 1)
    ups = {n: conv.upstream(case, n, lay_out_upstream(torch.randn(tuple(got[n].shape), generator=gen,
                                                                  dtype=torch.float64).to(got[n].dtype)
                                                      .to(got[n].device), upstream)) for n in expect}
    snap = Snapshot([u if u.is_contiguous() else u._base if u._base is not None else u for u in ups.values()])
    for n in expect:
        assert got[n].requires_grad, f"backward: output {n} is outside the autograd graph"
    try:
        torch.autograd.backward([got[n] for n in expect], [ups[n] for n in expect])
    except (TypeError, ValueError, RuntimeError) as e:
        if upstream == "contiguous":
            raise
        raise AssertionError(f"backward: the call's backward refused {upstream} upstream gradients (declare "
                             f"{upstream}_grads=false if it cannot take them): {type(e).__name__}: {e}") from e
    snap.check_unchanged()
    up64 = {n: conv.read(case, n, ups[n]).detach().cpu().double() for n in expect}
    grads = torch.autograd.grad([expect[n].value for n in expect], [x64[n] for n in names],
                                [up64[n] for n in expect], allow_unused=True)
    for n, ref in zip(names, grads, strict=True):
        g = leaves[n].grad
        assert g is not None, f"backward: no gradient for {n}"
        ref = torch.zeros_like(x64[n]) if ref is None else ref
        scale, copied = conv.grad_scale(case, n, up64, expect)
        accuracy.check(f"backward: grad of {n}", g, ref, scale.reshape(ref.shape), case.args[n].dtype,
                       case.caps.get("accuracy", "float32"), copied)


def _one_call(conv, fn, caps, plan, upstream) -> dict:
    """{what: bits} of one call of fn on a case built from the plan's seed: its outputs (returned and written in
    place) and, where the convention has a backward the target declares, the gradients from upstream gradients drawn
    from the plan's seed, laid out as `upstream` says."""
    grads = bool(conv.DIFFERENTIABLE) and caps.get("backward", True)
    case = make_case(conv, caps, conv.backward_plan(plan, caps) if grads else plan)
    leaves = {}
    if grads:
        own = conv.leaf_args(case)
        for n in conv.DIFFERENTIABLE:
            if case.args.get(n) is None:
                continue
            if n in own:
                leaves[n] = case.args[n].requires_grad_()
                continue
            leaves[n] = case.args[n].detach().clone().requires_grad_()
            case.args[n].copy_(leaves[n])
    with torch.set_grad_enabled(grads):
        result = case.call(fn)
    got, _ = outputs(conv, case, result)
    seen = {f"output {n}": bits(conv.read(case, n, t)).clone() for n, t in got.items() if isinstance(t, torch.Tensor)}
    wanted = [n for n, t in got.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if grads and wanted:
        gen = torch.Generator().manual_seed(plan.seed + 1)
        ups = [conv.upstream(case, n, lay_out_upstream(torch.randn(tuple(got[n].shape), generator=gen,
                                                                   dtype=torch.float64).to(got[n].dtype)
                                                       .to(got[n].device), upstream)) for n in wanted]
        torch.autograd.backward([got[n] for n in wanted], ups)
        seen.update({f"gradient of {n}": bits(leaf.grad) for n, leaf in leaves.items() if leaf.grad is not None})
    return seen


def schedule(conv, fn, caps, plan, name: str):
    """The call's outputs bitwise equal to the convention's schedule `name` (conv.SCHEDULES) on the same arguments;
    the first differing element named with both values' bits (compare.assert_bitwise)."""
    case = make_case(conv, caps, plan)
    want = conv.SCHEDULES[name](case)
    with torch.no_grad():
        result = case.call(fn)
    got, _ = outputs(conv, case, result)
    for out, w in want.items():
        assert_bitwise(f"schedule {name}: {out}", got[out], w)


def determinism(conv, fn, caps, plan, upstream: str = "contiguous"):
    first = _one_call(conv, fn, caps, plan, upstream)
    second = _one_call(conv, fn, caps, plan, upstream)
    assert first.keys() == second.keys(), f"determinism: the second call gave {sorted(second)}, the first " \
                                          f"{sorted(first)}"
    for what, a in first.items():
        b = second[what]
        if not torch.equal(a, b):
            at = (a != b).nonzero()[0].tolist()
            raise AssertionError(f"determinism: {what} differs between two identical calls; first at {at}: "
                                 f"{a[tuple(at)].item():#x} against {b[tuple(at)].item():#x} (bits)")
