"""Deliberately broken implementations, each with TransformerEngine's signature and one real bug.

They are `rope.reference` with one thing changed, so that a check that fails on one of them fails
because of that bug. `perturbed` reproduces the reference's computation with optional hooks (it is
bitwise the reference when none is set: tests/test_suite_catches_bugs.py checks that), and
`CustomBackward` pairs a forward with a separately written backward, as kernels do.

Usable as a target: `pytest --rope-impl tests.broken_impls:backward_own_sine` should fail.
"""
from __future__ import annotations

import torch

from rope import reference
from rope._checks import check_positions, check_static
from rope.reference import partner_and_sign, token_positions


def perturbed(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=False,
              cu_seqlens=None, cp_size=1, cp_rank=0, *, positions=None, angle_dtype=None, trig_in_t_dtype=False,
              math_in_t_dtype=False, flip_sign=False, first_angle_of_pair=False, own_sine=False,
              drop_tail=False, round_down=False):
    """The reference's forward (own_sine=False) with hooks; backward through autograd.

    positions(layout, fmt, start, cu, cp_size, cp_rank, device) replaces `token_positions`; the result
    is clamped into freqs, as a kernel reading a wrong row would still read some row.
    """
    layout = check_static(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank,
                          allow_float64=True)
    check_positions(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    compute = torch.float64 if torch.float64 in (t.dtype, freqs.dtype) else torch.float32
    if math_in_t_dtype:
        compute = t.dtype
    d2 = layout.rot_dim
    angles = freqs[:, 0, 0, :].to(torch.float32 if freqs.dtype != torch.float64 else torch.float64)
    if angle_dtype is not None:
        angles = angles.to(angle_dtype).to(angles.dtype)
    if positions is None:
        pos = token_positions(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, t.device)
    else:
        pos = positions(layout, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, t.device)
        pos = pos.clamp(0, max(angles.shape[0] - 1, 0))
    f = angles[pos].to(compute)
    if tensor_format == "bshd":
        f = f.transpose(0, 1)
    f = f.unsqueeze(-2)
    x = t[..., :d2].to(compute)
    partner, sign = partner_and_sign(d2, interleaved, t.device)
    sign = sign.to(compute)
    if flip_sign:
        sign = -sign
    if first_angle_of_pair:  # assumes cat(theta, theta): reads one angle per pair
        f = f[..., torch.minimum(torch.arange(d2, device=t.device), partner)]
    cos, sin = torch.cos(f), torch.sin(f)
    if trig_in_t_dtype:  # TE's unfused path: cos and sin rounded to t.dtype before use
        cos, sin = cos.to(t.dtype).to(compute), sin.to(t.dtype).to(compute)
    if own_sine:  # the adjoint written with each element's own sine instead of its partner's
        rotated = x * cos - sign * x[..., partner] * sin
    else:
        rotated = x * cos + sign * x[..., partner] * sin
    rotated = _round_toward_zero(rotated, t.dtype) if round_down else rotated.to(t.dtype)
    tail = torch.zeros_like(t[..., d2:]) if drop_tail else t[..., d2:]
    return torch.cat([rotated, tail], dim=-1)


def _round_toward_zero(v, dtype):
    r = v.to(dtype)
    over = r.double().abs() > v.detach().double().abs()  # rounded away from zero: step back one ulp
    if dtype == v.dtype:  # nothing was rounded
        return r
    # On the bits, not with torch.nextafter: CUDA computes nextafter of 16-bit floats in float32 and
    # rounds back, which returns r unchanged. One less in the magnitude bits is one ulp toward zero
    # for either sign (r is nonzero wherever `over` holds, so no borrow reaches the sign bit).
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[r.element_size()]
    stepped = (r.view(bits) - 1).view(dtype)
    return torch.where(over, stepped, r)


def adjoint(g, freqs, kw, **hooks):
    """The exact backward: grad[k] = g[k] cos f[k] + sigma(pi(k)) g[pi(k)] sin f[pi(k)].

    Computed as the vector-Jacobian product of the (linear) reference forward at zero.
    """
    x = torch.zeros(g.shape, dtype=g.dtype, device=g.device, requires_grad=True)
    with torch.enable_grad():
        y = perturbed(x, freqs, **kw, **hooks)
        (grad,) = torch.autograd.grad(y, x, g)
    return grad


class CustomBackward(torch.autograd.Function):
    """forward(t) = fwd(t); backward(g) = bwd(g): a kernel pair with independently written halves."""

    @staticmethod
    def forward(ctx, t, fwd, bwd):
        ctx.bwd = bwd
        return fwd(t)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g), None, None


