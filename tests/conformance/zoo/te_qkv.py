"""TransformerEngine's packed-QKV convention (spec/te_qkv.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch

from . import rotate_half


def positions(s, b, start_positions, cp_size, cp_rank, device, second_chunk=None):
    """[b, s] int64 positions: the dual-chunk layout of cp_rank, then each sequence's start. `second_chunk`
    overrides the index of the rank's second chunk (a planted bug's)."""
    j = torch.arange(s, device=device)
    if cp_size > 1:
        c = s // 2
        second = 2 * cp_size - 1 - cp_rank if second_chunk is None else second_chunk
        j = torch.where(j < c, j + cp_rank * c, j - c + second * c)
    pos = j[None, :].expand(b, s)
    return pos if start_positions is None else pos + start_positions.long()[:, None]


def rotate(x, freqs, pos, tensor_format, interleaved, math=torch.float32):
    """x [s, b, h, n] (sbhd) or [b, s, h, n] rotated over its first d2 channels by freqs [s2, 1, 1, d2] (read as
    float32) at pos [b, s]; the math in `math`, one rounding; a new contiguous tensor."""
    f = freqs[:, 0, 0, :].float().to(math)[pos]  # [b, s, d2]
    if tensor_format == "sbhd":
        f = f.transpose(0, 1)
    f = f.unsqueeze(2)
    d2 = f.shape[-1]
    xr = x[..., :d2].to(math)
    out = (xr * f.cos() + rotate_half(xr, interleaved) * f.sin()).to(x.dtype)
    return torch.cat([out, x[..., d2:]], dim=-1).contiguous()


def parts(qkv, qkv_split_arg_list):
    nq, nk, nv = (int(n) for n in qkv_split_arg_list)
    q, k, v = torch.split(qkv, [nq, nk, nv], dim=3)
    return q.reshape(*qkv.shape[:2], qkv.shape[2] * nq // nk, nk), k, v


def seq_batch(qkv, tensor_format):
    return (qkv.shape[0], qkv.shape[1]) if tensor_format == "sbhd" else (qkv.shape[1], qkv.shape[0])


def correct(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd", start_positions=None,
            interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    q, k, v = parts(qkv, qkv_split_arg_list)
    pos = positions(*seq_batch(qkv, tensor_format), start_positions, cp_size, cp_rank, qkv.device)
    return (rotate(q, q_freqs, pos, tensor_format, interleaved), rotate(k, k_freqs, pos, tensor_format, interleaved),
            v.clone(memory_format=torch.contiguous_format))


def freqs_swapped(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd", start_positions=None,
                  interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """q rotated by k_freqs and k by q_freqs."""
    return correct(qkv, k_freqs, q_freqs, qkv_split_arg_list, tensor_format, start_positions, interleaved,
                   cu_seqlens, cp_size, cp_rank)


def v_rotated(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd", start_positions=None,
              interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """v rotated by k's angles as well (one loop over k and v), where it is wide enough."""
    q, k, v = correct(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions, interleaved,
                      cu_seqlens, cp_size, cp_rank)
    if v.shape[-1] < k_freqs.shape[-1]:
        return q, k, v
    pos = positions(*seq_batch(qkv, tensor_format), start_positions, cp_size, cp_rank, qkv.device)
    return q, k, rotate(v, k_freqs, pos, tensor_format, interleaved)


