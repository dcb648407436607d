"""The one path below every entry point: autograd around the launcher (`rope._launch`).

An entry point checks its arguments into a `Call` and says what the kernel reads (`Angles`, positions);
`apply` rotates t, or q and k in one launch, with a backward where autograd needs one.
"""
from __future__ import annotations

import torch

from ._launch import INTERPRET, rotate, rotate_qk


class _RoPEFunction(torch.autograd.Function):
    """Autograd for t, or for q and k in one launch. Everything else comes as one `state` tuple (call,
    angles, start_positions, token_index, pos_table, inplace): autograd inspects every argument of
    `apply`, and none of these needs a gradient (angles get none, as in TransformerEngine)."""

    @staticmethod
    def forward(ctx, state, *ts):
        ctx.state = state
        outs = rotate_all(state, ts, False)
        if state[5]:
            ctx.mark_dirty(*ts)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        return None, *rotate_all(ctx.state, grads, True)


class _LeafWritten(torch.autograd.Function):
    """In place on a leaf that requires grad, as flash-attention's autograd Function does it: the forward writes
    the leaf and returns it without marking it dirty (autograd refuses to mark a leaf that requires grad), so
    autograd hands back a new tensor object over the leaf's memory carrying this node; the leaf stays a leaf, and
    its gradient is the inverse rotation of the upstream one. The leaf has no history that the write could make
    stale, and a rotation's backward reads no saved input, so the gradient is exact. The version counter advances
    as for any in-place write, so that a graph which saved the leaf's old values refuses its backward instead of
    reading the rotated ones."""

    @staticmethod
    def forward(ctx, rotate, x):
        ctx.rotate = rotate
        rotate(x, False)
        torch.autograd.graph.increment_version(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return None, ctx.rotate(grad, True)


def write_leaf(x, rotate):
    """x (a leaf that requires grad) rotated in its memory by rotate(x, False); returns a new tensor over x's memory
    whose backward is rotate(grad, True), a new tensor (the upstream gradient is left as it is)."""
    return _LeafWritten.apply(rotate, x)


def leaf_written(x, inplace) -> bool:
    """Whether an in-place call on x takes `write_leaf` (autograd records it, and x is a leaf that requires grad)."""
    return inplace and torch.is_grad_enabled() and x.requires_grad and x.is_leaf


def rotate_all(state, ts, backward):
    """Rotate ts (t, or q and k), or their gradients, with the call's `state`; returns a tuple."""
    call, angles, start_positions, token_index, pos_table, inplace = state
    if len(ts) == 1:
        return (rotate(call, ts[0], angles, start_positions, token_index, backward, inplace and not backward,
                       pos_table),)
    return rotate_qk(call, *ts, angles, start_positions, token_index, backward, inplace and not backward, pos_table)


def apply(ts, call, angles, start_positions=None, token_index=None, pos_table=False, inplace=False):
    """Rotated ts (a tuple: t, or q and k), differentiable in ts where autograd records."""
    state = (call, angles, start_positions, token_index, pos_table, inplace)
    if len(ts) == 1 and leaf_written(ts[0], inplace):
        return (write_leaf(ts[0], lambda t, backward: rotate_all(state, (t,), backward)[0]),)
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        if inplace and len(ts) > 1 and (ts[0]._is_view() or ts[1]._is_view()):
            # Autograd rebases the history of a view written in place only for a Function of one output
            # (q and k sliced from a fused qkv projection): then one launch each.
            return (_RoPEFunction.apply(state, ts[0])[0],
                    _RoPEFunction.apply((call.for_tensor(ts[1]), *state[1:]), ts[1])[0])
        return _RoPEFunction.apply(state, *ts)
    return rotate_all(state, ts, False)


def on_kernel_device(x: torch.Tensor) -> bool:
    """The one rule for where the Triton kernel runs: a CUDA tensor, or a CPU one under TRITON_INTERPRET=1;
    elsewhere the reference computes (every entry point asks this)."""
    return x.is_cuda or (INTERPRET and x.is_cpu)


def kernel_runs(x) -> bool:
    """Whether the kernel runs for x, outside tracing (entry points other than TransformerEngine's trace as the
    reference's PyTorch operations; TE's has a custom op for the trace)."""
    return isinstance(x, torch.Tensor) and on_kernel_device(x) and not torch.compiler.is_compiling()