def _kw(tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank):
    return dict(tensor_format=tensor_format, start_positions=start_positions, interleaved=interleaved,
                cu_seqlens=cu_seqlens, cp_size=cp_size, cp_rank=cp_rank)


def _te_signature(fwd_hooks=None, bwd=None):
    """A TE-signature callable: forward = perturbed(**fwd_hooks); backward = bwd(g, freqs, kw) or autograd."""

    def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=True,
                             cu_seqlens=None, cp_size=1, cp_rank=0):
        kw = _kw(tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
        if bwd is None:
            return perturbed(t, freqs, **kw, **(fwd_hooks or {}))
        fwd = lambda x: perturbed(x.detach(), freqs, **kw, **(fwd_hooks or {}))  # noqa: E731
        return CustomBackward.apply(t, fwd, lambda g: bwd(g, freqs, kw))

    return apply_rotary_pos_emb


# ---- the bugs ------------------------------------------------------------------------------------


def _as_contiguous_memory(g):
    """g's memory read from its data pointer with contiguous strides (past its storage: zeros)."""
    avail = g.untyped_storage().nbytes() // g.element_size() - g.storage_offset()
    n = min(g.numel(), avail)
    flat = g.as_strided((n,), (1,), g.storage_offset())
    if n < g.numel():
        flat = torch.cat([flat, flat.new_zeros(g.numel() - n)])
    return flat.reshape(g.shape)


def _cp_chunks_swapped(layout, fmt, start, cu, cp_size, cp_rank, device):
    def pos(j, length):
        c = length // 2
        return torch.where(j < c, j + (2 * cp_size - 1 - cp_rank) * c, j - c + cp_rank * c)

    if fmt == "thd":
        lens = [int(v) // cp_size for v in cu.tolist()]
        parts = [pos(torch.arange(b - a, device=device), b - a) for a, b in zip(lens[:-1], lens[1:], strict=True)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
    return pos(torch.arange(layout.s, device=device), layout.s)[:, None].expand(layout.s, layout.b)


def _thd_global_positions(layout, fmt, start, cu, cp_size, cp_rank, device):
    """thd positions counted from the start of the packed tensor, not of each sequence."""
    pos = token_positions(layout, fmt, start, cu, cp_size, cp_rank, device)
    if fmt == "thd":
        first = token_positions(layout, fmt, None, cu, cp_size, cp_rank, device)
        pos = pos - first + torch.arange(pos.shape[0], device=device)
    return pos


def _off_by_one(layout, fmt, start, cu, cp_size, cp_rank, device):
    return token_positions(layout, fmt, start, cu, cp_size, cp_rank, device) + 1


def _start_by_nonempty_ordinal(layout, fmt, start, cu, cp_size, cp_rank, device):
    """thd: start_positions indexed by the sequence's rank among the non-empty sequences."""
    if fmt != "thd" or start is None:
        return token_positions(layout, fmt, start, cu, cp_size, cp_rank, device)
    lengths = (cu[1:] - cu[:-1]).tolist()
    nonempty = [q for q, n in enumerate(lengths) if n > 0]
    remapped = start.clone()
    for k, q in enumerate(nonempty):
        remapped[q] = start[k]
    return token_positions(layout, fmt, remapped, cu, cp_size, cp_rank, device)


def _wrapping(transform):
    """A TE-signature callable: transform(t, freqs, kw) -> output, kw holding the other arguments."""

    def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=True,
                             cu_seqlens=None, cp_size=1, cp_rank=0):
        return transform(t, freqs, _kw(tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank))

    return apply_rotary_pos_emb


def _overwrites_input(t, freqs, kw):
    out = reference.apply_rotary_pos_emb(t, freqs, **kw)
    with torch.no_grad():
        t.detach().copy_(out.detach())  # an in-place mode leaking into the out-of-place API
    return out


def _clamps_past_freqs(t, freqs, kw):
    """Positions past the end of freqs read its last row instead of raising."""
    padded = torch.cat([freqs, freqs[-1:].expand(4096, *freqs.shape[1:])]) if freqs.shape[0] else freqs
    return reference.apply_rotary_pos_emb(t, padded, **kw)


def _returns_float32(t, freqs, kw):
    """The float32 result returned without the final rounding to t.dtype."""
    return reference.apply_rotary_pos_emb(t.float(), freqs, **kw)


def _reads_input_as_contiguous(t, freqs, kw):
    return reference.apply_rotary_pos_emb(_as_contiguous_memory(t), freqs, **kw)


def _interleaved_ignored(t, freqs, kw):
    return reference.apply_rotary_pos_emb(t, freqs, **dict(kw, interleaved=False))


def _interleaved_sign_flipped(t, freqs, kw):
    return perturbed(t, freqs, **kw, flip_sign=kw["interleaved"])


def _with_tail_zeroed(fn):
    def bwd(g, freqs, kw):
        grad = fn(g, freqs, kw)
        d2 = freqs.shape[-1]
        return torch.cat([grad[..., :d2], torch.zeros_like(grad[..., d2:])], dim=-1)

    return bwd


def _ignore_start(g, freqs, kw):
    return adjoint(g, freqs, dict(kw, start_positions=None))


BROKEN = {
    # the bug classes of the issue
    "grad_read_as_contiguous": _te_signature(bwd=lambda g, f, kw: adjoint(_as_contiguous_memory(g), f, kw)),
    "backward_own_sine": _te_signature(bwd=lambda g, f, kw: perturbed(g, f, **kw, own_sine=True)),
    "forward_drops_pass_through": _te_signature({"drop_tail": True}, bwd=lambda g, f, kw: adjoint(g, f, kw)),
    "backward_drops_pass_through": _te_signature(bwd=_with_tail_zeroed(adjoint)),
    "interleaved_ignored": _wrapping(_interleaved_ignored),
    "interleaved_sign_flipped": _wrapping(_interleaved_sign_flipped),
    "backward_ignores_start_positions": _te_signature(bwd=_ignore_start),
    "cp_chunks_swapped": _te_signature({"positions": _cp_chunks_swapped}),
    "thd_positions_not_restarting": _te_signature({"positions": _thd_global_positions}),
    "cos_sin_rounded_to_t_dtype": _te_signature({"trig_in_t_dtype": True}),
    "angles_rounded_to_bf16": _te_signature({"angle_dtype": torch.bfloat16}),
    "overwrites_input": _wrapping(_overwrites_input),
    # bugs the issue does not name
    "reads_one_angle_per_pair": _te_signature({"first_angle_of_pair": True}),
    "positions_off_by_one": _te_signature({"positions": _off_by_one}),
    "thd_start_positions_skip_empty_sequences": _te_signature({"positions": _start_by_nonempty_ordinal}),
    "clamps_positions_past_freqs": _wrapping(_clamps_past_freqs),
    "math_in_t_dtype": _te_signature({"math_in_t_dtype": True}),
    "rounds_toward_zero": _te_signature({"round_down": True}),
    "returns_float32": _wrapping(_returns_float32),
    "reads_input_as_contiguous": _wrapping(_reads_input_as_contiguous),
}

# module-level names, so that `--rope-impl tests.broken_impls:<name>` works
globals().update(BROKEN)
