"""Meta's Llama convention: `apply_rotary_emb(xq, xk, freqs_cis)` (the reference code of Llama 2, 3 and 4 in
meta-llama/llama and meta-llama/llama-models; transformers' Llama 4 with freqs_cis gathered per token).

xq [b, s, h_q, d], xk [b, s, h_k, d], d even; freqs_cis complex64 [s, d/2] (one row per position, broadcast over
batch and heads as `reshape_for_broadcast` does) or [b or 1, s, d/2] (a row per token, gathered from
position ids). Channels (2i, 2i + 1) are the complex number x_2i + i x_2i+1 that `view_as_complex` gives; the
result is that number times freqs_cis[.., i], in float32, rounded once to each input's dtype (`type_as`).
"""
from __future__ import annotations

import torch

from . import reference
from ._apply import apply, kernel_runs
from ._launch import Angles
from ._validate import Call, Layout, call_for, check_float_tensor


def apply_rotary_emb(xq, xk, freqs_cis):
    """Meta's `apply_rotary_emb`: new tensors (xq's and xk's dtypes); the gradient flows to xq and xk, none to
    freqs_cis. complex128 freqs_cis is refused, as float64 is everywhere in rope."""
    check_heads_pair(xq, xk, ("xq", "xk"), 4, "[b, s, h, d]")
    b, s, _, d = xq.shape
    cos, sin = complex_tables(freqs_cis, xq, "xq")
    if cos.shape not in ((s, d // 2), (1, s, d // 2), (b, s, d // 2)):
        raise ValueError(f"freqs_cis: expected shape [s, d/2] = [{s}, {d // 2}] or [b or 1, s, d/2] = "
                         f"[{b} or 1, {s}, {d // 2}], got {tuple(freqs_cis.shape)}")
    if not kernel_runs(xq):
        full = [reference.full_width(t, True) for t in (cos, sin)]
        return tuple(reference.rotate(x, full[0].unsqueeze(-2), full[1].unsqueeze(-2), True) for x in (xq, xk))
    per_batch = cos.dim() == 3 and cos.shape[0] == b and b > 1
    angles = Angles(cos, sin, s, cos.stride(-2), cos.stride(0) if per_batch else 0, cos.stride(-1), True, True)
    key = ("meta", xq.shape, xq.stride(), xq.dtype, xq.device, xk.shape[2])
    call = call_for(key, lambda: Call(Layout(s, b, xq.shape[2], d, d, s, 0), "bshd", True, None, None, 1, 0))
    return apply((xq, xk), call, angles)


def check_heads_pair(q, k, names: tuple, ndim: int, shape: str) -> None:
    """q and k of one call, [..., heads, d] with `ndim` dims: float32/float16/bfloat16 tensors of one dtype and
    device, the same leading dims and an even head dim d; head counts may differ."""
    for name, x in zip(names, (q, k), strict=True):
        check_float_tensor(name, x)
        if x.dim() != ndim:
            raise ValueError(f"{name}: expected a {ndim}-D tensor {shape}, got shape {tuple(x.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"{names[1]}: expected the dtype of {names[0]} ({q.dtype}), got {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"{names[1]}: expected the device of {names[0]} ({q.device}), got {k.device}")
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{names[1]}: expected the tokens and head dim of {names[0]} (shape {tuple(q.shape)}, "
                         f"heads may differ), got shape {tuple(k.shape)}")
    if q.shape[-1] % 2 or q.shape[-1] == 0:
        raise ValueError(f"{names[0]}: rotary pairs are channels (2i, 2i + 1): expected an even head dim, got "
                         f"{q.shape[-1]}")


def complex_tables(freqs_cis, x, x_name: str, name: str = "freqs_cis"):
    """(cos, sin): the real and imaginary parts of complex64 `freqs_cis` as float32 views (stride 2 in
    `view_as_real`'s memory), no copy; a lazily conjugated or negated tensor is resolved first (one copy)."""
    if not isinstance(freqs_cis, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(freqs_cis).__name__}")
    if freqs_cis.dtype != torch.complex64:
        why = " (float64 math is refused on every path; convert with .to(torch.complex64))" \
            if freqs_cis.dtype == torch.complex128 else ""
        raise TypeError(f"{name}: expected dtype complex64 (torch.polar of float32 angles){why}, got "
                        f"{freqs_cis.dtype}")
    if freqs_cis.device != x.device:
        raise ValueError(f"{name}: expected the device of {x_name} ({x.device}), got {freqs_cis.device}")
    parts = torch.view_as_real(freqs_cis.resolve_conj().resolve_neg())  # each the tensor itself unless its bit is set
    return parts[..., 0], parts[..., 1]
