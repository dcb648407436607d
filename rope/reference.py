"""Pure-PyTorch rotary position embedding: the oracle for the Triton kernels.

It follows docs/contract.md section 3 literally: positions per token, angles gathered per token, every
channel i < d2 combined with its partner pi(i) and sign sigma(i); the backward is autograd through the
same operations, the exact adjoint by construction. Angles are read as float32 (float64 for a float64 t),
arithmetic runs in float32 (float64 for float64 inputs), and the result is rounded once to t.dtype: on
`t.double()` with float32 angles it is the float64 oracle.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import check_positions, check_static


def partner_and_sign(rot_dim: int, interleaved: bool, device=None):
    """Index of each channel's partner and the sign sigma(i) of the partner's term (docs/contract.md section 3)."""
    i = torch.arange(rot_dim, device=device)
    if interleaved:
        partner = i ^ 1
        first = i % 2 == 0
    else:
        half = rot_dim // 2
        partner = (i + half) % rot_dim
        first = i < half
    sign = torch.where(first, -1.0, 1.0)
    return partner, sign


def cp_position(j: torch.Tensor, length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global position of local index j in a sequence of local length `length` (dual-chunk layout)."""
    if cp_size == 1:
        return j
    c = length // 2
    return torch.where(j < c, j + cp_rank * c, j - c + (2 * cp_size - 1 - cp_rank) * c)


def token_positions(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, device):
    """Position of every token: shape [s, b] for sbhd/bshd (in s, b roles), [t] for thd."""
    if tensor_format == "thd":
        cu = [int(v) // cp_size for v in cu_seqlens.tolist()]
        parts = []
        for q in range(len(cu) - 1):
            length = cu[q + 1] - cu[q]
            pos = cp_position(torch.arange(length, device=device), length, cp_size, cp_rank)
            if start_positions is not None:
                pos = pos + int(start_positions[q])
            parts.append(pos)
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
    s, b = layout.s, layout.b
    pos = cp_position(torch.arange(s, device=device), s, cp_size, cp_rank)[:, None].expand(s, b)
    if start_positions is not None:
        pos = pos + start_positions.to(device=device, dtype=torch.int64)[None, :]
    return pos


def rows_at(table, pos):
    """Rows `pos` of `table` [rows, ...]: a position outside the table (value checks off, docs/contract.md
    section 5) reads no row and gets NaN, as in the kernel, instead of an IndexError or, negative, a row
    counted from the end."""
    n = table.shape[0]
    inside = (pos >= 0) & (pos < n)
    if n == 0:
        return table.new_full((*pos.shape, *table.shape[1:]), float("nan"))
    rows = table[pos.clamp(0, n - 1)]
    return torch.where(inside.reshape(*pos.shape, *(1,) * (table.dim() - 1)), rows, float("nan"))


def rotate(t, cos, sin, interleaved):
    """t[..., :d2] rotated by per-channel cos/sin (broadcastable to it, d2 = their last size), the rest
    copied: channel i gets t_i cos_i + sigma(i) t_pi(i) sin_i. Arithmetic in float64 if t or the tables
    are float64, else float32; rounded once to t.dtype. Every convention's reference ends here.
    The gradient flows to t only: the angles get none, as on the kernel path (TransformerEngine's fused path)."""
    compute = torch.float64 if torch.float64 in (t.dtype, cos.dtype) else torch.float32
    cos, sin = cos.detach(), sin.detach()
    d2 = cos.shape[-1]
    x = t[..., :d2].to(compute)
    partner, sign = partner_and_sign(d2, interleaved, t.device)
    rotated = x * cos.to(compute) + sign.to(compute) * x[..., partner] * sin.to(compute)
    return torch.cat([rotated.to(t.dtype), t[..., d2:]], dim=-1)


def rotate_eager(t, cos, sin, interleaved):
    """`rotate` as the PyTorch expression `t * cos + rotate_half(t) * sin` runs eagerly in t's dtype: cos and sin
    rounded to it, then each product and the sum (the "eager" schedule; the partner's sign flip is exact)."""
    cos, sin = cos.detach().to(t.dtype), sin.detach().to(t.dtype)
    d2 = cos.shape[-1]
    x = t[..., :d2]
    partner, sign = partner_and_sign(d2, interleaved, t.device)
    rotated = x * cos + (sign.to(t.dtype) * x[..., partner]) * sin
    return torch.cat([rotated, t[..., d2:]], dim=-1)


def rotate_scheduled(t, cos, sin, interleaved, schedule):
    """`rotate` (None, "float32": its float32 operations are that schedule's) or `rotate_eager` ("eager")."""
    return (rotate_eager if schedule == "eager" else rotate)(t, cos, sin, interleaved)


def full_width(half_table, interleaved):
    """A table with one column per pair (flash-attention's, vLLM's) as one column per channel."""
    return half_table.repeat_interleave(2, dim=-1) if interleaved else torch.cat([half_table, half_table], dim=-1)


def _per_token(cos, sin, tensor_format):
    """Tables gathered per token ([s, b, d2] in (s, b) roles, or [t, d2]) in t's layout, broadcast over heads."""
    if tensor_format == "bshd":
        cos, sin = cos.transpose(0, 1), sin.transpose(0, 1)
    return cos.unsqueeze(-2), sin.unsqueeze(-2)


def rotate_rows(t, cos, sin, pos, tensor_format, interleaved):
    """`rotate` by rows `pos` (`token_positions`' shape) of full-width tables cos/sin [rows, d2]."""
    return rotate(t, *_per_token(rows_at(cos, pos), rows_at(sin, pos), tensor_format), interleaved)


def section_of_pair(mrope_section, pairs: int, mrope_interleaved: bool = False, device=None) -> torch.Tensor:
    """Multimodal RoPE: the position stream each rotary pair reads, as transformers and vLLM define it.
    Sections of mrope_section[m] consecutive pairs read stream m; interleaved (Qwen3-VL), pairs 1, 4, 7, ...
    below 3 * mrope_section[1] read stream 1, pairs 2, 5, 8, ... below 3 * mrope_section[2] stream 2,
    the others stream 0."""
    if not mrope_interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(list(mrope_section))).to(device)
    stream = torch.zeros(pairs, dtype=torch.int64)
    stream[1:3 * mrope_section[1]:3] = 1
    stream[2:3 * mrope_section[2]:3] = 2
    return stream.to(device)


