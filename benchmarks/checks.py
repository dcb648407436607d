"""The check every implementation passes before it is timed: forward and backward against float64.

The oracle: `rope.reference` on the input upcast to float64 (same float32 angles), and autograd through it.
The measure is ||out - ref|| / ||ref|| per tensor (q and k separately); NaN or Inf anywhere fails. The bounds
sit well above one rounding of the dtype, far below what a wrong index or sign gives (order 1). rope's outputs
start as NaN, so an element it never writes fails too. An in-place implementation is checked forward only,
and its outputs must be its inputs' memory.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from cases import CaseInputs, parts
from peers import Impl

from rope import _launch, reference

REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass
class Check:
    ok: bool
    fwd_err: float  # the worst over the tensors (NaN: a non-finite output)
    bwd_err: float | None  # None: forward only
    message: str = ""


def reference64(inputs: CaseInputs, t, g) -> tuple[list, list]:
    """float64 outputs and input gradients, [t] or [q, k] each, for the set t and upstream gradient g."""
    outs, grads = [], []
    for x, gx in zip(parts(t), parts(g), strict=True):
        x = x.detach().double().requires_grad_()
        out = reference.apply_rotary_pos_emb(x, *inputs.args, False, inputs.cu_seqlens)
        outs.append(out.detach())
        grads.append(torch.autograd.grad(out, x, gx.double())[0])
    return outs, grads


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.detach().double()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.isfinite(got).all():
        return float("nan")
    return (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-300)).item()


def _copy(x, requires_grad=False):
    """A copy of a set (tensor or (q, k)) in the same form: an in-place implementation must not alter the shared one."""
    if isinstance(x, (tuple, list)):
        return tuple(p.detach().clone().requires_grad_(requires_grad) for p in x)
    return x.detach().clone().requires_grad_(requires_grad)


def _worst(errs):
    return max(errs, key=lambda e: (e != e, e))  # NaN wins over any number


def check_impl(impl: Impl, inputs: CaseInputs, t, g, ref) -> Check:
    """Run `impl` forward (and backward) on copies of the set t and gradient g; compare with `ref`,
    reference64's result for them."""
    tol = REL_TOL[parts(t)[0].dtype]
    poison = _launch.nan_outputs() if impl.ours else contextlib.nullcontext()
    with poison, torch.set_grad_enabled(impl.backward):
        bound = impl.bind(inputs, _copy(t, impl.backward), _copy(g) if impl.backward else None)
        outs = bound.fn(*bound.xs)
        aliased = not impl.inplace or all(o.data_ptr() == i.data_ptr() for o, i in zip(outs, bound.xs, strict=True))
        fwd = _worst([rel_err(o, r) for o, r in zip(bound.out_canon(outs), ref[0], strict=True)])
        bwd = None
        if impl.backward:
            grads = torch.autograd.grad(outs, bound.xs, bound.gs)
            bwd = _worst([rel_err(v, r) for v, r in zip(bound.grad_canon(list(grads)), ref[1], strict=True)])
    if not aliased:
        return Check(False, fwd, bwd, "in place: an output is not its input's memory")
    ok = fwd <= tol and (bwd is None or bwd <= tol)  # NaN compares False
    backward = "" if bwd is None else f", backward {bwd:.3g}"
    return Check(ok, fwd, bwd, "" if ok else f"relative error forward {fwd:.3g}{backward}; bound {tol:g}")
