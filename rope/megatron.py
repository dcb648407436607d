"""Megatron-LM's MLA training RoPE: `fused_mla_rope_inplace` and `fused_mla_rope_kv_split` as
`megatron.core.fusions.fused_mla_yarn_rope_apply` defines them (docs/contract.md sections 7h and 7i).

t: [s, b, h, nope_dim + emb_dim] (sbhd: cu_seqlens_q None) or [T, h, nope_dim + emb_dim] (thd: packed sequences,
cu_seqlens_q [n + 1]); cos, sin: [rows, 1, 1, emb_dim] or [rows, emb_dim], one column per rotated channel (Megatron's
rotary module gives cat(freqs, freqs), scaled by YaRN's mscale). The trailing emb_dim channels of each head are read
as pairs (2i, 2i + 1) and rotated by columns i and i + emb_dim/2 of the token's row p:
    left_i = x[2i] cos[p, i] - x[2i + 1] sin[p, i]      right_i = x[2i + 1] cos[p, i + emb/2] + x[2i] sin[p, i + emb/2]
written half-split (left_i at i, right_i at i + emb_dim/2), or, remove_interleaving=True, back where they were read
(left_i at 2i, right_i at 2i + 1). inverse=True negates sin. The leading nope_dim channels are neither read nor
written.

The row p of a token: sbhd, its s index (cp_rank and cp_size are not read: Megatron's sbhd callers pass tables already
sliced for their rank); thd with position_ids [T], position_ids[j]; thd without, its offset j in its sequence of
local length L (local bounds cu_seqlens_q // cp_size), mapped for cp_size > 1 by the dual-chunk (zigzag) layout,
j + (cp_rank L) // 2 for j < L // 2, else j - L // 2 + ((2 cp_size - cp_rank - 1) L) // 2; a row past the last
sequence (CUDA-graph padding) reads p = 0.

The KV split takes kv [..., h, k_dim + v_dim] and the one rope head k_pos_emb [..., 1, emb_dim] every head shares: it
rotates k_pos_emb by that map (no position_ids, no inverse) into a new tensor and assembles key = [kv's k_dim | rope]
on every head and value = kv's v_dim, as PyTorch copies around the one rotation.
"""
from __future__ import annotations

import torch

from . import reference
from ._backend import Call, check_once, convention, dispatch, write_leaf
from ._checks import (
    Layout,
    _rebasable,
    check_bools,
    check_float_tensor,
    check_index_tensor,
    check_inplace,
    check_output,
    check_own_memory,
    check_packed_values,
    check_positions_in,
    check_tables,
    check_token_positions,
)
from ._launch import table_angles
from ._table import _cached


def fused_mla_rope_inplace(t, cos, sin, nope_dim, emb_dim, cu_seqlens_q=None, cp_rank=0, cp_size=1,
                           rotary_interleaved=False, inverse=False, remove_interleaving=False, position_ids=None):
    """Megatron-LM's `fused_mla_rope_inplace` (see the module): t's trailing emb_dim channels rotated in place, read
    as interleaved pairs, written half-split (remove_interleaving=False) or interleaved; float32 math, one rounding
    to t's dtype, whatever the tables' dtype. Returns a tensor over t's memory: t itself, or, where autograd records
    and t is a leaf or a view it does not let be written in place, a new tensor over t's memory that carries the
    rotation's node, as Megatron's autograd Function returns it. The gradient flows to t (the transpose of the
    rotation on the trailing channels, the upstream gradient as it is on the leading ones); cos, sin and
    position_ids get none.

    As Megatron's: rotary_interleaved must be False, emb_dim a multiple of 4, t's head nope_dim + emb_dim wide, and
    position_ids only with cu_seqlens_q. Beyond it: any strides of t, the tables and position_ids; emb_dim / 2 need
    not be a power of two; positions are checked against the tables' rows (Megatron reads out of bounds). thd
    tokens read a position table derived from cu_seqlens_q (one small gather per new cu_seqlens_q, kept while it is
    unchanged); remove_interleaving and inverse read a copy of the tables reordered or negated (kept while they are
    unchanged): the kernel pairs a table's columns as it pairs the channels, so the copy is what lets
    remove_interleaving read columns (i, i + emb_dim/2) for channels (2i, 2i + 1), and inverse negate sin without
    the transpose that the kernel's own inverse takes."""
    seen = check_once("megatron.fused_mla_rope_inplace", _check, (t, cos, sin, cu_seqlens_q, position_ids),
                      (nope_dim, emb_dim, cp_rank, cp_size, rotary_interleaved, inverse, remove_interleaving))
    check_inplace("t", t.detach())  # its elements do not overlap; autograd's state is `_rotate`'s
    rows = cos.shape[0]
    if cu_seqlens_q is None:
        positions, fmt = None, "sbhd"
    elif position_ids is not None:
        check_positions_in(position_ids, rows, "position_ids", "cos")
        positions, fmt = position_ids, "thd"
    else:
        positions, fmt = _packed_positions("cu_seqlens_q", cu_seqlens_q, t.shape[0], cp_size, cp_rank, cos), "thd"
    return _rotate(t, nope_dim, (cos, sin, positions), (fmt, remove_interleaving, inverse, False), seen)