def select_streams(tables, stream_of_pair, interleaved):
    """Per-channel tables [..., d2] out of one per stream [3, ..., d2]: channel i takes stream
    stream_of_pair[pair of i] (pairs (i, i + d2/2), or (2i, 2i + 1) interleaved)."""
    d2 = tables.shape[-1]
    channel = torch.arange(d2, device=tables.device)
    stream = stream_of_pair.to(tables.device)[channel // 2 if interleaved else channel % (d2 // 2)]
    return torch.where(stream == 0, tables[0], torch.where(stream == 1, tables[1], tables[2]))


def apply_multimodal_rotary_pos_emb(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                                    mrope_interleaved=False):
    """Reference of `rope.mrope.apply_multimodal_rotary_pos_emb` (the caller checks the arguments):
    positions [3, *lead] or [*lead] (lead: t's token dims), `freqs` [s2, 1, 1, d2] or a `rope.RoPECache`."""
    if hasattr(freqs, "as_freqs"):
        return multimodal_rotate(t, freqs.as_freqs, freqs.cos, freqs.sin, positions, mrope_section, interleaved,
                                 mrope_interleaved)
    return multimodal_rotate(t, freqs, None, None, positions, mrope_section, interleaved, mrope_interleaved)


def multimodal_rotate(t, freqs, cos, sin, positions, mrope_section, interleaved, mrope_interleaved):
    """`apply_multimodal_rotary_pos_emb` with the angles as freqs [s2, 1, 1, d2], or, where cos is given, the
    tables cos, sin [s2, d2] (a `rope.RoPECache`'s)."""
    lead = t.shape[:-2]
    pos = positions.long().expand(3, *lead)
    if cos is not None:
        cos, sin = rows_at(cos, pos), rows_at(sin, pos)
    else:
        f = rows_at(angles_as_read(freqs[:, 0, 0, :], t.dtype), pos)
        cos, sin = torch.cos(f), torch.sin(f)
    stream = section_of_pair(mrope_section, cos.shape[-1] // 2, mrope_interleaved)
    cos, sin = (select_streams(tab, stream, interleaved) for tab in (cos, sin))
    return rotate(t, cos.unsqueeze(-2), sin.unsqueeze(-2), interleaved)  # broadcast over heads


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                         fused=False, cu_seqlens=None, cp_size=1, cp_rank=0):
    """Reference implementation with the signature of `rope.apply_rotary_pos_emb` (`fused` is ignored);
    `freqs` may be a `rope.RoPECache`, whose cos/sin rows are then read instead of evaluated."""
    return checked_apply(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank, True)


def checked_apply(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                  allow_float64: bool):
    """`apply_rotary_pos_emb` with its arguments checked once, float64 `t` accepted only with `allow_float64` (the
    kernel path's rule where the reference runs in its place)."""
    cache = freqs if hasattr(freqs, "as_freqs") else None
    if cache is not None:
        freqs = cache.as_freqs
    layout = check_static(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
                          cp_rank, allow_float64=allow_float64)
    check_positions(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    pos = token_positions(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, t.device)
    return rotate(t, *token_tables(freqs, cache, pos, tensor_format, t.dtype), interleaved)


def angles_as_read(freqs: torch.Tensor, t_dtype: torch.dtype) -> torch.Tensor:
    """`freqs` as every path reads them (docs/contract.md section 2): float32, whatever their dtype, so that the
    kernel and this path give one verdict; float64 only for a float64 `t`, the oracle's own mode."""
    return freqs.to(torch.float64 if t_dtype == torch.float64 else torch.float32)


class Tables(NamedTuple):
    """cos and sin tables [s2, d2] as `token_tables` reads a `rope.RoPECache`'s."""

    cos: torch.Tensor
    sin: torch.Tensor


def token_tables(freqs, cache, pos, tensor_format, t_dtype=torch.float32):
    """cos and sin at each token's position `pos` (`token_positions`' shape), broadcast over heads: [s, b, 1, d2]
    in t's (s, b) roles, or [t, 1, d2] for thd. The rows of `cache` (a `rope.RoPECache`) where given, else sin/cos
    of freqs' rows ([s2, 1, 1, d2]) read as `angles_as_read` says for a `t` of `t_dtype`."""
    if cache is not None:
        return _per_token(rows_at(cache.cos, pos), rows_at(cache.sin, pos), tensor_format)
    f = rows_at(angles_as_read(freqs[:, 0, 0, :], t_dtype), pos)
    return _per_token(torch.cos(f), torch.sin(f), tensor_format)


def norm_rope(x, weight, eps, gemma, cos, sin, interleaved):
    """The PyTorch path (CPU, and traced by torch.compile): float32 RMSNorm over the head, the weight, then
    `rotate` by per-channel cos/sin broadcast against x[..., :rot]; one rounding to x's dtype."""
    xf = x.float()
    n = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if gemma else weight.float()
    return rotate(n * w, cos, sin, interleaved).to(x.dtype)


def torch_row_reduction(rows: int, d: int) -> tuple:
    """(threads per row, channels per load, the mean's factor) of PyTorch's CUDA reduction of a contiguous float32
    [rows, d] tensor over its last dim, as `x.pow(2).mean(-1)` runs it (ATen's Reduce.cuh, setReduceConfig and
    set_block_dimension, torch 2.10 and later: 512 threads a block; rows read as vectors of 4 from d = 128 on; the
    mean multiplies the sum by float32(rows) / float32(rows * d))."""
    vec = 4 if d >= 128 else 1
    width, rows = d // vec, max(rows, 1)
    width_pow2 = min(1 << (width.bit_length() - 1), 512)
    rows_pow2 = min(1 << (rows.bit_length() - 1), 512)
    height = min(rows_pow2, 512 // min(width_pow2, 32))
    f32 = torch.float32
    factor = (torch.tensor(float(rows), dtype=f32) / torch.tensor(float(rows * d), dtype=f32)).item()
    return min(width_pow2, 512 // height), vec, factor


def cuda_mean_of_squares(xf):
    """`xf.pow(2).mean(-1)` of float32 xf [..., d] in the order of PyTorch's CUDA kernels (`torch_row_reduction`
    for xf's rows): thread j of a row's `lanes` sums its channels (j, j + lanes, ...: the m-th into accumulator
    m % 4; vectorized, channel i of its vectors j, j + lanes, ... into accumulator i), then ((a0 + a1) + a2) + a3;
    the threads' sums are folded in half (lane j adds lane j + h, h = lanes / 2, ..., 1); times the factor. Each
    float32 addition here is one of PyTorch's, on any device."""
    d = xf.shape[-1]
    lanes, vec, factor = torch_row_reduction(xf.numel() // max(d, 1), d)
    steps = -(-d // (4 * lanes))
    sq = torch.nn.functional.pad(xf * xf, (0, steps * 4 * lanes - d))
    if vec == 4:  # column 4 (j + k lanes) + i
        parts = sq.unflatten(-1, (steps, lanes, 4)).movedim(-1, -2)  # [..., k, i, j]
    else:  # column j + (4 k + i) lanes
        parts = sq.unflatten(-1, (steps, 4, lanes))
    thread = torch.zeros_like(parts[..., 0, 0, :])
    for i in range(4):
        acc = torch.zeros_like(thread)
        for k in range(steps):
            acc = acc + parts[..., k, i, :]
        thread = thread + acc
    while thread.shape[-1] > 1:
        half = thread.shape[-1] // 2
        thread = thread[..., :half] + thread[..., half:]
    return thread[..., 0] * factor


def norm_rope_eager(x, weight, eps, gemma, cos, sin, interleaved):
    """`norm_rope`'s eager schedule: Qwen3RMSNorm (Gemma3RMSNorm with `gemma`) and transformers' rotation as eager
    PyTorch runs them on CUDA: the mean as `cuda_mean_of_squares`, `rsqrt`, Qwen3's `weight * (x * r).to(dtype)`
    or Gemma's `(x * r * (1 + weight.float())).to(dtype)`, then `rotate_eager` in x's dtype."""
    xf = x.float()
    h = xf * torch.rsqrt(cuda_mean_of_squares(xf).unsqueeze(-1) + eps)
    y = (h * (1.0 + weight.float())).to(x.dtype) if gemma else weight * h.to(x.dtype)
    return rotate_eager(y, cos, sin, interleaved)


def rotate_and_cache(q, k, v, key_cache, value_cache, slots, positions, cos, sin, interleaved, fp8=False, k_scale=None,
                     v_scale=None) -> None:
    """The definition of RoPE fused with the KV-cache write (`rope.serving`): q and k rotated in place at `positions`
    of the half tables cos, sin, then the rotated k and v stored at each token's slot (a slot outside the caches:
    not stored); fp8 caches hold x / scale in float32, saturated, rounded to nearest even, as vLLM converts."""
    full = [rows_at(full_width(tab, interleaved), positions.long()).unsqueeze(-2) for tab in (cos, sin)]
    for x in (q, k):
        x.copy_(rotate(x, *full, interleaved).to(x.dtype))
    n = slots.shape[0]
    slot = slots.long()
    keep = (slot >= 0) & (slot < key_cache.shape[0] * key_cache.shape[1])
    tokens = torch.arange(n, device=slot.device)[keep]
    slot = slot[keep]
    block, offset = slot // key_cache.shape[1], slot % key_cache.shape[1]
    for cache, x, scale in ((key_cache, k, k_scale), (value_cache, v, v_scale)):
        x = x[tokens]
        if fp8:
            x = (x.float() / scale.float()).clamp(-448.0, 448.0)
        cache[block, offset] = x.to(cache.dtype)
