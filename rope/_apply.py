"""The one path below every entry point: autograd around the launcher (`rope._launch`).

An entry point checks its arguments into a `Call` and says what the kernel reads (`Angles`, positions);
`apply` rotates t, or q and k in one launch, with a backward where autograd needs one.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _ops
from ._launch import INTERPRET, rotate, rotate_qk


class TracedCall(NamedTuple):
    """A TransformerEngine call as traced code runs it: `rope._ops.rotate`'s arguments after x (the launch is an
    opaque custom op there; its checks become guards)."""

    freqs: torch.Tensor
    start_positions: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    tensor_format: str
    interleaved: bool
    cp_size: int
    cp_rank: int


def _rotate(state, ts, backward):
    """ts (t, or q and k) or their gradients rotated as `state` says: the launcher's state tuple (call, angles,
    start_positions, token_index, pos_table, inplace), a `TracedCall`, or a function (t, backward) -> rotated t
    (a convention's reference, for the leaf written in place). Returns a tuple."""
    if isinstance(state, TracedCall):
        return (_ops.rotate(ts[0], *state, backward),)
    if callable(state):
        return (state(ts[0], backward),)
    call, angles, start_positions, token_index, pos_table, inplace = state
    if len(ts) == 1:
        return (rotate(call, ts[0], angles, start_positions, token_index, backward, inplace and not backward,
                       pos_table),)
    return rotate_qk(call, *ts, angles, start_positions, token_index, backward, inplace and not backward, pos_table)


class Rotation(torch.autograd.Function):
    """The one autograd node of every rotation rope runs, eager or traced, kernel or a reference's leaf write.
    A rotation is orthogonal and its angles get no gradient (as in TransformerEngine), so the vector-Jacobian
    product is the inverse rotation (-sin) of the upstream gradients, at the same positions: `_rotate(state,
    grads, True)`, which reads nothing saved. `state` is one argument (autograd inspects each argument of
    `apply`; none of these needs a gradient).

    `written`: how ts are written in place. "dirty": marked so, autograd rebases their history. "leaf": a leaf
    that requires grad, as flash-attention's autograd Function writes it: not marked (autograd refuses to mark such
    a leaf), so autograd hands back a new tensor over the leaf's memory carrying this node, and the leaf stays a
    leaf. It has no history that the write could make stale, and the backward reads no saved input, so the
    gradient is exact; its version counter advances as for any in-place write, so that a graph which saved its
    old values refuses its backward instead of reading the rotated ones."""

    @staticmethod
    def forward(ctx, state, written, *ts):
        ctx.state = state
        outs = _rotate(state, ts, False)
        if written == "dirty":
            ctx.mark_dirty(*ts)
        elif written == "leaf":
            for t in ts:
                torch.autograd.graph.increment_version(t)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        return None, None, *_rotate(ctx.state, grads, True)


def write_leaf(x, rotate):
    """x (a leaf that requires grad) rotated in its memory by rotate(x, False); returns a new tensor over x's memory
    whose backward is rotate(grad, True), a new tensor (the upstream gradient is left as it is)."""
    return Rotation.apply(rotate, "leaf", x)[0]


def leaf_written(x, inplace) -> bool:
    """Whether an in-place call on x takes `write_leaf` (autograd records it, and x is a leaf that requires grad)."""
    return inplace and torch.is_grad_enabled() and x.requires_grad and x.is_leaf


def apply_traced(t, traced: TracedCall):
    """t rotated by the custom op in traced code, differentiable through `Rotation` where autograd records."""
    if torch.is_grad_enabled() and t.requires_grad:
        return Rotation.apply(traced, None, t)[0]
    return _ops.rotate(t, *traced, False)


def apply(ts, call, angles, start_positions=None, token_index=None, pos_table=False, inplace=False):
    """Rotated ts (a tuple: t, or q and k), differentiable in ts where autograd records."""
    state = (call, angles, start_positions, token_index, pos_table, inplace)
    if len(ts) == 1 and leaf_written(ts[0], inplace):
        return (write_leaf(ts[0], lambda t, backward: _rotate(state, (t,), backward)[0]),)
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        written = "dirty" if inplace else None
        if inplace and len(ts) > 1 and (ts[0]._is_view() or ts[1]._is_view()):
            # Autograd rebases the history of a view written in place only for a Function of one output
            # (q and k sliced from a fused qkv projection): then one launch each.
            return (Rotation.apply(state, written, ts[0])[0],
                    Rotation.apply((call.for_tensor(ts[1]), *state[1:]), written, ts[1])[0])
        return Rotation.apply(state, written, *ts)
    return _rotate(state, ts, False)


def on_kernel_device(x: torch.Tensor) -> bool:
    """The one rule for where the Triton kernel runs: a CUDA tensor, or a CPU one under TRITON_INTERPRET=1;
    elsewhere the reference computes (every entry point asks this)."""
    return x.is_cuda or (INTERPRET and x.is_cpu)


def kernel_runs(x) -> bool:
    """Whether the kernel runs for x, outside tracing (entry points other than TransformerEngine's trace as the
    reference's PyTorch operations; TE's has a custom op for the trace)."""
    return isinstance(x, torch.Tensor) and on_kernel_device(x) and not torch.compiler.is_compiling()
