"""Public entry point: TransformerEngine's `apply_rotary_pos_emb`, backed by the Triton kernel."""
from __future__ import annotations

import torch

from . import _launch, _ops, reference
from ._launch import INTERPRET, make_plan, run
from ._validate import check_positions, check_static


class _Call:
    """What a call signature needs after its checks: the layout and the plans per direction/strides."""

    __slots__ = ("layout", "args", "checks_values", "plans")

    def __init__(self, layout, tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank):
        self.layout = layout
        self.args = (tensor_format, interleaved, start_positions is not None, cp_size, cp_rank)
        self.checks_values = start_positions is not None or cu_seqlens is not None
        self.plans = {}

    def plan(self, x, freqs32, backward):
        key = (backward, x.stride(), x.data_ptr() % 16, freqs32.stride(), freqs32.data_ptr() % 16)
        plan = self.plans.get(key)
        if plan is None:
            fmt, interleaved, has_start, cp_size, cp_rank = self.args
            plan = make_plan(x, self.layout, fmt, interleaved, has_start, cp_size, cp_rank, freqs32.stride(),
                             backward)
            self.plans[key] = plan
        return plan


_CALLS: dict = {}


def _index_key(x):
    return None if x is None else (x.shape, x.dtype, x.device, x.data_ptr() % 16)


def _rotate(call, x, freqs32, start_positions, cu_seqlens, backward):
    out = _launch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        run(call.plan(x, freqs32, backward), x, out, freqs32, start_positions, cu_seqlens)
    return out


class _RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs32, start_positions, cu_seqlens, call):
        ctx.call = call
        ctx.inputs = (freqs32, start_positions, cu_seqlens)
        return _rotate(call, t, freqs32, start_positions, cu_seqlens, False)

    @staticmethod
    def backward(ctx, grad_out):
        freqs32, start_positions, cu_seqlens = ctx.inputs
        return _rotate(ctx.call, grad_out, freqs32, start_positions, cu_seqlens, True), None, None, None, None


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
    if torch.compiler.is_compiling():
        # Traced code: checks on shapes become guards, the launch an opaque custom op.
        check_static(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                     allow_float64=False)
        return _ops.rotate(t, freqs, start_positions, cu_seqlens, tensor_format, interleaved, cp_size, cp_rank,
                           False)
    call = _call_for(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
    if call.checks_values:
        check_positions(call.layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    freqs32 = freqs if freqs.dtype == torch.float32 else freqs.float()
    if t.requires_grad and torch.is_grad_enabled():
        return _RoPEFunction.apply(t, freqs32, start_positions, cu_seqlens, call)
    return _rotate(call, t, freqs32, start_positions, cu_seqlens, False)


def _call_for(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank) -> _Call:
    """The checked call for this signature: validated on first sight, then found in a dict."""
    try:
        key = (t.shape, t.stride(), t.dtype, t.device, freqs.shape, freqs.dtype, freqs.device, tensor_format,
               interleaved.__class__, interleaved, _index_key(start_positions), _index_key(cu_seqlens),
               cp_size.__class__, cp_size, cp_rank.__class__, cp_rank)
        call = _CALLS.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks below say what is wrong
        key, call = None, None
    if call is None:
        layout = check_static(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
                              cp_rank, allow_float64=False)
        call = _Call(layout, tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank)
        if key is not None:
            _CALLS[key] = call
    return call