def split_q_v_k(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd", start_positions=None,
                interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """The last dimension cut as (q, v, k)."""
    nq, nk, nv = (int(n) for n in qkv_split_arg_list)
    q, v, k = torch.split(qkv, [nq, nv, nk], dim=3)
    q = q.reshape(*qkv.shape[:2], qkv.shape[2] * nq // nk, nk)
    pos = positions(*seq_batch(qkv, tensor_format), start_positions, cp_size, cp_rank, qkv.device)
    return (rotate(q, q_freqs, pos, tensor_format, interleaved), rotate(k, k_freqs, pos, tensor_format, interleaved),
            v.clone(memory_format=torch.contiguous_format))


def q_heads_group_major(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd", start_positions=None,
                        interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """q's heads ordered part-major (part g of every qkv head, then part g + 1), not head-major, where nq > nk."""
    q, k, v = correct(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions, interleaved,
                      cu_seqlens, cp_size, cp_rank)
    h, groups = qkv.shape[2], q.shape[2] // qkv.shape[2]
    q = q.reshape(*q.shape[:2], h, groups, q.shape[-1]).transpose(2, 3).reshape(q.shape).contiguous()
    return q, k, v


def k_ignores_start_positions(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd", start_positions=None,
                              interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """k's positions without the sequences' starts."""
    q, _, v = correct(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions, interleaved,
                      cu_seqlens, cp_size, cp_rank)
    _, k, _ = correct(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, None, interleaved, cu_seqlens,
                      cp_size, cp_rank)
    return q, k, v


def cp_second_chunk_wrong(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd", start_positions=None,
                          interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """The rank's second chunk taken as chunk cp_size + cp_rank (a plain split) instead of 2 cp_size - 1 - cp_rank
    (a position past the table reads its last row, as a kernel clamping its loads would)."""
    q, k, v = parts(qkv, qkv_split_arg_list)
    pos = positions(*seq_batch(qkv, tensor_format), start_positions, cp_size, cp_rank, qkv.device,
                    second_chunk=cp_size + cp_rank)
    qp, kp = (pos.clamp(max=f.shape[0] - 1) for f in (q_freqs, k_freqs))
    return (rotate(q, q_freqs, qp, tensor_format, interleaved), rotate(k, k_freqs, kp, tensor_format, interleaved),
            v.clone(memory_format=torch.contiguous_format))


def k_not_interleaved(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd", start_positions=None,
                      interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """k's pairs always half-split (the flag passed to q's launch only)."""
    q, _, v = correct(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions, interleaved,
                      cu_seqlens, cp_size, cp_rank)
    _, k, _ = correct(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions, False,
                      cu_seqlens, cp_size, cp_rank)
    return q, k, v


def v_without_gradient(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd", start_positions=None,
                       interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """v copied outside the graph: its part of qkv's gradient is zero (a backward that writes q's and k's only)."""
    q, k, v = correct(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions, interleaved,
                      cu_seqlens, cp_size, cp_rank)
    return q, k, v.detach().clone()


def k_rounds_in_float64(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd", start_positions=None,
                        interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """k's path evaluates in float64 (within the accuracy model, but not q's bits for the same inputs)."""
    q, k, v = parts(qkv, qkv_split_arg_list)
    pos = positions(*seq_batch(qkv, tensor_format), start_positions, cp_size, cp_rank, qkv.device)
    return (rotate(q, q_freqs, pos, tensor_format, interleaved),
            rotate(k, k_freqs, pos, tensor_format, interleaved, torch.float64),
            v.clone(memory_format=torch.contiguous_format))


def math_depends_on_batch(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format="sbhd", start_positions=None,
                          interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """A single sequence computes in float64, more in float32 (a kernel picking its path by the batch): each result
    within one rounding, forward and backward, but a sequence's q, k and gradient depend on what else is in the
    call."""
    q, k, v = parts(qkv, qkv_split_arg_list)
    s, b = seq_batch(qkv, tensor_format)
    pos = positions(s, b, start_positions, cp_size, cp_rank, qkv.device)
    math = torch.float64 if b == 1 else torch.float32
    return (rotate(q, q_freqs, pos, tensor_format, interleaved, math),
            rotate(k, k_freqs, pos, tensor_format, interleaved, math),
            v.clone(memory_format=torch.contiguous_format))


CORRECT = correct
BUGS = {
    "freqs_swapped": (freqs_swapped, ("forward",)),
    "v_rotated": (v_rotated, ("forward", "v_copied")),
    "split_q_v_k": (split_q_v_k, ("forward", "v_copied")),
    "q_heads_group_major": (q_heads_group_major, ("forward",)),
    "k_ignores_start_positions": (k_ignores_start_positions, ("forward", "start_positions_shift")),
    "cp_second_chunk_wrong": (cp_second_chunk_wrong, ("forward", "cp_shards")),
    "k_not_interleaved": (k_not_interleaved, ("forward", "q_k_agree")),
    "v_without_gradient": (v_without_gradient, ("backward",)),
    "k_rounds_in_float64": (k_rounds_in_float64, ("q_k_agree",)),
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
}
