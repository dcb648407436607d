"""QK-RMSNorm + RoPE in TransformerEngine's layouts (spec/te_qknorm.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch

from . import rotate_half, row_rms

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def check_norm_args(q, k, q_weight, k_weight, eps, check_eps, flags):
    """The checks both QK-norm zoos make: q and k float, the bool flags ({name: value}), the weights [d], eps > 0
    (check_eps False: a planted bug that takes any eps)."""
    for name, x in (("q", q), ("k", k)):
        if x.dtype not in FLOATS:
            raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {x.dtype}")
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if not isinstance(w, torch.Tensor) or w.dtype not in FLOATS:
            raise TypeError(f"{name}: expected a float32, float16 or bfloat16 tensor")
        if tuple(w.shape) != (q.shape[-1],):
            raise ValueError(f"{name}: expected shape [{q.shape[-1]}], got {tuple(w.shape)}")
    if check_eps and not eps > 0:
        raise ValueError(f"eps: expected > 0, got {eps}")


def _check(q, k, q_weight, k_weight, freqs, tensor_format, cu_seqlens, eps, gemma, check_eps=True):
    check_norm_args(q, k, q_weight, k_weight, eps, check_eps, {"gemma": gemma})
    if freqs.shape[-1] > q.shape[-1]:
        raise ValueError(f"freqs: rotary width {freqs.shape[-1]} exceeds the head dim {q.shape[-1]}")
    if (cu_seqlens is not None) != (tensor_format == "thd"):
        raise ValueError("cu_seqlens: given exactly when tensor_format is 'thd'")


def _cp(j, length, cp_size, cp_rank):
    c = length // 2
    return torch.where(j < c, j + cp_rank * c, j - c + (2 * cp_size - 1 - cp_rank) * c) if cp_size > 1 else j


def positions(shape, fmt, start, cu, cp_size, cp_rank, restart=True, use_start=True, use_cp=True):
    """[b, s] (sbhd, bshd) or [T] (thd) int64 positions. The flags switch off a part (the planted bugs')."""
    cp = cp_size if use_cp else 1
    if fmt == "thd":
        local = [int(v) // cp_size for v in cu.tolist()]
        parts = []
        for i, (a, e) in enumerate(zip(local[:-1], local[1:], strict=True)):
            j = _cp(torch.arange(e - a), e - a, cp, cp_rank) + (0 if restart else a)
            parts.append(j + (int(start[i]) if start is not None and use_start else 0))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    s, b = (shape[0], shape[1]) if fmt == "sbhd" else (shape[1], shape[0])
    pos = _cp(torch.arange(s), s, cp, cp_rank)[None, :].expand(b, s)
    return pos + start.long().cpu()[:, None] if start is not None and use_start else pos


def _norm_rope(x, w, cos, sin, eps, interleaved, gemma, rms=None):
    xf = x.float()
    r = row_rms(xf, eps) if rms is None else rms(xf)
    a = xf * r * (w.float() + 1.0 if gemma else w.float())
    rot = cos.shape[-1]
    head = a[..., :rot]
    return torch.cat([head * cos + rotate_half(head, interleaved) * sin, a[..., rot:]], dim=-1).to(x.dtype)


def correct(q, k, q_weight, k_weight, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
            cu_seqlens=None, cp_size=1, cp_rank=0, eps=1e-6, gemma=False, _rms=None, _pos=None, _gemma=None,
            _check_eps=True, _heads=None):
    _check(q, k, q_weight, k_weight, freqs, tensor_format, cu_seqlens, eps, gemma, _check_eps)
    pos = positions(q.shape, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, **(_pos or {}))
    pos = pos.to(freqs.device)
    inside = ((pos >= 0) & (pos < freqs.shape[0]))[..., None]  # a position past freqs reads NaN, as a kernel's guard
    f = torch.where(inside, freqs[:, 0, 0, :].float()[pos.clamp(0, max(freqs.shape[0] - 1, 0))], float("nan"))
    if tensor_format == "sbhd":
        f = f.transpose(0, 1)
    cos, sin = f.cos().unsqueeze(-2), f.sin().unsqueeze(-2)
    g = gemma if _gemma is None else _gemma
    out = [_norm_rope(x, w, cos, sin, eps, interleaved, g, _rms) for x, w in ((q, q_weight), (k, k_weight))]
    if _heads is not None:
        out[1] = _heads(k, k_weight, cos, sin, eps, interleaved, g)
    return out[0], out[1]


def norm_over_rotated_only(*args, **kw):
    """The mean of x^2 over the rotary width only (partial rotary): the norm must span the head."""
    rot, eps = args[4].shape[-1], kw.get("eps", 1e-6)
    return correct(*args, **kw, _rms=lambda xf: torch.rsqrt(xf[..., :rot].square().mean(-1, keepdim=True) + eps))


def thd_positions_not_restarting(*args, **kw):
    """thd: the token's index in the packed batch as its position, not its index in its own sequence."""
    return correct(*args, **kw, _pos=dict(restart=False))


def start_positions_ignored(*args, **kw):
    """start_positions accepted and not added (a prefill-only kernel)."""
    return correct(*args, **kw, _pos=dict(use_start=False))


def cp_ignored(*args, **kw):
    """cp_size and cp_rank accepted, the local index used as the position (no dual-chunk layout)."""
    return correct(*args, **kw, _pos=dict(use_cp=False))


def gemma_ignored(*args, **kw):
    """w where Gemma's 1 + w is asked."""
    return correct(*args, **kw, _gemma=False)


def eps_unchecked(*args, **kw):
    """eps <= 0 accepted (a zero head then divides by zero instead of being refused)."""
    return correct(*args, **kw, _check_eps=False)


def k_weight_grad_one_head(*args, **kw):
    """k_weight's gradient from k's head 0 only (a reduction over tokens that forgot k's heads): forward right."""
    def heads(k, w, cos, sin, eps, interleaved, gemma):
        parts = [_norm_rope(k[..., i:i + 1, :], w if i == 0 else w.detach(), cos, sin, eps, interleaved, gemma)
                 for i in range(k.shape[-2])]
        return torch.cat(parts, dim=-2)

    return correct(*args, **kw, _heads=heads)


def math_depends_on_batch(q, k, q_weight, k_weight, freqs, tensor_format="sbhd", start_positions=None,
                          interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0, eps=1e-6, gemma=False):
    """One sequence sums its squares in float64, more in float32 (a decode path and a prefill path): each result
    within the norm's rounding, but a sequence's result depends on what else is in the call."""
    if tensor_format == "thd":
        one = cu_seqlens is not None and cu_seqlens.shape[0] <= 2
    else:
        one = q.shape[1 if tensor_format == "sbhd" else 0] <= 1

    def rms(xf):
        if not one:
            return torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        return torch.rsqrt(xf.double().square().mean(-1, keepdim=True) + eps).float()

    return correct(q, k, q_weight, k_weight, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size,
                   cp_rank, eps, gemma, _rms=rms)


CORRECT = correct
BUGS = {
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "norm_over_rotated_only": (norm_over_rotated_only, ("forward", "rotation_preserves_norm")),
    "thd_positions_not_restarting": (thd_positions_not_restarting, ("forward", "thd_equals_per_sequence")),
    "start_positions_ignored": (start_positions_ignored, ("start_positions_shift",)),
    "cp_ignored": (cp_ignored, ("cp_shards",)),
    "gemma_ignored": (gemma_ignored, ("forward", "rotation_preserves_norm")),
    "eps_unchecked": (eps_unchecked, ("refuses_bad_input",)),
    "k_weight_grad_one_head": (k_weight_grad_one_head, ("backward",)),
}
