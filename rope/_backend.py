"""The back end below every convention: the call memo of checked signatures, kernel or reference decided by one
rule (`kernel_runs`), the autograd nodes around the launcher (`rope._launch`) and the custom op that traced code
(`torch.compile`) records in place of the launch.

A convention checks its arguments (`rope._checks`), finds its `Call` by `checked_call` or `call_for` and says in a
`rope._request.Request` what the kernel reads (angles, positions); `apply` rotates t, or q and k in one launch, with
a backward where autograd needs one; `norm_rotate` does the same for QK norm fused with RoPE.

`torch.ops.rope.rotate` is opaque, with a fake implementation (a new contiguous tensor). Its autograd is `Rotation`,
the node of every rotation, which traced code records around it (`apply_traced`): the backward is the same op in the
other direction. Eager calls skip the op: the dispatcher would add its cost to every call.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _launch, _memo, reference
from ._checks import check_static
from ._launch import INTERPRET, rotate, rotate_qk
from ._request import Request

# The call memo: a repeated signature costs one dict lookup.


class Call:
    """A checked call signature: its layout and flags, and the launch plans made for it
    (`rope._launch`), so that a repeated signature costs one dict lookup."""

    __slots__ = ("layout", "tensor_format", "interleaved", "has_start", "cp_size", "cp_rank", "checks_values",
                 "empty", "plans", "others")

    def __init__(self, layout, tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank):
        self.layout, self.tensor_format, self.interleaved = layout, tensor_format, interleaved
        self.has_start, self.cp_size, self.cp_rank = start_positions is not None, cp_size, cp_rank
        self.checks_values = start_positions is not None or cu_seqlens is not None
        self.empty = layout.s * layout.b * layout.h * layout.d == 0
        self.plans = {}
        self.others = None

    def for_tensor(self, x: torch.Tensor) -> Call:
        """This call for another tensor of its tokens and head dim (k beside q), rotated on its own: x's heads
        in the layout, and plans of its own (a call's key fixes the strides of its tensor, so the plans of
        single launches need not hold them)."""
        if self.others is None:
            self.others = {}
        key = (x.shape, x.stride())
        call = self.others.get(key)
        if call is None:
            call = Call.__new__(Call)
            for name in Call.__slots__:
                setattr(call, name, getattr(self, name))
            call.layout = self.layout._replace(h=x.shape[-2])
            call.empty = x.numel() == 0
            call.plans, call.others = {}, None
            if len(self.others) >= _OTHERS_MAX:
                self.others.clear()
            self.others[key] = call
        return call


_OTHERS_MAX = 16


# packed batches change the token count every step: keep the memo bounded
_CALLS = _memo.memo("checked signatures and their launch plans", 4096)


def _index_key(x):
    return None if x is None else (x.shape, x.dtype, x.device, x.data_ptr() % 16)


def checked_call(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                 name="t", freqs_name="freqs") -> Call:
    """The call for this signature: checked (`check_static`) on first sight, then found in a dict."""
    try:
        key = (t.shape, t.stride(), t.dtype, t.device, freqs.shape, freqs.dtype, freqs.device, tensor_format,
               interleaved.__class__, interleaved, _index_key(start_positions), _index_key(cu_seqlens),
               cp_size.__class__, cp_size, cp_rank.__class__, cp_rank)
        call = _CALLS.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks below say what is wrong
        key, call = None, None
    if call is None:
        layout = check_static(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                              allow_float64=False, name=name, freqs_name=freqs_name)
        call = Call(layout, tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank)
        if key is not None:
            _CALLS.put(key, call)
    return call


def call_for(key, make) -> Call:
    """The memoised `Call` of another convention's signature `key`; `make()` checks and builds it."""
    call = _CALLS.get(key)
    if call is None:
        call = _CALLS.put(key, make())
    return call


class TracedCall(NamedTuple):
    """A TransformerEngine call as traced code runs it: `rotate_op`'s arguments after x (the launch is an
    opaque custom op there; its checks become guards)."""

    freqs: torch.Tensor
    start_positions: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    tensor_format: str
    interleaved: bool
    cp_size: int
    cp_rank: int


def _rotate(state, ts, backward):
    """ts (t, or q and k) or their gradients rotated as `state` says: a `Request`, a `TracedCall`, or a function
    (t, backward) -> rotated t (a convention's reference, for the leaf written in place). Returns a tuple."""
    if isinstance(state, TracedCall):
        return (rotate_op(ts[0], *state, backward),)
    if callable(state):
        return (state(ts[0], backward),)
    inplace = state.inplace and not backward
    if len(ts) == 1:
        return (rotate(state.call, ts[0], state.angles, state.start_positions, state.token_index, backward, inplace,
                       state.pos_table),)
    return rotate_qk(state.call, *ts, state.angles, state.start_positions, state.token_index, backward, inplace,
                     state.pos_table)


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
    return rotate_op(t, *traced, False)


