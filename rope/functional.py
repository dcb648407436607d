"""Public entry points: TransformerEngine's `apply_rotary_pos_emb`, and q and k in one launch."""
from __future__ import annotations

import torch

from . import _launch, _ops, reference
from ._launch import INTERPRET, make_plan, make_qk_plan, reads_positions, run
from ._table import cos_sin_table, token_positions
from ._validate import check_disjoint, check_inplace, check_pair, check_positions, check_static


class _Call:
    """What a call signature needs after its checks: the layout and the plans per direction/strides."""

    __slots__ = ("layout", "args", "checks_values", "reads_table", "reads_positions", "plans", "empty")

    def __init__(self, layout, tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank):
        self.layout = layout
        self.args = (tensor_format, interleaved, start_positions is not None, cp_size, cp_rank)
        self.checks_values = start_positions is not None or cu_seqlens is not None
        # Where a cos/sin table is faster than evaluating (BENCHMARKS.md, notes 11, 13 and 15):
        # half-split, every format, with or without start_positions (decode 2.06 -> 1.83 µs, thd
        # float32 80 -> 98 % of copy). Interleaved has no table tile.
        self.reads_table = not interleaved
        # thd without start_positions, with enough sequences that each program's search of
        # cu_seqlens takes several rounds: positions from a table (note 19: 93.5 -> 96.3 % of copy).
        self.reads_positions = reads_positions(tensor_format, start_positions is not None, layout.n_seqs)
        self.plans = {}
        self.empty = layout.s * layout.b * layout.h * layout.d == 0

    def plan(self, x, angles, backward, inplace=False, pos_table=False):
        # The call's key fixes x's strides where x is the call's own tensor (forward, and the custom
        # op's calls), not where it is a gradient. It fixes freqs.shape, hence the angle source's
        # shape; angles.stride() has 4 entries for `freqs` and 3 for its table, so it also tells the
        # two sources apart.
        key = (backward, inplace, pos_table, x.stride() if backward else None, x.data_ptr() % 16, angles.stride(),
               angles.data_ptr() % 16)
        plan = self.plans.get(key)
        if plan is None:
            fmt, interleaved, has_start, cp_size, cp_rank = self.args
            plan = make_plan(x, self.layout, fmt, interleaved, has_start, cp_size, cp_rank, angles,
                             backward, inplace, pos_table)
            self.plans[key] = plan
        return plan

    def qk_plan(self, q, k, k_heads, angles, backward, inplace=False, pos_table=False):
        key = ("qk", backward, inplace, pos_table, q.stride(), q.data_ptr() % 16, k.shape, k.stride(),
               k.data_ptr() % 16, angles.stride(), angles.data_ptr() % 16)
        plan = self.plans.get(key)
        if plan is None:
            fmt, interleaved, has_start, cp_size, cp_rank = self.args
            plan = make_qk_plan(q, k, self.layout, k_heads, fmt, interleaved, has_start, cp_size, cp_rank,
                                angles, backward, inplace, pos_table)
            self.plans[key] = plan
        return plan


_CALLS: dict = {}


def _index_key(x):
    return None if x is None else (x.shape, x.dtype, x.device, x.data_ptr() % 16)


def _call_for(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
              name="t") -> _Call:
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
                              cp_rank, allow_float64=False, name=name)
        call = _Call(layout, tensor_format, interleaved, start_positions, cu_seqlens, cp_size, cp_rank)
        if key is not None:
            _CALLS[key] = call
    return call


def angles_for(call, freqs):
    """What the kernel reads for the angles: the cached cos/sin table of `freqs` (`rope._table`),
    or, where no table may be used, `freqs` itself as float32 (the kernel then evaluates sin/cos)."""
    if call.reads_table:
        table = cos_sin_table(freqs, call.layout.freqs_len, call.layout.rot_dim)
        if table is not None:
            return table
    return freqs if freqs.dtype == torch.float32 else freqs.float()


def token_index_for(call, cu_seqlens):
    """What the kernel reads to place `thd` tokens, and whether it is the position table: the table
    cached per `cu_seqlens` (`rope._table`) where the call reads one and one may be used, else
    `cu_seqlens` itself, which each program searches."""
    if call.reads_positions:
        _, _, _, cp_size, cp_rank = call.args
        table = token_positions(cu_seqlens, call.layout.s, cp_size, cp_rank)
        if table is not None:
            return table, True
    return cu_seqlens, False


def _pointers(angles, start_positions, token_index):
    # Unused index tensors still need a valid pointer argument; the kernel never reads them.
    return angles, start_positions if start_positions is not None else angles, \
        token_index if token_index is not None else angles


def _rotate(call, x, angles, start_positions, token_index, backward, inplace=False, pos_table=False):
    if call.empty:
        return x if inplace else _launch.empty(x)
    plan = call.plan(x, angles, backward, inplace, pos_table)
    out = x if inplace else _launch.empty(x, plan.dense[0])
    run(plan, (x, out, *_pointers(angles, start_positions, token_index)))
    return out


def _rotate_qk(call, q, k, angles, start_positions, token_index, backward, inplace=False, pos_table=False):
    if not (q.numel() or k.numel()):
        return (q, k) if inplace else (_launch.empty(q), _launch.empty(k))
    plan = call.qk_plan(q, k, k.shape[-2], angles, backward, inplace, pos_table)
    qo = q if inplace else _launch.empty(q, plan.dense[0])
    ko = k if inplace else _launch.empty(k, plan.dense[1])
    run(plan, (q, qo, k, ko, *_pointers(angles, start_positions, token_index)))
    return qo, ko


