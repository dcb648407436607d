"""The check every implementation passes before it is timed: forward and backward against float64.

The float64 oracle is `rope.reference` run on the upcast input with the same float32 angles, and
autograd through it for the gradient. The measure is ||out - ref|| / ||ref|| over the whole
tensor; NaN or Inf anywhere fails. The bounds sit well above one rounding of the dtype (float32
math lands far under 1e-6; bf16 near 2e-3 even with cos/sin tables rounded to bf16) and far below
what a wrong index or a missing sign gives (order 1).

A qk case is checked tensor by tensor (q and k outputs, both input gradients from random upstream
gradients for both); the errors reported are the larger of the two, with each in `*_rel_errs`. A
forward-only implementation (in place) is checked forward only, and its outputs must be its
inputs' memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import reference
from .inputs import CaseInputs, parts
from .peers import Impl

REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass
class Reference64:
    out: torch.Tensor | tuple  # in the input set's form: a tensor, or (q, k)
    grad: torch.Tensor | tuple


@dataclass
class CheckResult:
    ok: bool
    fwd_err: float
    bwd_err: float | None  # None: forward only
    tol: float
    message: str = ""
    fwd_errs: list | None = None  # per tensor, for a qk case
    bwd_errs: list | None = None

    def as_dict(self):
        d = {"ok": self.ok, "fwd_rel_err": self.fwd_err, "bwd_rel_err": self.bwd_err, "tol": self.tol,
             "message": self.message}
        if self.fwd_errs is not None:
            d.update(fwd_rel_errs=self.fwd_errs, bwd_rel_errs=self.bwd_errs)
        return d


def _reference64_one(inputs: CaseInputs, t: torch.Tensor, g: torch.Tensor):
    c = inputs.case
    x = t.detach().double().requires_grad_()
    out = reference.apply_rotary_pos_emb(x, inputs.freqs, c.fmt, inputs.start_positions, c.interleaved, False,
                                         inputs.cu_seqlens)
    (grad,) = torch.autograd.grad(out, x, g.double())
    return out.detach(), grad


def reference64(inputs: CaseInputs, t, g) -> Reference64:
    """float64 outputs and input gradients for the set t (a tensor, or (q, k)) and upstream g."""
    if not isinstance(t, (tuple, list)):
        return Reference64(*_reference64_one(inputs, t, g))
    pairs = [_reference64_one(inputs, x, gx) for x, gx in zip(t, g, strict=True)]
    return Reference64(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.detach().double()
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    if not bool(torch.isfinite(got).all()):
        return float("nan")
    denom = torch.linalg.vector_norm(want).item()
    num = torch.linalg.vector_norm(got - want).item()
    return num / denom if denom > 0 else num


def _copy(x, requires_grad):
    # Copies: an in-place implementation must not alter the shared set.
    if isinstance(x, (tuple, list)):
        return tuple(p.detach().clone().requires_grad_(requires_grad) for p in x)
    return x.detach().clone().requires_grad_(requires_grad)


def _worst(errs):
    # NaN (a non-finite output) wins over any number.
    return max(errs, key=lambda e: (e != e, e))


def check_impl(impl: Impl, inputs: CaseInputs, t, g, ref: Reference64) -> CheckResult:
    """Run `impl` forward and backward on copies of (t, g) and compare with the float64 results.

    t and g are one input set and its upstream gradient: tensors, or (q, k) pairs.
    """
    tol = REL_TOL[parts(t)[0].dtype]
    x = _copy(t, impl.backward)
    aliased = True
    with impl.poison(), torch.set_grad_enabled(impl.backward):
        bound = impl.bind(inputs, x, _copy(g, False) if impl.backward else None)
        outs = bound.fn(*bound.xs)
        if impl.inplace:
            aliased = all(o.data_ptr() == i.data_ptr() for o, i in zip(outs, bound.xs, strict=True))
        # Copied before backward, which may reuse buffers.
        out = [o.detach().clone() for o in parts(bound.out_canon(outs))]
        grad = None
        if impl.backward:
            grads = torch.autograd.grad(outs, bound.xs, bound.gs)
            grad = [v.detach() for v in parts(bound.grad_canon(list(grads)))]
    fwds = [rel_err(o, r) for o, r in zip(out, parts(ref.out), strict=True)]
    bwds = None if grad is None else [rel_err(v, r) for v, r in zip(grad, parts(ref.grad), strict=True)]
    fwd = _worst(fwds)
    bwd = None if bwds is None else _worst(bwds)
    ok = fwd <= tol and (bwd is None or bwd <= tol) and aliased  # NaN compares False
    msg = ""
    if not aliased:
        msg = "in place: an output is not its input's memory"
    elif not ok and len(fwds) == 1:
        msg = f"forward rel. error {fwd:.3g}, " + ("" if bwd is None else f"backward {bwd:.3g}, ") + f"bound {tol:g}"
    elif not ok:
        errs = "; ".join(f"{n} forward {fwds[i]:.3g}" + ("" if bwds is None else f", backward {bwds[i]:.3g}")
                         for i, n in enumerate(("q", "k")))
        msg = f"rel. error {errs}; bound {tol:g}"
    many = len(fwds) > 1
    return CheckResult(ok, fwd, bwd, tol, msg, fwds if many else None, bwds if many else None)
