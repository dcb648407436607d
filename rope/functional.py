"""Public entry point: TransformerEngine's `apply_rotary_pos_emb`, backed by the Triton kernel."""
from __future__ import annotations

import torch

from . import reference
from ._launch import INTERPRET, launch
from ._validate import check_positions, check_static


class _RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs32, start_positions, cu_seqlens, layout, tensor_format, interleaved, cp_size,
                cp_rank):
        out = launch(t, freqs32, start_positions, cu_seqlens, layout, tensor_format, interleaved, cp_size,
                     cp_rank, backward=False)
        ctx.save_for_backward(freqs32, start_positions, cu_seqlens)
        ctx.args = (layout, tensor_format, interleaved, cp_size, cp_rank)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        freqs32, start_positions, cu_seqlens = ctx.saved_tensors
        grad = launch(grad_out, freqs32, start_positions, cu_seqlens, *ctx.args, backward=True)
        return grad, None, None, None, None, None, None, None, None


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                         fused=True, cu_seqlens=None, cp_size=1, cp_rank=0):
    """Apply rotary position embedding to `t` (TransformerEngine 2.x semantics; see SPEC.md).

    t: [s, b, h, d] (sbhd), [b, s, h, d] (bshd) or [t, h, d] (thd), any strides.
    freqs: angles [s2, 1, 1, d2], d2 even and <= d; read as float32.
    fused=True runs the Triton kernel (on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1);
    fused=False, or CPU tensors without the interpreter, run `rope.reference`.
    Returns a new contiguous tensor of t's shape and dtype; `t` is never modified. The gradient
    flows to `t` only (as in TransformerEngine's fused path, `freqs` gets none).
    """
    if not fused or (isinstance(t, torch.Tensor) and t.device.type == "cpu" and not INTERPRET):
        return reference.apply_rotary_pos_emb(t, freqs, tensor_format, start_positions, interleaved,
                                              fused, cu_seqlens, cp_size, cp_rank)
    layout = check_static(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
                          cp_rank, allow_float64=False)
    check_positions(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    freqs32 = freqs.detach()
    if freqs32.dtype != torch.float32:
        freqs32 = freqs32.float()
    return _RoPEFunction.apply(t, freqs32, start_positions, cu_seqlens, layout, tensor_format, interleaved,
                               cp_size, cp_rank)