def _check(t, cos, sin, cu_seqlens_q, position_ids, nope_dim, emb_dim, cp_rank, cp_size, rotary_interleaved, inverse,
           remove_interleaving) -> None:
    """The static checks (`check_once`: once per signature), each naming the argument at fault."""
    check_float_tensor("t", t)
    _check_widths(nope_dim=nope_dim, emb_dim=emb_dim)
    _check_flags(emb_dim, cp_rank, cp_size, rotary_interleaved, inverse=inverse,
                 remove_interleaving=remove_interleaving)
    thd = cu_seqlens_q is not None
    if t.dim() != (3 if thd else 4):
        shape = "[T, h, nope_dim + emb_dim] (with cu_seqlens_q)" if thd else \
            "[s, b, h, nope_dim + emb_dim] (without cu_seqlens_q)"
        raise ValueError(f"t: expected {shape}, got shape {tuple(t.shape)}")
    if t.shape[-1] != nope_dim + emb_dim:
        raise ValueError(f"t: expected a head of nope_dim + emb_dim = {nope_dim + emb_dim} channels, got "
                         f"{t.shape[-1]}")
    _check_tables(cos, sin, t, "t", emb_dim)
    if not thd:
        if position_ids is not None:
            raise ValueError("position_ids: only valid with cu_seqlens_q (thd); an sbhd token's row is its s index")
        _check_rows(t.shape[0], cos)
        return
    _check_packed("cu_seqlens_q", cu_seqlens_q, t, "t")
    if position_ids is not None:
        check_token_positions(position_ids, t.shape[0], t, "t", "position_ids")


def fused_mla_rope_kv_split(kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens_kv=None, cp_rank=0, cp_size=1,
                            rotary_interleaved=False, remove_interleaving=False, out_key=None, out_value=None):
    """Megatron-LM's `fused_mla_rope_kv_split`: MLA's key and value from the up-projection's kv [..., h, k_dim + v_dim]
    and the one k_pos_emb head [..., 1, emb_dim] all heads share. Returns (key, value): key [..., h, k_dim + emb_dim],
    each head kv's leading k_dim channels then k_pos_emb rotated as `fused_mla_rope_inplace` rotates its trailing
    channels (read interleaved, written half-split, or interleaved with remove_interleaving; the token's row as
    there, without position_ids); value [..., h, v_dim], kv's trailing v_dim channels. New contiguous tensors in
    kv's dtype, or, with out_key and out_value (both or neither), written into them and those returned. The copies
    are bitwise; the rotation is float32 math with one rounding, in kv's dtype (k_pos_emb may have another).

    k_pos_emb is rotated once and broadcast over the heads: its gradient is the sum over the heads of their rope
    channels' upstream gradients (rounded once to kv's dtype, as Megatron's kernel rounds its float32 sum), taken
    through the rotation's transpose; kv's gradient is the upstream gradients of key's leading channels and of value
    side by side, bitwise. cos and sin get none.

    As Megatron's: rotary_interleaved must be False, emb_dim a multiple of 4, kv's head k_dim + v_dim wide, the out
    buffers of the result's shape and kv's dtype and not requiring grad. Beyond it: any strides of every tensor (out
    buffers included), k_dim, v_dim and emb_dim / 2 need not be powers of two, empty tensors, and every row checked
    against the tables' rows (Megatron reads out of bounds)."""
    seen = check_once("megatron.fused_mla_rope_kv_split", _check_kv,
                      (kv, k_pos_emb, cos, sin, cu_seqlens_kv, out_key, out_value),
                      (emb_dim, k_dim, v_dim, cp_rank, cp_size, rotary_interleaved, remove_interleaving))
    if out_key is not None:  # autograd's state and memory: on every call
        check_own_memory("out_key", out_key, {"kv": kv, "k_pos_emb": k_pos_emb})
        check_own_memory("out_value", out_value, {"kv": kv, "k_pos_emb": k_pos_emb, "out_key": out_key})
    if cu_seqlens_kv is None:
        positions, fmt = None, "sbhd"
    else:
        positions, fmt = _packed_positions("cu_seqlens_kv", cu_seqlens_kv, kv.shape[0], cp_size, cp_rank, cos), "thd"
    # the rotation in the wider of the two dtypes (float32 for two 16-bit ones), so that the one rounding is to kv's
    pe = k_pos_emb.to(torch.promote_types(k_pos_emb.dtype, kv.dtype))
    (rope,) = dispatch(MLA, (pe,), (cos, sin, positions), (fmt, remove_interleaving, False, False), seen=seen)
    # broadcast over the heads: autograd's backward of the expand is the sum over them
    rope = rope.to(kv.dtype).expand(*kv.shape[:-1], emb_dim)
    nope, value = kv[..., :k_dim], kv[..., k_dim:]
    if out_key is None:
        return torch.cat((nope, rope), -1).contiguous(), value.clone(memory_format=torch.contiguous_format)
    out_key[..., :k_dim].copy_(nope)
    out_key[..., k_dim:].copy_(rope)
    return out_key, out_value.copy_(value)


