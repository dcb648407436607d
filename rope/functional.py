"""TransformerEngine's convention: `apply_rotary_pos_emb`, q and k in one launch, and packed QKV."""
from __future__ import annotations

import torch

from . import reference
from ._backend import Call, checked_call, convention, dispatch
from ._checks import (
    check_bools,
    check_disjoint,
    check_inplace,
    check_pair,
    check_positions,
    check_static,
    te_layout,
)
from ._launch import angles_for, table_angles, token_index_for
from .cache import RoPECache


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
    flags = (tensor_format, interleaved, cp_size, cp_rank)
    if isinstance(freqs, RoPECache):
        reads = (freqs.as_freqs, start_positions, cu_seqlens, freqs.cos, freqs.sin)
    else:
        reads = (freqs, start_positions, cu_seqlens, None, None)
    if fused:  # the memoised checks (`_checked`, written out: the hot path of TransformerEngine's call)
        call = checked_call(t, reads[0], tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
        if start_positions is not None or cu_seqlens is not None:
            check_positions(call.layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    else:
        call = _checked((t,), ("t",), reads, flags, fused)
    if inplace:  # after the value checks, in the reference's order
        check_inplace("t", t)
    return dispatch(TE, (t,), reads, flags, inplace=inplace, fits=fused, call=call)[0]


def apply_rotary_pos_emb_qk(q, k, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                            cu_seqlens=None, cp_size=1, cp_rank=0, *, inplace=False):
    """Rotate q and k with the same angles in one launch; returns (q_out, k_out).

    q and k share format, tokens, head dim and dtype; their head counts may differ (GQA, MQA).
    Each group's angles are read and their sin/cos evaluated once for both tensors, and the
    backward computes both gradients in one launch too. Same semantics as two calls of
    `apply_rotary_pos_emb`; CPU tensors without the interpreter use the reference for each.
    """
    if not isinstance(inplace, bool):
        check_bools(inplace=inplace)
    check_pair(q, k, tensor_format)
    reads, flags = _arguments(freqs, start_positions, cu_seqlens, tensor_format, interleaved, cp_size, cp_rank)
    call = _checked((q, k), ("q", "k"), reads, flags, True)
    if inplace:  # both checked before either is written
        check_inplace("q", q)
        check_inplace("k", k)
        check_disjoint(q, k)
    return dispatch(TE, (q, k), reads, flags, inplace=inplace, call=call)


def _arguments(freqs, start_positions, cu_seqlens, tensor_format, interleaved, cp_size, cp_rank) -> tuple:
    """(reads, flags) of a TransformerEngine call: freqs (a `RoPECache`'s as [s2, 1, 1, d2]), the index tensors, and
    a cache's cos/sin tables (None for freqs)."""
    if isinstance(freqs, RoPECache):
        return ((freqs.as_freqs, start_positions, cu_seqlens, freqs.cos, freqs.sin),
                (tensor_format, interleaved, cp_size, cp_rank))
    return (freqs, start_positions, cu_seqlens, None, None), (tensor_format, interleaved, cp_size, cp_rank)


def _checked(ts, names, reads, flags, fused) -> Call:
    """Each of ts checked against the angles (named as the caller names it), then the values of the index tensors;
    returns the first one's checked signature (float64 t is accepted only with fused=False, the PyTorch path)."""
    freqs, start_positions, cu_seqlens = reads[0], reads[1], reads[2]
    tensor_format, interleaved, cp_size, cp_rank = flags
    if fused:
        call = checked_call(ts[0], freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                            names[0])
        if len(ts) > 1:
            checked_call(ts[1], freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                         names[1])
        layout = call.layout
    else:
        call = None
        layout = check_static(ts[0], freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                              allow_float64=True)
    if start_positions is not None or cu_seqlens is not None:
        check_positions(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    return call


def _call(ts, reads, flags) -> Call:
    """TransformerEngine's checked signature (`checked_call`: the memo's key of t, freqs and the index tensors)."""
    freqs, start_positions, cu_seqlens = reads[:3]
    tensor_format, interleaved, cp_size, cp_rank = flags
    return checked_call(ts[0], freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)


def _reads(call, reads, flags) -> tuple:
    freqs, start_positions, cu_seqlens, cos, sin = reads
    angles = angles_for(call, freqs) if cos is None else table_angles(cos, sin, half=False)
    return (angles, start_positions, *token_index_for(call, cu_seqlens))


def _reference(ts, reads, flags, backward) -> tuple:
    """`rope.reference`'s positions and tables (freqs read as float32 for a float32 or narrower t), per tensor."""
    freqs, start_positions, cu_seqlens, cos, sin = reads
    tensor_format, interleaved, cp_size, cp_rank = flags
    cache = None if cos is None else reference.Tables(cos, sin)
    layout = te_layout(ts[0], freqs, tensor_format, cu_seqlens)  # checked by the front end
    pos = reference.token_positions(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank,
                                    ts[0].device)
    return tuple(reference.rotate(x, *reference.token_tables(freqs, cache, pos, tensor_format, x.dtype), interleaved)
                 for x in ts)


TE = convention("te", _call, _reads, _reference)


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
    for part, freqs in ((q, q_freqs), (k, k_freqs)):  # the messages name this signature's arguments, on every path
        checked_call(part, freqs.as_freqs if isinstance(freqs, RoPECache) else freqs, tensor_format,
                     start_positions, interleaved, None, cp_size, cp_rank, "qkv", "q_freqs" if part is q else "k_freqs")
    kw = dict(tensor_format=tensor_format, start_positions=start_positions, interleaved=interleaved,
              cp_size=cp_size, cp_rank=cp_rank)
    return (apply_rotary_pos_emb(q, q_freqs, **kw), apply_rotary_pos_emb(k, k_freqs, **kw),
            v.clone(memory_format=torch.contiguous_format))
