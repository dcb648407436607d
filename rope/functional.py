"""TransformerEngine's convention: `apply_rotary_pos_emb`, q and k in one launch, and packed QKV."""
from __future__ import annotations

import torch

from . import reference
from ._backend import Call, Rotation, apply, checked_call, convention, dispatch, on_kernel_device
from ._checks import (
    check_bools,
    check_disjoint,
    check_inplace,
    check_pair,
    check_positions,
    check_static,
)
from ._launch import angles_for, rotate, table_angles, token_index_for
from ._request import Request
from .cache import RoPECache


def _read(call, freqs, cache, start_positions, cu_seqlens) -> tuple:
    """The value checks of a checked call, then what its launches read: (angles, token index, pos_table)."""
    if call.checks_values:
        check_positions(call.layout, call.tensor_format, start_positions, cu_seqlens, call.cp_size, call.cp_rank)
    angles = angles_for(call, freqs) if cache is None else table_angles(cache.cos, cache.sin, half=False)
    return (angles, *token_index_for(call, cu_seqlens))


def _use_reference(fused, t) -> bool:
    """fused=False asks for the reference; otherwise `rope._backend.on_kernel_device` decides (a t that is no tensor
    goes on to the kernel path's checks, which name it)."""
    return not fused or (isinstance(t, torch.Tensor) and not on_kernel_device(t))


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                         fused=True, cu_seqlens=None, cp_size=1, cp_rank=0, *, inplace=False):
    """Apply rotary position embedding to `t` (TransformerEngine 2.x semantics; docs/contract.md).

    t: [s, b, h, d] (sbhd), [b, s, h, d] (bshd) or [t, h, d] (thd), any strides.
    freqs: angles [s2, 1, 1, d2], d2 even and <= d; read as float32. Or a `rope.RoPECache`, whose cos/sin
    tables are read instead (also inside CUDA-graph captures, where no table of `freqs` is made).
    fused=True runs the Triton kernel (on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1);
    fused=False, or CPU tensors without the interpreter, run `rope.reference`.
    Returns a new contiguous tensor of t's shape and dtype; `t` is never modified. The gradient
    flows to `t` only (as in TransformerEngine's fused path, `freqs` gets none).
    inplace=True (not in TE) rotates `t` itself and returns it (race-free; marked dirty for autograd).
    """
    if not (isinstance(fused, bool) and isinstance(inplace, bool)):  # `fused` picks the path: checked first
        check_bools(fused=fused, inplace=inplace)
    if _use_reference(fused, t):
        # fused=True refuses float64 on every device, as the kernel does: a call's verdict never depends on it
        out = reference.checked_apply(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
                                      cp_rank, allow_float64=not fused)
        if inplace:
            check_inplace("t", t)
            return t.copy_(out)
        return out
    cache = freqs if isinstance(freqs, RoPECache) else None
    if cache is not None:
        if torch.compiler.is_compiling():  # traced: the reference's PyTorch operations on the tables
            return apply_rotary_pos_emb(t, freqs, tensor_format, start_positions, interleaved, False, cu_seqlens,
                                        cp_size, cp_rank, inplace=inplace)
        freqs = cache.as_freqs
    if torch.compiler.is_compiling():
        # Traced code: checks on shapes become guards, the launch an opaque custom op.
        check_static(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                     allow_float64=False)
        # freqs detached: the angles get no gradient, as in the eager kernel's call
        out = dispatch(TE, (t,), (freqs.detach(), start_positions, cu_seqlens),
                       (tensor_format, interleaved, cp_size, cp_rank))[0]
        return t.copy_(out) if inplace else out
    call = checked_call(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
    angles, token_index, pos_table = _read(call, freqs, cache, start_positions, cu_seqlens)
    if inplace:  # after the value checks, in the reference's order
        check_inplace("t", t)
    if t.requires_grad and torch.is_grad_enabled():  # a leaf was refused above
        return Rotation.apply(Request(call, angles, start_positions, token_index, pos_table, inplace),
                              "dirty" if inplace else None, t)[0]
    # The eager no-grad call, the hot path: straight to the launcher, no record built.
    return rotate(call, t, angles, start_positions, token_index, False, inplace, pos_table)


def _call(ts, reads, flags) -> Call:
    """TransformerEngine's checked signature: the same memo entry as `checked_call`'s (one key for both)."""
    freqs, start_positions, cu_seqlens = reads
    tensor_format, interleaved, cp_size, cp_rank = flags
    return checked_call(ts[0], freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)


def _reads(call, reads, flags) -> tuple:
    freqs, start_positions, cu_seqlens = reads
    return (angles_for(call, freqs), start_positions, *token_index_for(call, cu_seqlens))


def _reference(ts, reads, flags, backward) -> tuple:
    freqs, start_positions, cu_seqlens = reads
    tensor_format, interleaved, cp_size, cp_rank = flags
    return (reference.checked_apply(ts[0], freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
                                    cp_rank, False),)


TE = convention("te", _call, _reads, _reference)


def apply_rotary_pos_emb_qk(q, k, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                            cu_seqlens=None, cp_size=1, cp_rank=0, *, inplace=False):
    """Rotate q and k with the same angles in one launch; returns (q_out, k_out).

    q and k share format, tokens, head dim and dtype; their head counts may differ (GQA, MQA).
    Each group's angles are read and their sin/cos evaluated once for both tensors, and the
    backward computes both gradients in one launch too. Same semantics as two calls of
    `apply_rotary_pos_emb`; CPU tensors without the interpreter use the reference twice.
    """
    if not isinstance(inplace, bool):
        check_bools(inplace=inplace)
    check_pair(q, k, tensor_format)
    if _use_reference(True, q) or torch.compiler.is_compiling():
        for name, x in (("q", q), ("k", k)):  # the kernel path's static checks, naming q and k, not t
            check_static(x, freqs.as_freqs if isinstance(freqs, RoPECache) else freqs, tensor_format, start_positions,
                         interleaved, cu_seqlens, cp_size, cp_rank, allow_float64=False, name=name)
        kw = dict(tensor_format=tensor_format, start_positions=start_positions, interleaved=interleaved,
                  cu_seqlens=cu_seqlens, cp_size=cp_size, cp_rank=cp_rank)
        outs = apply_rotary_pos_emb(q, freqs, **kw), apply_rotary_pos_emb(k, freqs, **kw)
        if not inplace:
            return outs
        if not torch.compiler.is_compiling():  # both checked before either is written, as on the kernel path
            _check_inplace_qk(q, k)
        return q.copy_(outs[0]), k.copy_(outs[1])
    cache = freqs if isinstance(freqs, RoPECache) else None
    freqs = freqs if cache is None else cache.as_freqs
    call = checked_call(q, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank, "q")
    checked_call(k, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank, "k")
    angles, token_index, pos_table = _read(call, freqs, cache, start_positions, cu_seqlens)
    if inplace:
        _check_inplace_qk(q, k)
    return apply((q, k), call, angles, start_positions=start_positions, token_index=token_index, pos_table=pos_table,
                 inplace=inplace)


def _check_inplace_qk(q, k):
    check_inplace("q", q)
    check_inplace("k", k)
    check_disjoint(q, k)


def apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd",
                                   start_positions=None, interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """TransformerEngine's packed-QKV call: returns (q, k, v) from qkv [s, b, h, nq + nk + nv] (sbhd) or
    [b, s, h, nq + nk + nv] (bshd), (nq, nk, nv) = qkv_split_arg_list, nq a multiple of nk.

    As TE cuts it: each head's last dimension holds q, k and v; q's part is nq / nk heads of width nk.
    q is rotated by q_freqs ([.., h * nq / nk, nk]), k by k_freqs ([.., h, nk]), v is copied; all three
    are new contiguous tensors, and the gradient flows to qkv. `cu_seqlens` is accepted and unused, as
    in TE (thd is not a packed-QKV format). q_freqs/k_freqs may be `RoPECache`s.
    """
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(f"tensor_format: packed QKV supports 'sbhd' and 'bshd', got {tensor_format!r}")
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4:
        raise ValueError(f"qkv: expected a 4-D tensor, got {getattr(qkv, 'shape', type(qkv).__name__)}")
    try:
        nq, nk, nv = (int(n) for n in qkv_split_arg_list)
    except (TypeError, ValueError):
        raise ValueError(f"qkv_split_arg_list: expected three ints [nq, nk, nv], got {qkv_split_arg_list!r}") from None
    if min(nq, nk, nv) < 1 or nq % nk or nq + nk + nv != qkv.shape[-1]:
        raise ValueError(f"qkv_split_arg_list: expected positive [nq, nk, nv] with nq a multiple of nk and "
                         f"nq + nk + nv = qkv.shape[-1] = {qkv.shape[-1]}, got {list(qkv_split_arg_list)}")
    q, k, v = torch.split(qkv, [nq, nk, nv], dim=3)
    q = q.reshape(*qkv.shape[:2], qkv.shape[2] * nq // nk, nk)  # a view where nq == nk, else a copy
    if not torch.compiler.is_compiling():  # the messages name this signature's arguments, on every path
        for part, freqs in ((q, q_freqs), (k, k_freqs)):
            checked_call(part, freqs.as_freqs if isinstance(freqs, RoPECache) else freqs, tensor_format,
                         start_positions, interleaved, None, cp_size, cp_rank, "qkv",
                         "q_freqs" if part is q else "k_freqs")
    kw = dict(tensor_format=tensor_format, start_positions=start_positions, interleaved=interleaved,
              cp_size=cp_size, cp_rank=cp_rank)
    return (apply_rotary_pos_emb(q, q_freqs, **kw), apply_rotary_pos_emb(k, k_freqs, **kw),
            v.clone(memory_format=torch.contiguous_format))