def _check_kv(kv, k_pos_emb, cos, sin, cu_seqlens_kv, out_key, out_value, emb_dim, k_dim, v_dim, cp_rank, cp_size,
              rotary_interleaved, remove_interleaving) -> None:
    """The KV split's static checks (`check_once`), each naming the argument at fault."""
    check_float_tensor("kv", kv)
    check_float_tensor("k_pos_emb", k_pos_emb)
    _check_widths(emb_dim=emb_dim, k_dim=k_dim, v_dim=v_dim)
    _check_flags(emb_dim, cp_rank, cp_size, rotary_interleaved, remove_interleaving=remove_interleaving)
    thd = cu_seqlens_kv is not None
    if kv.dim() != (3 if thd else 4):
        shape = "[T, h, k_dim + v_dim] (with cu_seqlens_kv)" if thd else "[s, b, h, k_dim + v_dim] (without " \
                                                                         "cu_seqlens_kv)"
        raise ValueError(f"kv: expected {shape}, got shape {tuple(kv.shape)}")
    if kv.shape[-1] != k_dim + v_dim:
        raise ValueError(f"kv: expected a head of k_dim + v_dim = {k_dim + v_dim} channels, got {kv.shape[-1]}")
    if k_pos_emb.device != kv.device:
        raise ValueError(f"k_pos_emb: expected the device of kv ({kv.device}), got {k_pos_emb.device}")
    pe_shape = (*kv.shape[:-2], 1, emb_dim)
    if tuple(k_pos_emb.shape) != pe_shape:
        raise ValueError(f"k_pos_emb: expected shape {pe_shape} (kv's tokens, one head of emb_dim channels shared by "
                         f"kv's heads), got {tuple(k_pos_emb.shape)}")
    _check_tables(cos, sin, kv, "kv", emb_dim)
    if thd:
        _check_packed("cu_seqlens_kv", cu_seqlens_kv, kv, "kv")
    else:
        _check_rows(kv.shape[0], cos)
    if (out_key is None) != (out_value is None):
        given, missing = ("out_key", "out_value") if out_value is None else ("out_value", "out_key")
        raise ValueError(f"{missing}: expected a buffer with {given} (both or neither, as Megatron's), got None")
    if out_key is not None:
        check_output("out_key", out_key, (*kv.shape[:-1], k_dim + emb_dim), kv, "kv")
        check_output("out_value", out_value, (*kv.shape[:-1], v_dim), kv, "kv")


def _packed_positions(name, cu_seqlens, n_tokens, cp_size, cp_rank, cos) -> torch.Tensor:
    """thd: each token's row from cu_seqlens (`sequence_positions`), its values checked against the tables."""
    positions = sequence_positions(cu_seqlens, n_tokens, cp_size, cp_rank)
    check_packed_values(cu_seqlens, positions, cos.shape[0], (name, "cos"))
    return positions


# The checks both front ends make alike.

def _check_widths(**widths) -> None:
    for name, value in widths.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")