def apply(ts, call, angles, *, start_positions=None, token_index=None, pos_table=False, inplace=False):
    """ts (a tuple: t, or q and k) rotated: `Request`'s fields by name. Differentiable in ts where autograd records,
    which keeps them as a `Request`; the no-grad call builds none (the hot path: straight to the launcher)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        request = Request(call, angles, start_positions, token_index, pos_table, inplace)
        if len(ts) == 1 and leaf_written(ts[0], inplace):
            return (write_leaf(ts[0], lambda t, backward: _rotate(request, (t,), backward)[0]),)
        written = "dirty" if inplace else None
        if inplace and len(ts) > 1 and (ts[0]._is_view() or ts[1]._is_view()):
            # Autograd rebases the history of a view written in place only for a Function of one output
            # (q and k sliced from a fused qkv projection): then one launch each.
            return (Rotation.apply(request, written, ts[0])[0],
                    Rotation.apply(request._replace(call=request.call.for_tensor(ts[1])), written, ts[1])[0])
        return Rotation.apply(request, written, *ts)
    if len(ts) == 1:
        return (rotate(call, ts[0], angles, start_positions, token_index, False, inplace, pos_table),)
    return rotate_qk(call, *ts, angles, start_positions, token_index, False, inplace, pos_table)


def on_kernel_device(x: torch.Tensor) -> bool:
    """The one rule for where the Triton kernel runs: a CUDA tensor, or a CPU one under TRITON_INTERPRET=1;
    elsewhere the reference computes (every entry point asks this)."""
    return x.is_cuda or (INTERPRET and x.is_cpu)


def kernel_runs(x) -> bool:
    """Whether the kernel runs for x, outside tracing (entry points other than TransformerEngine's trace as the
    reference's PyTorch operations; TE's has a custom op for the trace)."""
    return isinstance(x, torch.Tensor) and on_kernel_device(x) and not torch.compiler.is_compiling()


OP_NAME = "rope::rotate"


@torch.library.custom_op(OP_NAME, mutates_args=())
def rotate_op(x: torch.Tensor, freqs: torch.Tensor, start_positions: Optional[torch.Tensor],
           cu_seqlens: Optional[torch.Tensor], tensor_format: str, interleaved: bool, cp_size: int,
           cp_rank: int, backward: bool) -> torch.Tensor:
    call = checked_call(x, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
    token_index, pos_table = _launch.token_index_for(call, cu_seqlens)
    angles = _launch.angles_for(call, freqs)
    return _launch.rotate(call, x, angles, start_positions, token_index, backward, False, pos_table)


@rotate_op.register_fake
def _(x, freqs, start_positions, cu_seqlens, tensor_format, interleaved, cp_size, cp_rank, backward):
    return x.new_empty(x.shape)  # a new contiguous tensor of x's shape and dtype, as the kernel writes


class NormRotation(torch.autograd.Function):
    """Autograd of the fused op: the backward recomputes r from q and k (saved as given), docs/design.md."""

    @staticmethod
    def forward(ctx, request, q, k, q_weight, k_weight):
        ctx.request = request
        ctx.save_for_backward(q, k, q_weight, k_weight)
        return _launch.norm_rotate_qk(request.call, q, k, (q_weight, k_weight), request.norm, request.eps,
                                      request.angles, request.start_positions, request.token_index, request.pos_table)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        r = ctx.request
        q, k, q_weight, k_weight = ctx.saved_tensors
        return None, *_launch.norm_rotate_qk_backward(r.call, grad_q, grad_k, q, k, (q_weight, k_weight), r.norm,
                                                      r.eps, r.angles, r.start_positions, r.token_index, r.pos_table)


def norm_rotate(qv, kv, q_weight, k_weight, call, angles, *, norm, eps, start_positions=None, token_index=None,
                pos_table=False, inplace=False):
    """RoPE(RMSNorm(x) * w) of q and k (`Request`'s fields by name), differentiable where autograd records, which
    keeps them as a `Request`. In place (vLLM's op, which has no backward and refuses a qkv that requires grad)
    records no graph, whichever weights require grad."""
    if not inplace and torch.is_grad_enabled() and any(t.requires_grad for t in (qv, kv, q_weight, k_weight)):
        return NormRotation.apply(Request(call, angles, start_positions, token_index, pos_table, inplace, norm, eps),
                                  qv, kv, q_weight, k_weight)
    return _launch.norm_rotate_qk(call, qv, kv, (q_weight, k_weight), norm, eps, angles, start_positions, token_index,
                                  pos_table, inplace)


def rotate_and_cache(q, k, v, key_cache, value_cache, slots, positions, cos, sin, rows, interleaved, fp8=False,
                     k_scale=None, v_scale=None) -> None:
    """RoPE fused with the KV-cache write (`rope._launch.rotate_and_cache`'s arguments): the kernel, or its
    definition in PyTorch (`rope.reference.rotate_and_cache`) where the kernel does not run."""
    if kernel_runs(q):
        _launch.rotate_and_cache(q, k, v, key_cache, value_cache, slots, positions, cos, sin, rows, interleaved, fp8,
                                 k_scale, v_scale)
        return
    reference.rotate_and_cache(q, k, v, key_cache, value_cache, slots, positions, cos, sin, interleaved, fp8, k_scale,
                               v_scale)
