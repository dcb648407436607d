"""The back end below every convention: the registry of conventions, the one decision between kernel, reference and
trace (`dispatch`, by `on_kernel_device`), the call memo of checked signatures with its derived keys (`signature`),
the autograd nodes around the launcher (`rope._launch`) and the custom ops that traced code (`torch.compile`) records
in place of the launch.

A convention checks its arguments (`rope._checks`) and hands `dispatch` its `Convention` (how its `Call` is made,
what the kernel reads, its PyTorch reference), the rotated tensors, the tensors read beside them and its flags.
`record` rotates t, or q and k in one launch, with a backward, where autograd records; `norm_rotate` does the same for
QK norm fused with RoPE.

`torch.ops.rope.rotate` (and `rotate_`, in place) is opaque, with a fake implementation (new contiguous tensors), and
takes the convention's name, so every convention traces as the same op. Its autograd is `Rotation`, the node of every
rotation, which traced code records around it: the backward is the same op in the other direction. Eager calls skip
the op: the dispatcher would add its cost to every call.
"""
from __future__ import annotations

import ast
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch

from . import _launch, _memo
from ._checks import check_static
from ._launch import INTERPRET, rotate, rotate_qk
from ._request import Request

# The call memo: a repeated signature costs one dict lookup.


class Call:
    """A checked call signature: its layout and flags, and the launch plans made for it
    (`rope._launch`), so that a repeated signature costs one dict lookup."""

    __slots__ = ("layout", "tensor_format", "interleaved", "has_start", "cp_size", "cp_rank", "checks_values",
                 "empty", "plans", "others", "schedule", "permute",
                 "inverse", "tail_first", "keep_order")

    def __init__(self, layout, tensor_format, interleaved, start_positions=None, cu_seqlens=None, cp_size=1,
                 cp_rank=0, schedule=None, permute=False, inverse=False, tail_first=False):
        # schedule: the forward's rounding, None (float32 math, one rounding), "eager" or "float32" (SCHEDULES); the
        # backward is the default's. permute: pairs read interleaved and written half-split (DeepSeek-V3's form)
        self.layout, self.tensor_format, self.interleaved = layout, tensor_format, interleaved
        # inverse: the forward rotates by -theta (vLLM's `inverse`), and its backward by theta
        self.schedule, self.permute, self.inverse = schedule, permute, inverse
        # tail_first: the rotated channels are the head's last rot_dim, the channels before them copied (DeepSeek-V4)
        self.tail_first = tail_first
        # keep_order: an output out of place keeps the memory order of its input as PyTorch's elementwise operations
        # do (`empty_like`; else it is contiguous): the convention's, set by `call_of`
        self.keep_order = False
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


def checked_call(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                 name="t", freqs_name="freqs") -> Call:
    """The call for this signature: checked (`check_static`) on first sight, then found in a dict. Traced code
    checks every time it traces (a data pointer has no value there, and the trace runs once per guard)."""
    try:
        if torch.compiler.is_compiling():
            raise RuntimeError
        key = signature("te", (t, freqs, start_positions, cu_seqlens), (tensor_format, interleaved, cp_size, cp_rank))
        call = _CALLS.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks below say what is wrong
        key, call = None, None
    except RuntimeError:  # traced, or a functorch-wrapped tensor (no data pointer): checked, not memoised
        key, call = None, None
    if call is None:
        layout = check_static(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                              allow_float64=False, name=name, freqs_name=freqs_name)
        call = Call(layout, tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank)
        if key is not None:
            _CALLS.put(key, call)
    return call


class Seen:
    """A signature whose static checks passed (`check_once`), and the `Call` the kernel path made for it (None until
    then): the front end hands it to `dispatch`, so that a repeated call derives one key, not two."""

    __slots__ = ("call",)

    def __init__(self):
        self.call = None


# signatures of front-end calls whose static checks passed
_SEEN = _memo.memo("front-end signatures whose static checks passed", 4096)