def _check_flags(emb_dim, cp_rank, cp_size, rotary_interleaved, **flags) -> None:
    """emb_dim a positive multiple of 4, the flags bools, rotary_interleaved False (Megatron asserts both), and the
    context-parallel rank within its size."""
    if emb_dim == 0 or emb_dim % 4:
        raise ValueError(f"emb_dim: expected a positive multiple of 4 (Megatron's kernel asserts emb_dim % 4 == 0), "
                         f"got {emb_dim}")
    check_bools(rotary_interleaved=rotary_interleaved, **flags)
    if rotary_interleaved:
        raise ValueError("rotary_interleaved: only False is supported (Megatron's kernel asserts it; its pairs are "
                         "always read interleaved, see remove_interleaving)")
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size: expected an int >= 1, got {cp_size!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank: expected an int in [0, cp_size={cp_size}), got {cp_rank!r}")


def _check_tables(cos, sin, x, x_name: str, emb_dim: int) -> None:
    check_tables(cos, sin, x, x_name)
    if cos.dim() not in (2, 4) or cos.shape[-1] != emb_dim or (cos.dim() == 4 and cos.shape[1:3] != (1, 1)):
        raise ValueError(f"cos: expected shape [rows, 1, 1, emb_dim] or [rows, emb_dim] with emb_dim = {emb_dim}, "
                         f"got {tuple(cos.shape)}")


def _check_rows(s: int, cos) -> None:
    """sbhd: the tables hold a row for every s index."""
    if s > cos.shape[0]:
        raise ValueError(f"cos: too short: positions reach {s - 1} but cos has {cos.shape[0]} rows")


def _check_packed(name: str, cu_seqlens, x, x_name: str) -> None:
    check_index_tensor(name, cu_seqlens, x, x_name)
    if cu_seqlens.shape[0] < 1:
        raise ValueError(f"{name}: expected shape [n + 1] with n >= 0, got an empty tensor")


def sequence_positions(cu_seqlens, n_tokens: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The row of each of n_tokens packed tokens (int64 [n_tokens]), as the module says, kept per cu_seqlens tensor
    while it is unchanged (`rope._table`; built anew where no table may be kept: a CUDA-graph capture, a trace)."""
    if not torch.compiler.is_compiling():
        table = _cached(cu_seqlens, (id(cu_seqlens), "megatron-mla", n_tokens, cp_size, cp_rank), _position_table,
                        n_tokens, cp_size, cp_rank)
        if table is not None:
            return table
    return _position_table(cu_seqlens, n_tokens, cp_size, cp_rank)[1]


def _position_table(cu_seqlens, n_tokens, cp_size, cp_rank) -> tuple:
    """(memory, table) of `sequence_positions`, without host-device synchronization."""
    bounds = cu_seqlens.to(torch.int64) // cp_size  # each sequence's local bounds, as Megatron divides them
    tokens = torch.arange(n_tokens, dtype=torch.int64, device=cu_seqlens.device)
    n_seqs = bounds.shape[0] - 1
    if n_seqs == 0:  # no sequence: every token is padding
        table = torch.zeros_like(tokens)
        return table, table
    seq = torch.searchsorted(bounds, tokens, right=True) - 1  # the last sequence starting at or before the token
    inside = (seq >= 0) & (seq < n_seqs)
    seq = seq.clamp(0, n_seqs - 1)
    start = bounds[seq]
    length = bounds[seq + 1] - start
    j = tokens - start
    if cp_size > 1:
        half = length // 2
        j = torch.where(j < half, j + cp_rank * length // 2, j - half + (2 * cp_size - cp_rank - 1) * length // 2)
    table = torch.where(inside, j, 0)
    return table, table


def _rotate(t, nope_dim, reads, flags, seen):
    """t's trailing channels rotated in place; returns t, or the tensor over t's memory that carries the node. Where
    autograd records and the slice may be written in place (t is not a leaf, and autograd rebases views of it), the
    slice is marked dirty: t's own history then holds the rotation. Otherwise t is written unmarked, as Megatron's
    autograd Function writes it, and only the returned tensor holds it."""
    view = t[..., nope_dim:]
    if torch.is_grad_enabled() and t.requires_grad and (t.is_leaf or not (torch.compiler.is_compiling()
                                                                          or _rebasable(view))):
        return write_leaf(t, _unmarked(nope_dim, reads, flags))
    dispatch(MLA, (view,), reads, flags, inplace=True, seen=seen)
    return t


def _unmarked(nope_dim, reads, flags):
    """rotate(x, backward) for `write_leaf`: forward, x's trailing channels rotated in place; backward, a new tensor:
    the upstream gradient with its trailing channels taken through the transpose (the adjoint flag)."""
    adjoint = (*flags[:3], True)

    def rotate(x, backward):
        if backward:
            x = x.clone(memory_format=torch.contiguous_format)  # the upstream gradient is left as it is
        dispatch(MLA, (x[..., nope_dim:],), reads, adjoint if backward else flags, inplace=True)
        return x
    return rotate


# The convention on the back end. ts: the rope slice t[..., nope_dim:] ([s, b, h, emb] or [T, h, emb]); reads: (cos,
# sin, positions: None for sbhd, else one row per token); flags: (format, remove_interleaving, inverse, adjoint), the
# last the transpose (the gradient's map).


def _call(ts, reads, flags) -> Call:
    x, cos = ts[0], reads[0]
    fmt, remove_interleaving, _, adjoint = flags
    s, b = (x.shape[0], x.shape[1]) if fmt == "sbhd" else (x.shape[0], 1)
    emb = x.shape[-1]
    # Call.inverse runs the kernel's other direction: the transpose, permutation included (pairs read half-split and
    # written interleaved)
    return Call(Layout(s=s, b=b, h=x.shape[-2], d=emb, rot_dim=emb, freqs_len=cos.shape[0]), tensor_format=fmt,
                interleaved=remove_interleaving, permute=not remove_interleaving, inverse=adjoint)


def _reads(call, reads, flags) -> tuple:
    cos, sin, positions = reads
    remove_interleaving, inverse = flags[1], flags[2]
    cos_t, sin_t = _table(cos, remove_interleaving, False), _table(sin, remove_interleaving, inverse)
    if cos_t.stride() != sin_t.stride():
        cos_t, sin_t = cos_t.contiguous(), sin_t.contiguous()
    return table_angles(cos_t, sin_t, half=False), None, positions, positions is not None


def _table(tab, pairwise: bool, negate: bool) -> torch.Tensor:
    """The [rows, emb] table the kernel reads: tab's rows; `pairwise`, columns i and i + emb/2 side by side at 2i and
    2i + 1 (the kernel's interleaved pairs read columns 2i and 2i + 1); `negate`, negated. A copy is kept per table
    while it is unchanged."""
    if not (pairwise or negate):
        return _rows_of(tab)
    kept = _cached(tab, (id(tab), "megatron-mla", pairwise, negate), _derived, pairwise, negate)
    return kept if kept is not None else _derived(tab, pairwise, negate)[1]


def _rows_of(tab) -> torch.Tensor:
    """cos or sin as [rows, emb] (a view)."""
    return tab[:, 0, 0] if tab.dim() == 4 else tab


def _derived(tab, pairwise, negate) -> tuple:
    rows = _rows_of(tab.detach())
    if pairwise:
        half = rows.shape[-1] // 2
        rows = torch.stack((rows[:, :half], rows[:, half:]), -1).flatten(-2)
    out = -rows if negate else rows
    return out, out


def _reference(ts, reads, flags, backward) -> tuple:
    """The module's map (flags[3]: its transpose) on the rope slice, in float32 with one rounding to its dtype; the
    tables' rows gathered at each token's position (NaN outside them, as the kernel gives)."""
    x = ts[0]
    cos, sin, positions = reads
    fmt, remove_interleaving, inverse, adjoint = flags
    pos = torch.arange(x.shape[0], device=x.device) if positions is None else positions.long()
    cos, sin = (reference.rows_at(_rows_of(tab.detach()).float(), pos) for tab in (cos, sin))
    cos, sin = (tab[:, None, None] if fmt == "sbhd" else tab[:, None] for tab in (cos, sin))
    if inverse:
        sin = -sin
    half = x.shape[-1] // 2
    cl, cr, sl, sr = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    y = x.float()
    if adjoint:
        gl, gr = (y[..., 0::2], y[..., 1::2]) if remove_interleaving else (y[..., :half], y[..., half:])
        out = torch.stack((gl * cl + gr * sr, gr * cr - gl * sl), -1).flatten(-2)
    else:
        x1, x2 = y[..., 0::2], y[..., 1::2]
        left, right = x1 * cl - x2 * sl, x2 * cr + x1 * sr
        out = torch.stack((left, right), -1).flatten(-2) if remove_interleaving else torch.cat((left, right), -1)
    return (out.to(x.dtype),)


MLA = convention("megatron-mla", _call, _reads, _reference)

__all__ = ["fused_mla_rope_inplace", "fused_mla_rope_kv_split"]