class _RoPEFunction(torch.autograd.Function):
    """Autograd for one tensor. Everything but `t` comes as one `state` tuple (call, angles,
    start_positions, token_index, pos_table, inplace): autograd inspects every argument of `apply`,
    and none of these needs a gradient (freqs gets none, as in TE). With this and `_direct_apply`, a
    forward recording autograd went from 2.6-3.3 to 2.0-2.35 x the host cost of `clone` (BENCHMARKS.md,
    note 21)."""

    @staticmethod
    def forward(ctx, t, state):
        call, angles, start_positions, token_index, pos_table, inplace = state
        ctx.state = state
        out = _rotate(call, t, angles, start_positions, token_index, False, inplace, pos_table)
        if inplace:
            ctx.mark_dirty(t)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        call, angles, start_positions, token_index, pos_table, _ = ctx.state
        return _rotate(call, grad_out, angles, start_positions, token_index, True, False, pos_table), None


class _RoPEQKFunction(torch.autograd.Function):
    """Autograd for q and k in one launch; `state` as for `_RoPEFunction`."""

    @staticmethod
    def forward(ctx, q, k, state):
        call, angles, start_positions, token_index, pos_table, inplace = state
        ctx.state = state
        qo, ko = _rotate_qk(call, q, k, angles, start_positions, token_index, False, inplace, pos_table)
        if inplace:
            ctx.mark_dirty(q, k)
        return qo, ko

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        call, angles, start_positions, token_index, pos_table, _ = ctx.state
        gq, gk = _rotate_qk(call, grad_q, grad_k, angles, start_positions, token_index, True, False, pos_table)
        return gq, gk, None


def _direct_apply(function, n_tensors):
    """`function.apply` without the Python wrapper of `torch.autograd.Function.apply` (BENCHMARKS.md,
    note 21), which binds default arguments for a `setup_context` these Functions do not define,
    unwraps dead functorch wrappers, and then calls the C `apply` it inherits. The same steps here:
    the wrapper itself whenever a functorch transform is active (it then raises, as for any
    Function without `setup_context`), else the C `apply` on the tensors unwrapped the same way.
    Where this torch lacks any of those pieces, the wrapper."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    unwrap = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
    c_apply = getattr(super(torch.autograd.Function, function), "apply", None)
    if active is None or unwrap is None or c_apply is None:
        return function.apply
    if n_tensors == 1:
        def apply(t, state):
            return function.apply(t, state) if active() else c_apply(unwrap(t), state)
    else:
        def apply(q, k, state):
            return function.apply(q, k, state) if active() else c_apply(unwrap(q), unwrap(k), state)
    return apply


_rope_apply = _direct_apply(_RoPEFunction, 1)
_rope_qk_apply = _direct_apply(_RoPEQKFunction, 2)


def _use_reference(fused, t) -> bool:
    return not fused or (isinstance(t, torch.Tensor) and t.is_cpu and not INTERPRET)


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                         fused=True, cu_seqlens=None, cp_size=1, cp_rank=0, *, inplace=False):
    """Apply rotary position embedding to `t` (TransformerEngine 2.x semantics; see SPEC.md).

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
    call = _call_for(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
    if inplace:
        check_inplace("t", t)
    if call.checks_values:
        check_positions(call.layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    angles = angles_for(call, freqs)
    token_index, pos_table = token_index_for(call, cu_seqlens)
    if t.requires_grad and torch.is_grad_enabled():
        return _rope_apply(t, (call, angles, start_positions, token_index, pos_table, inplace))
    return _rotate(call, t, angles, start_positions, token_index, False, inplace, pos_table)


def apply_rotary_pos_emb_qk(q, k, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                            cu_seqlens=None, cp_size=1, cp_rank=0, *, inplace=False):
    """Rotate q and k with the same angles in one launch; returns (q_out, k_out).

    q and k share format, tokens, head dim and dtype; their head counts may differ (GQA, MQA).
    Each group's angles are read and their sin/cos evaluated once for both tensors, and the
    backward computes both gradients in one launch too. Same semantics as two calls of
    `apply_rotary_pos_emb`; CPU tensors without the interpreter use the reference twice.
    """
    if _use_reference(True, q) or torch.compiler.is_compiling():
        check_pair(q, k, tensor_format)
        kw = dict(tensor_format=tensor_format, start_positions=start_positions, interleaved=interleaved,
                  cu_seqlens=cu_seqlens, cp_size=cp_size, cp_rank=cp_rank, inplace=inplace)
        return apply_rotary_pos_emb(q, freqs, **kw), apply_rotary_pos_emb(k, freqs, **kw)
    check_pair(q, k, tensor_format)
    call = _call_for(q, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank, "q")
    _call_for(k, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank, "k")
    if inplace:
        check_inplace("q", q)
        check_inplace("k", k)
        check_disjoint(q, k)
    if call.checks_values:
        check_positions(call.layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    angles = angles_for(call, freqs)
    token_index, pos_table = token_index_for(call, cu_seqlens)
    if (q.requires_grad or k.requires_grad) and torch.is_grad_enabled():
        return _rope_qk_apply(q, k, (call, angles, start_positions, token_index, pos_table, inplace))
    return _rotate_qk(call, q, k, angles, start_positions, token_index, False, inplace, pos_table)
