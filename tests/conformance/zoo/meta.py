"""Meta's Llama convention (spec/meta.py): a correct implementation and planted bugs, each written in the
convention's own complex arithmetic (view_as_complex pairs times freqs_cis)."""
from __future__ import annotations

import torch

from . import channels_adjacent, rotate_half


def broadcast(freqs_cis):
    """freqs_cis [s, d/2] or [b or 1, s, d/2] -> [b or 1, s, 1, d/2], against x's [b, s, h, d/2] pairs."""
    return (freqs_cis[None] if freqs_cis.dim() == 2 else freqs_cis).unsqueeze(2)


def pairs(x, dtype=torch.float32):
    """x's channels (2i, 2i + 1) as complex numbers (x converted to `dtype` first, into new memory: view_as_complex
    needs even strides and offsets, which a padded view, even an empty one, may not have)."""
    x = x.to(dtype).clone(memory_format=torch.contiguous_format)
    return torch.view_as_complex(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2))


def rotated(x, f, out_dtype=None):
    """x's pairs times f in complex128, rounded once to the output. Not complex64: on the CPU PyTorch multiplies
    complex64 with other instructions in its vectorized loop than in its remainder, so an element's bits would
    follow its place in the tensor (rolling the batch moved 4 of 24 by up to 4 units in the last place), which
    batch invariance forbids."""
    product = pairs(x, torch.float64) * f.to(torch.complex128)
    return torch.view_as_real(product).flatten(-2).to(out_dtype or x.dtype)


def correct(xq, xk, freqs_cis):
    f = broadcast(freqs_cis)
    return rotated(xq, f), rotated(xk, f)


def math_depends_on_batch(xq, xk, freqs_cis):
    """One batch entry computes in complex128, a batch in complex64 (a kernel picking its path by the batch size):
    each result within one rounding, but an entry's result depends on what else is in the batch."""
    f = broadcast(freqs_cis)
    if xq.shape[0] == 1:
        return rotated(xq, f), rotated(xk, f)
    return tuple(torch.view_as_real(pairs(x) * f).flatten(-2).to(x.dtype) for x in (xq, xk))


def half_split_pairs(xq, xk, freqs_cis):
    """Pairs (i, i + d/2) (rotate_half, transformers' layout) instead of Meta's adjacent (2i, 2i + 1)."""
    f = broadcast(freqs_cis)
    c, s = (torch.cat([t, t], dim=-1) for t in (f.real, f.imag))
    return tuple((x.float() * c + rotate_half(x.float()) * s).to(x.dtype) for x in (xq, xk))


def conj_angle(xq, xk, freqs_cis):
    """Multiplies by conj(freqs_cis): every pair rotated by -theta."""
    f = broadcast(freqs_cis).conj()
    return rotated(xq, f), rotated(xk, f)


def k_first_batch_rows(xq, xk, freqs_cis):
    """xk reads the rows of batch entry 0 for every entry (per-token freqs_cis broadcast as if shared)."""
    f = broadcast(freqs_cis)
    return rotated(xq, f), rotated(xk, f[:1])


def per_token_ignored(xq, xk, freqs_cis):
    """Per-token freqs_cis [b, s, d/2] read as one shared table (its first entry) for xq and xk."""
    f = broadcast(freqs_cis)[:1]
    return rotated(xq, f), rotated(xk, f)


def k_not_rotated(xq, xk, freqs_cis):
    """xk returned as a copy (only xq rotated)."""
    return rotated(xq, broadcast(freqs_cis)), xk.clone()


def result_float32(xq, xk, freqs_cis):
    """The float32 product returned without type_as."""
    f = broadcast(freqs_cis)
    return rotated(xq, f, torch.float32), rotated(xk, f, torch.float32)


def x_rounded_to_bf16(xq, xk, freqs_cis):
    """x rounded to bfloat16 before the float32 product (a half-precision load)."""
    f = broadcast(freqs_cis)
    return tuple(torch.view_as_real(pairs(x.to(torch.bfloat16)) * f).flatten(3).to(x.dtype) for x in (xq, xk))