def check_once(name: str, check: Callable, tensors: tuple, flags: tuple) -> Seen:
    """check(*tensors, *flags), a front end's static checks (shapes, dtypes, devices, strides, the flags' types and
    values: what `signature` holds), on the first sight of this signature under `name`; afterwards one key and a
    dict lookup. What else a check reads stays the front end's on every call (a tensor's values, autograd's state,
    memory overlap). A signature that cannot be made (not tensors, unhashable flags) or traced code checks every
    time, as `checked_call` does."""
    try:
        if torch.compiler.is_compiling():
            raise RuntimeError
        key = signature(name, tensors, flags)
        seen = _SEEN.get(key)
    except (AttributeError, TypeError, RuntimeError):
        key, seen = None, None
    if seen is None:
        check(*tensors, *flags)
        seen = Seen()
        if key is not None:
            _SEEN.put(key, seen)
    return seen


class Traced(NamedTuple):
    """A rotation as traced code runs it: the custom op's arguments beside the rotated tensors (the launch is an
    opaque custom op there; the front end's checks become guards)."""

    convention: str
    reads: tuple
    flags: str  # the convention's flags as `repr` writes them (a custom op's schema has no tuple of any type)


def _rotate(state, ts, backward):
    """ts (t, or q and k) or their gradients rotated as `state` says: a `Request`, a `Traced`, or a function
    (t, backward) -> rotated t (a convention's reference, for the leaf written in place). Returns a tuple."""
    if isinstance(state, Traced):
        return tuple(rotate_op(state.convention, list(ts), list(state.reads), state.flags, backward))
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


def record(ts, call, angles, *, start_positions=None, token_index=None, pos_table=False, inplace=False):
    """ts (a tuple: t, or q and k) rotated where autograd records (`dispatch` asks), differentiable in ts:
    `Request`'s fields by name, kept for the backward as a `Request`."""
    request = Request(call, angles, start_positions, token_index, pos_table, inplace)
    if inplace and len(ts) == 1 and leaf_written(ts[0], True):
        return (write_leaf(ts[0], lambda t, backward: _rotate(request, (t,), backward)[0]),)
    written = "dirty" if inplace else None
    if inplace and len(ts) > 1 and (ts[0]._is_view() or ts[1]._is_view()):
        # Autograd rebases the history of a view written in place only for a Function of one output
        # (q and k sliced from a fused qkv projection): then one launch each.
        return (Rotation.apply(request, written, ts[0])[0],
                Rotation.apply(request._replace(call=request.call.for_tensor(ts[1])), written, ts[1])[0])
    return Rotation.apply(request, written, *ts)


def on_kernel_device(x: torch.Tensor) -> bool:
    """The one rule for where the Triton kernel runs: a CUDA tensor, or a CPU one under TRITON_INTERPRET=1;
    elsewhere the reference computes (every entry point asks this)."""
    return x.is_cuda or (INTERPRET and x.is_cpu)


class NormRotation(torch.autograd.Function):
    """Autograd of the fused op: the backward recomputes r from q and k (saved as given), docs/design.md. `state`: a
    `Request`, or a `Traced` call, whose backward is the custom op in the other direction (with q, k and the
    weights it reads)."""

    @staticmethod
    def forward(ctx, state, q, k, q_weight, k_weight):
        ctx.state = state
        ctx.save_for_backward(q, k, q_weight, k_weight)
        if isinstance(state, Traced):
            return tuple(rotate_op(state.convention, [q, k, q_weight, k_weight], list(state.reads), state.flags,
                                   False))
        return _launch.norm_rotate_qk(state.call, q, k, (q_weight, k_weight), state.norm, state.eps, state.angles,
                                      state.start_positions, state.token_index, state.pos_table)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        r = ctx.state
        q, k, q_weight, k_weight = ctx.saved_tensors
        if isinstance(r, Traced):
            return None, *rotate_op(r.convention, [grad_q, grad_k, q, k, q_weight, k_weight], list(r.reads), r.flags,
                                    True)
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


