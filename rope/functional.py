"""Public entry points: TransformerEngine's `apply_rotary_pos_emb`, and q and k in one launch."""
from __future__ import annotations

import torch

from . import _ops, reference
from ._launch import INTERPRET, angles_for, rotate, rotate_qk, token_index_for
from ._validate import check_disjoint, check_inplace, check_pair, check_positions, check_static, checked_call


class _RoPEFunction(torch.autograd.Function):
    """Autograd for t, or for q and k in one launch. Everything else comes as one `state` tuple (call,
    angles, start_positions, token_index, pos_table, inplace): autograd inspects every argument of
    `apply`, and none of these needs a gradient (`freqs` gets none, as in TransformerEngine)."""

    @staticmethod
    def forward(ctx, state, *ts):
        ctx.state = state
        outs = _rotate_all(state, ts, False)
        if state[5]:
            ctx.mark_dirty(*ts)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        return None, *_rotate_all(ctx.state, grads, True)


def _rotate_all(state, ts, backward):
    """Rotate ts (t, or q and k), or their gradients, with the call's `state`; returns a tuple."""
    call, angles, start_positions, token_index, pos_table, inplace = state
    if len(ts) == 1:
        return (rotate(call, ts[0], angles, start_positions, token_index, backward, inplace and not backward,
                       pos_table),)
    return rotate_qk(call, *ts, angles, start_positions, token_index, backward, inplace and not backward, pos_table)


def _state(call, freqs, start_positions, cu_seqlens, inplace):
    """The value checks of a checked call, then what its launches read (`_RoPEFunction`'s state)."""
    if call.checks_values:
        check_positions(call.layout, call.tensor_format, start_positions, cu_seqlens, call.cp_size, call.cp_rank)
    angles = angles_for(call, freqs)
    token_index, pos_table = token_index_for(call, cu_seqlens)
    return call, angles, start_positions, token_index, pos_table, inplace


def _use_reference(fused, t) -> bool:
    return not fused or (isinstance(t, torch.Tensor) and t.is_cpu and not INTERPRET)


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                         fused=True, cu_seqlens=None, cp_size=1, cp_rank=0, *, inplace=False):
    """Apply rotary position embedding to `t` (TransformerEngine 2.x semantics; docs/contract.md).

    t: [s, b, h, d] (sbhd), [b, s, h, d] (bshd) or [t, h, d] (thd), any strides.
    freqs: angles [s2, 1, 1, d2], d2 even and <= d; read as float32.
    fused=True runs the Triton kernel (on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1);
    fused=False, or CPU tensors without the interpreter, run `rope.reference`.
    Returns a new contiguous tensor of t's shape and dtype; `t` is never modified. The gradient
    flows to `t` only (as in TransformerEngine's fused path, `freqs` gets none).
    inplace=True (not in TE) rotates `t` itself and returns it (race-free; marked dirty for autograd).
    """
    if _use_reference(fused, t):
        out = reference.apply_rotary_pos_emb(t, freqs, tensor_format, start_positions, interleaved,
                                             fused, cu_seqlens, cp_size, cp_rank)
        if inplace:
            check_inplace("t", t)
            return t.copy_(out)
        return out
    if torch.compiler.is_compiling():
        # Traced code: checks on shapes become guards, the launch an opaque custom op.
        check_static(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                     allow_float64=False)
        out = _ops.rotate(t, freqs, start_positions, cu_seqlens, tensor_format, interleaved, cp_size, cp_rank,
                          False)
        return t.copy_(out) if inplace else out
    call = checked_call(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
    if inplace:
        check_inplace("t", t)
    state = _state(call, freqs, start_positions, cu_seqlens, inplace)
    if t.requires_grad and torch.is_grad_enabled():
        return _RoPEFunction.apply(state, t)[0]
    # The eager no-grad call, the hot path: straight to the launcher, no tuples built or unpacked.
    return rotate(call, t, state[1], start_positions, state[3], False, inplace, state[4])


def apply_rotary_pos_emb_qk(q, k, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                            cu_seqlens=None, cp_size=1, cp_rank=0, *, inplace=False):
    """Rotate q and k with the same angles in one launch; returns (q_out, k_out).

    q and k share format, tokens, head dim and dtype; their head counts may differ (GQA, MQA).
    Each group's angles are read and their sin/cos evaluated once for both tensors, and the
    backward computes both gradients in one launch too. Same semantics as two calls of
    `apply_rotary_pos_emb`; CPU tensors without the interpreter use the reference twice.
    """
    check_pair(q, k, tensor_format)
    if _use_reference(True, q) or torch.compiler.is_compiling():
        kw = dict(tensor_format=tensor_format, start_positions=start_positions, interleaved=interleaved,
                  cu_seqlens=cu_seqlens, cp_size=cp_size, cp_rank=cp_rank, inplace=inplace)
        return apply_rotary_pos_emb(q, freqs, **kw), apply_rotary_pos_emb(k, freqs, **kw)
    call = checked_call(q, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank, "q")
    checked_call(k, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank, "k")
    if inplace:
        check_inplace("q", q)
        check_inplace("k", k)
        check_disjoint(q, k)
    state = _state(call, freqs, start_positions, cu_seqlens, inplace)
    if (q.requires_grad or k.requires_grad) and torch.is_grad_enabled():
        return _RoPEFunction.apply(state, q, k)
    return _rotate_all(state, (q, k), False)