def freqs_rounded_to_x_dtype(xq, xk, freqs_cis):
    """cos and sin rounded to x's dtype before the product."""
    parts = torch.view_as_real(freqs_cis).to(xq.dtype).float()
    f = broadcast(torch.view_as_complex(parts.contiguous()))
    return rotated(xq, f), rotated(xk, f)


def sin_rows_shifted(xq, xk, freqs_cis):
    """The imaginary parts read one position late (the last row kept): an off-by-one in the sin table's row."""
    f = broadcast(freqs_cis)
    if f.shape[1] > 1:
        imag = torch.cat([f.imag[:, 1:], f.imag[:, -1:]], dim=1)
        f = torch.complex(f.real, imag)
    return rotated(xq, f), rotated(xk, f)


def per_token_first_position(xq, xk, freqs_cis):
    """Per-token freqs_cis [b, s, d/2] read as a decode step's [b, 1, d/2]: every token gets position 0's row."""
    f = broadcast(freqs_cis)
    if freqs_cis.dim() == 3:
        f = f[:, :1]
    return rotated(xq, f), rotated(xk, f)


class NotConjugated(torch.autograd.Function):
    """The backward multiplies the upstream gradient by the rows f (freqs_cis, or torchtitan's cache rows) instead
    of their conjugate."""

    @staticmethod
    def forward(ctx, x, f):
        ctx.save_for_backward(f)
        return rotated(x, f)

    @staticmethod
    def backward(ctx, g):
        (f,) = ctx.saved_tensors
        return rotated(g, f), None


def backward_not_conjugated(xq, xk, freqs_cis):
    f = broadcast(freqs_cis)
    return NotConjugated.apply(xq, f), NotConjugated.apply(xk, f)


def reshape_as_meta(xq, xk, freqs_cis):
    """Correct, written as Meta's reference writes it: x.float().reshape(*x.shape[:-1], -1, 2) cannot take s = 0
    (-1 is ambiguous for an empty tensor), so it declares empty=false: certified without the empty class. Its input
    is copied to a new dense tensor first: view_as_complex needs even strides and an even storage offset, which the
    model's own tensors have and a float32 view the suite draws may not (a contiguous one at an odd offset, on the
    device's draws)."""
    f = broadcast(freqs_cis)
    out = []
    for x in (xq, xk):
        pairs_ = torch.view_as_complex(x.float().clone(memory_format=torch.contiguous_format).reshape(
            *x.shape[:-1], -1, 2))
        out.append(torch.view_as_real(pairs_ * f).flatten(3).type_as(x))
    return tuple(out)


reshape_as_meta.rope_capabilities = {"empty": False}


def channels_read_as_adjacent(xq, xk, freqs_cis):
    """Reads xq's and xk's channels as adjacent (a kernel that takes the row strides and assumes dense channels):
    right wherever they are adjacent, wrong for a head whose last dim has another stride."""
    return correct(channels_adjacent(xq), channels_adjacent(xk), freqs_cis)


CORRECT = correct
BUGS = {
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "half_split_pairs": (half_split_pairs, ("forward", "pair_norms")),
    "conj_angle": (conj_angle, ("forward",)),
    "channels_read_as_adjacent": (channels_read_as_adjacent, ("forward",)),
    "k_first_batch_rows": (k_first_batch_rows, ("forward", "batch_entry_alone", "swap_q_k")),
    "per_token_ignored": (per_token_ignored, ("forward", "batch_entry_alone")),
    "k_not_rotated": (k_not_rotated, ("forward", "swap_q_k")),
    "result_float32": (result_float32, ("forward",)),
    "x_rounded_to_bf16": (x_rounded_to_bf16, ("forward",)),
    "freqs_rounded_to_x_dtype": (freqs_rounded_to_x_dtype, ("forward",)),
    "sin_rows_shifted": (sin_rows_shifted, ("forward", "pair_norms", "conj_undoes")),
    "per_token_first_position": (per_token_first_position, ("forward", "shared_rows_per_token")),
    "backward_not_conjugated": (backward_not_conjugated, ("backward",)),
}