# Conventions: what each front end registers, and the one decision between kernel, reference and trace.


class Convention:
    """A convention's side of the back end, registered by name (the custom op finds it from its arguments).

    Every function takes what the front end hands `dispatch`: `ts`, the rotated tensors in the kernel's roles (for a
    `norm` convention q, k and their weights); `reads`, the other tensors (tables, positions; None where absent);
    `flags`, the convention's scalars (literals only, no sizes: sizes come from the tensors, which Dynamo guards).
    - `call(ts, reads, flags) -> Call`: the checked signature's layout and flags, on the memo's first sight.
    - `reads(call, reads, flags)`: what the kernel reads, (angles, start_positions, token_index, pos_table), and for
      a `norm` convention (norm, eps) after them.
    - `reference(ts, reads, flags, backward) -> tuple`: the convention's PyTorch computation, new tensors (backward:
      the inverse rotation, for a leaf written in place; conventions without one ignore it).
    - `launch(ts, reads, flags)`, for a convention with a kernel of its own (RoPE fused with the KV-cache write, in
      place and without a backward): that kernel, writing ts; `call` and `reads` are then unused, and `reference`
      writes ts in place too.
    - `keep_order`: new outputs keep the memory order of the input, as the convention's own PyTorch expression
      gives them (`empty_like`) (`Call.keep_order`, set on every `Call` of the convention, and the custom op's
      fake outputs: `torch.compile` plans later operations by their strides)."""

    __slots__ = ("name", "call", "reads", "reference", "norm", "launch", "keep_order")  # slots: read on every call

    def __init__(self, name: str, call: Callable, reads: Callable, reference: Callable, norm: bool = False,
                 launch: Callable = None, keep_order: bool = False):
        self.name, self.call, self.reads, self.reference, self.norm, self.launch = (name, call, reads, reference, norm,
                                                                                    launch)
        self.keep_order = keep_order


CONVENTIONS: dict = {}


def convention(name, call, reads, reference, norm=False, launch=None, keep_order=False) -> Convention:
    conv = CONVENTIONS[name] = Convention(name, call, reads, reference, norm, launch, keep_order)
    return conv


def _made(conv: Convention, call: Call) -> Call:
    call.keep_order = conv.keep_order
    return call


def signature(name, tensors, flags) -> tuple:
    """The memo's key of a call, derived from what the checks and a `Call` read: the convention's (or front end's)
    name; its flags with the type of each (True and 1 hash alike); for each tensor its shape, strides, dtype and
    device (a `torch.device`: `get_device()` gives -1 for the CPU and the meta device alike), in line (None stays one
    None: a convention's tensors come in a fixed order). What else Triton specializes on, each pointer's 16-byte
    alignment, is in the key of every launch plan (`rope._launch`), which holds it for the tensors the kernel is
    actually given (a table's cached copy, a contiguous weight). One tuple build: the hot path's cost is this and a
    dict lookup."""
    key = [name, flags, *map(type, flags)]
    for x in tensors:
        if x is None:
            key.append(None)
        else:
            key += (x.shape, x.stride(), x.dtype, x.device)
    return tuple(key)


def call_of(conv: Convention, ts, reads, flags) -> Call:
    """The memoised `Call` of this signature; `conv.call` builds it on first sight."""
    try:
        key = signature(conv.name, ts + reads, flags)
    except RuntimeError:  # a functorch-wrapped tensor has no data pointer: autograd's Function refuses it later
        return _made(conv, conv.call(ts, reads, flags))
    call = _CALLS.get(key)
    if call is None:
        call = _CALLS.put(key, _made(conv, conv.call(ts, reads, flags)))
    return call


