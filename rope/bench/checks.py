"""The check every implementation passes before it is timed: forward and backward against float64.

The float64 oracle is `rope.reference` run on the upcast input with the same float32 angles, and
autograd through it for the gradient. The measure is ||out - ref|| / ||ref|| over the whole
tensor; NaN or Inf anywhere fails. The bounds sit well above one rounding of the dtype (float32
math lands far under 1e-6; bf16 near 2e-3 even with cos/sin tables rounded to bf16) and far below
what a wrong index or a missing sign gives (order 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import reference
from .inputs import CaseInputs
from .peers import Impl

REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass
class Reference64:
    out: torch.Tensor
    grad: torch.Tensor


@dataclass
class CheckResult:
    ok: bool
    fwd_err: float
    bwd_err: float
    tol: float
    message: str = ""

    def as_dict(self):
        return {"ok": self.ok, "fwd_rel_err": self.fwd_err, "bwd_rel_err": self.bwd_err, "tol": self.tol,
                "message": self.message}


def reference64(inputs: CaseInputs, t: torch.Tensor, g: torch.Tensor) -> Reference64:
    c = inputs.case
    x = t.detach().double().requires_grad_()
    out = reference.apply_rotary_pos_emb(x, inputs.freqs, c.fmt, inputs.start_positions, c.interleaved, False,
                                         inputs.cu_seqlens)
    (grad,) = torch.autograd.grad(out, x, g.double())
    return Reference64(out.detach(), grad)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.detach().double()
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    if not bool(torch.isfinite(got).all()):
        return float("nan")
    denom = torch.linalg.vector_norm(want).item()
    num = torch.linalg.vector_norm(got - want).item()
    return num / denom if denom > 0 else num


def check_impl(impl: Impl, inputs: CaseInputs, t: torch.Tensor, g: torch.Tensor, ref: Reference64) -> CheckResult:
    """Run `impl` forward and backward on copies of (t, g) and compare with the float64 results."""
    tol = REL_TOL[t.dtype]
    x = t.detach().clone().requires_grad_()  # a copy: an in-place implementation must not alter the set
    with impl.poison():
        bound = impl.bind(inputs, x, g.detach().clone())
        outs = bound.fn(*bound.xs)
        out = bound.out_canon(outs).detach().clone()  # before backward, which may reuse buffers
        grads = torch.autograd.grad(outs, bound.xs, bound.gs)
        grad = bound.grad_canon(list(grads)).detach()
    fwd, bwd = rel_err(out, ref.out), rel_err(grad, ref.grad)
    ok = fwd <= tol and bwd <= tol  # NaN compares False
    msg = "" if ok else f"forward rel. error {fwd:.3g}, backward {bwd:.3g}, bound {tol:g}"
    return CheckResult(ok, fwd, bwd, tol, msg)
