"""Argument checks of `rope.qknorm` (docs/contract.md, QK norm): everything is checked before anything is
written, each message starting with the argument's name; float64 is refused as on every kernel path."""
from __future__ import annotations

import math

import torch

from ._validate import (
    FLOAT_DTYPES,
    check_bools,
    check_disjoint,
    check_float_tensor,
    check_mrope_section,
    check_pair,
    check_positions,
    check_rotary_width,
    check_static,
    check_stream_positions,
    check_tables,
    check_token_positions,
    checked_call,
)

_SHAPES = {1: "[b, h, s, d]", 2: "[b, s, h, d]"}


def check_norm(q, q_weight, k_weight, eps, names=("q_weight", "k_weight")) -> None:
    """Weights [d] (d: q's head dim) of a float dtype on q's device; eps a finite number > 0."""
    d = q.shape[-1]
    for name, w in zip(names, (q_weight, k_weight), strict=True):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
        if w.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16, got {w.dtype}")
        if tuple(w.shape) != (d,):
            raise ValueError(f"{name}: expected shape [{d}] (the head dim), got {tuple(w.shape)}")
        if w.device != q.device:
            raise ValueError(f"{name}: expected the device of q ({q.device}), got {w.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps: expected a finite number > 0, got {eps!r}")


def check_table_call(q, k, q_weight, k_weight, cos, sin, eps, unsqueeze_dim, interleaved, gemma):
    """`rope.qknorm.apply`'s arguments; returns q and k as [b, s, h, d] views."""
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in _SHAPES:
        raise ValueError(f"unsqueeze_dim: expected 1 (q, k as {_SHAPES[1]}) or 2 ({_SHAPES[2]}), got {unsqueeze_dim!r}")
    check_bools(interleaved=interleaved, gemma=gemma)
    for name, x in (("q", q), ("k", k)):
        check_float_tensor(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor {_SHAPES[unsqueeze_dim]}, got shape {tuple(x.shape)}")
    qv, kv = (q.transpose(1, 2), k.transpose(1, 2)) if unsqueeze_dim == 1 else (q, k)
    check_pair(qv, kv, "bshd")
    check_norm(q, q_weight, k_weight, eps)
    check_tables(cos, sin, q, "q")
    b, s, _, d = qv.shape
    if cos.dim() != 3 or cos.shape[1] != s or cos.shape[0] not in (1, b):
        raise ValueError(f"cos: expected shape [b, s, rot] with b = {b} or 1, s = {s}, got {tuple(cos.shape)}")
    check_rotary_width(cos.shape[-1], d, "cos")
    return qv, kv


def check_freqs_call(q, k, q_weight, k_weight, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
                     cp_rank, eps, gemma, memo: bool):
    """`rope.qknorm.apply_freqs`'s arguments, in one order on every path: q and k (float64 refused), TransformerEngine's
    checks of each against freqs (angles [s2, 1, 1, rot]) naming q and k, gemma, the weights and eps, then the values
    of cu_seqlens and start_positions. Returns q's `Call` (`memo`: the memoised one of the kernel path) or Layout."""
    for name, x in (("q", q), ("k", k)):
        check_float_tensor(name, x)
    check_pair(q, k, tensor_format)
    args = (freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
    if memo:
        call = checked_call(q, *args, "q")
        checked_call(k, *args, "k")
        layout = call.layout
    else:
        call = layout = check_static(q, *args, allow_float64=False, name="q")
        check_static(k, *args, allow_float64=False, name="k")
    check_bools(gemma=gemma)
    check_norm(q, q_weight, k_weight, eps)
    check_positions(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    return call


def check_cache_call(q, k, q_weight, k_weight, positions, cache, eps, is_neox, gemma, names=("q", "positions"),
                     mrope=None):
    """q [T, hq, d], k [T, hk, d], positions [T], cos_sin_cache [max_position, rot]; returns (its cos half, its
    sin half, max_position, the kernel's streams). `names`: what the caller calls q and positions (vLLM: qkv,
    position_ids). `mrope`: (mrope_section, mrope_interleaved) of multimodal RoPE, positions [3, T] or [T]."""
    check_bools(is_neox=is_neox, gemma=gemma)
    section, mrope_interleaved = (None, False) if mrope is None else mrope
    if not isinstance(mrope_interleaved, bool):
        raise TypeError(f"mrope_interleaved: expected a bool, got {type(mrope_interleaved).__name__}")
    if section is None:
        if mrope_interleaved:
            raise ValueError("mrope_interleaved: expected False without mrope_section (it orders the sections)")
        if isinstance(positions, torch.Tensor) and positions.dim() == 2:
            raise ValueError(f"{names[1]}: shape {tuple(positions.shape)} holds position streams (multimodal "
                             f"RoPE, [3, T]): pass mrope_section, the rotary pairs per stream")
    for name, x in (("q", q), ("k", k)):
        check_float_tensor(name, x)
        if x.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor [T, h, d], got shape {tuple(x.shape)}")
    check_pair(q, k, "thd")
    check_norm(q, q_weight, k_weight, eps)
    if section is None:
        check_token_positions(positions, q.shape[0], q, names[0], names[1])
    else:
        check_stream_positions(positions, (q.shape[0],), q, names[0], names[1])
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2:
        raise ValueError(f"cos_sin_cache: expected shape [max_position, rotary_dim], got "
                         f"{getattr(cache, 'shape', type(cache).__name__)}")
    rows, rot = cache.shape
    check_rotary_width(rot, q.shape[-1], "cos_sin_cache")
    cos, sin = cache[:, :rot // 2], cache[:, rot // 2:]
    check_tables(cos, sin, q, names[0], ("cos_sin_cache", "cos_sin_cache"))
    streams = (0, 0, 0, 0) if section is None else check_mrope_section(section, rot // 2, mrope_interleaved)
    return cos, sin, rows, streams


def check_packed(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim):
    """vLLM's packed qkv [T, (hq + hk + hv) * head_dim]: (q, k) as [T, h, head_dim] views, checked disjoint."""
    for name, v, low in (("num_heads_q", num_heads_q, 1), ("num_heads_k", num_heads_k, 1),
                         ("num_heads_v", num_heads_v, 0), ("head_dim", head_dim, 2)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {v!r}")
    check_float_tensor("qkv", qkv)
    width = (num_heads_q + num_heads_k + num_heads_v) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv: expected shape [T, (num_heads_q + num_heads_k + num_heads_v) * head_dim] = "
                         f"[T, {width}], got {tuple(qkv.shape)}")
    if qkv.stride(1) != 1:
        raise ValueError(f"qkv: expected unit channel stride, got strides {tuple(qkv.stride())}")
    hd = head_dim
    q = qkv[:, :num_heads_q * hd].unflatten(1, (num_heads_q, hd))
    k = qkv[:, num_heads_q * hd:(num_heads_q + num_heads_k) * hd].unflatten(1, (num_heads_k, hd))
    check_disjoint(q, k, ("qkv", "qkv"))
    return q, k