def dispatch(conv: Convention, ts: tuple, reads: tuple = (), flags: tuple = (), *, inplace=False, fits=True,
             call=None, seen=None) -> tuple:
    """ts rotated as convention `conv` says, after the front end's checks: the one place that decides between the
    kernel, the reference and the trace. The reference computes where the kernel does not run (`on_kernel_device`)
    or where the front end says the kernel cannot give the convention's result (`fits` False: a wider result dtype,
    or TransformerEngine's fused=False); traced code (`torch.compile`) records the custom op; else the kernel runs.
    `inplace`: ts are written and returned. `call`: the signature's `Call` where the front end's checks found it
    already (the memo is then not asked twice); `seen`: the `Seen` of the front end's own signature (`check_once`),
    which keeps the `Call` made from its arguments. Returns the rotated tensors (q and k for a `norm` convention)."""
    x = ts[0]
    if not (fits and (x.is_cuda or (INTERPRET and x.is_cpu))):  # `on_kernel_device`, inline on the hot path
        return _by_reference(conv, ts, reads, flags, inplace)
    if torch.compiler.is_compiling():
        return _traced(conv, ts, reads, flags, inplace)
    if conv.launch is not None:
        conv.launch(ts, reads, flags)
        return ts
    if call is None:
        # the front end's signature fixes every tensor's and flag's that the Call's is made of (they are derived from
        # its arguments), so its Seen keeps the Call
        call = seen.call if seen is not None else None
        if call is None:
            call = call_of(conv, ts[:2] if conv.norm else ts, reads, flags)
            if seen is not None:
                seen.call = call
    read = conv.reads(call, reads, flags)  # (angles, start, index, pos_table), and (norm, eps) for a norm convention
    start = read[1]
    if start is not None and not start.is_contiguous():  # a strided or expanded view: the kernels read it at stride 1
        start = start.contiguous()
    if conv.norm:
        angles, _, index, pos_table, norm, eps = read
        return norm_rotate(*ts, call, angles, norm=norm, eps=eps, start_positions=start, token_index=index,
                           pos_table=pos_table, inplace=inplace)
    angles, _, index, pos_table = read
    if torch.is_grad_enabled() and (x.requires_grad or (len(ts) > 1 and ts[1].requires_grad)):
        return record(ts, call, angles, start_positions=start, token_index=index, pos_table=pos_table,
                      inplace=inplace)
    # the call that records nothing, the hot path: straight to the launcher
    if len(ts) == 1:
        return (rotate(call, x, angles, start, index, False, inplace, pos_table),)
    return rotate_qk(call, x, ts[1], angles, start, index, False, inplace, pos_table)


def _by_reference(conv, ts, reads, flags, inplace) -> tuple:
    if inplace and len(ts) == 1 and leaf_written(ts[0], True):
        def rotate_leaf(t, backward):  # backward: the inverse rotation into a new tensor
            out = conv.reference((t,), reads, flags, backward)[0]
            return out if backward else t.copy_(out)
        return (write_leaf(ts[0], rotate_leaf),)
    outs = conv.reference(ts, reads, flags, False)
    if inplace:  # a reference that writes in place returns ts themselves
        return tuple(x if o is x else x.copy_(o) for x, o in zip(ts[:len(outs)], outs, strict=True))
    if conv.keep_order:  # the kernel path's memory order: `empty_like`'s (`Call.keep_order`)
        return tuple(_like(x, o) for x, o in zip(ts, outs, strict=True))
    return outs


def _like(x, out):
    """`out` with the strides of `empty_like(x)` (a copy where its own differ)."""
    if out.stride() == torch.empty_like(x, device="meta").stride():
        return out
    return torch.empty_like(x, dtype=out.dtype).copy_(out)


def _traced(conv, ts, reads, flags, inplace) -> tuple:
    """Traced code: the kernel as the custom op, differentiable through `Rotation` (`NormRotation`) where autograd
    records; in place, the mutating op, or, where autograd records, the op and a copy into ts."""
    # the angles and positions get no gradient (as in TransformerEngine's fused path)
    reads = tuple(None if r is None else r.detach() for r in reads)
    state = Traced(conv.name, reads, repr(flags))
    if conv.launch is None and torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        if conv.norm:
            if not inplace:  # in place (vLLM's op) records no graph, as eagerly
                return NormRotation.apply(state, *ts)
        else:
            outs = Rotation.apply(state, None, *ts)
            return tuple(x.copy_(o) for x, o in zip(ts, outs, strict=True)) if inplace else outs
    if inplace:
        rotate_op_(conv.name, list(ts), list(reads), state.flags)
        return ts[:2] if conv.norm else ts
    return tuple(rotate_op(conv.name, list(ts), list(reads), state.flags, False))


def _kernel(conv, ts, reads, flags, backward, inplace) -> tuple:
    """The custom op's body: the launch of `dispatch`'s kernel path, without autograd (the op is recorded inside
    `Rotation`). A `norm` convention's backward takes (grad_q, grad_k, q, k, q_weight, k_weight)."""
    if conv.launch is not None:
        conv.launch(ts, reads, flags)
        return ts
    if conv.norm:
        call = call_of(conv, ts[:2], reads, flags)
        angles, start, index, pos_table, norm, eps = conv.reads(call, reads, flags)
        if backward:
            gq, gk, q, k, wq, wk = ts
            gq, gk, gwq, gwk = _launch.norm_rotate_qk_backward(call, gq, gk, q, k, (wq, wk), norm, eps, angles, start,
                                                               index, pos_table)
            # a custom op's outputs may not alias one another: the weights' gradients are rows of one sum
            return gq, gk, gwq.clone(), gwk.clone()
        return _launch.norm_rotate_qk(call, ts[0], ts[1], ts[2:4], norm, eps, angles, start, index, pos_table,
                                      inplace)
    call = call_of(conv, ts, reads, flags)
    angles, start, index, pos_table = conv.reads(call, reads, flags)
    if len(ts) == 1:
        return (rotate(call, ts[0], angles, start, index, backward, inplace, pos_table),)
    return rotate_qk(call, *ts, angles, start, index, backward, inplace, pos_table)


# a traced call's flags as literals: parsed once per distinct string
_FLAGS = _memo.memo("flags of traced calls", 1024)


def _flags(text: str) -> tuple:
    flags = _FLAGS.get(text)
    if flags is None:
        flags = _FLAGS.put(text, ast.literal_eval(text))
    return flags


OP_NAME = "rope::rotate"


@torch.library.custom_op(OP_NAME, mutates_args=())
def rotate_op(convention: str, ts: list[torch.Tensor], reads: list[Optional[torch.Tensor]], flags: str,
              backward: bool) -> list[torch.Tensor]:
    return list(_kernel(CONVENTIONS[convention], tuple(ts), tuple(reads), _flags(flags), backward, False))


@rotate_op.register_fake
def _(convention, ts, reads, flags, backward):
    # new tensors of the rotated tensors' shapes and dtypes, as the kernel writes them: contiguous, or where the
    # convention keeps its input's memory order, `empty_like`'s (`_launch._like`); a norm convention's backward also
    # gives the weights' gradients
    conv = CONVENTIONS[convention]
    if conv.norm:
        return [ts[i].new_empty(ts[i].shape) for i in ((0, 1, 4, 5) if backward else (0, 1))]
    return [torch.empty_like(t) if conv.keep_order else t.new_empty(t.shape) for t in ts]


@torch.library.custom_op(OP_NAME + "_", mutates_args=("ts",))
def rotate_op_(convention: str, ts: list[torch.Tensor], reads: list[Optional[torch.Tensor]], flags: str) -> None:
    _kernel(CONVENTIONS[convention], tuple(ts), tuple(reads), _flags(flags), False, True)


@rotate_op_.register_fake
def _(convention, ts, reads, flags):
    return None
