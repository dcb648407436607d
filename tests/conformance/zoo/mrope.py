"""rope's canonical multimodal RoPE call (spec/mrope.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch


def stream_of_pair(section, pairs, mrope_interleaved, offsets=(1, 2)):
    if not mrope_interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(list(section)))
    stream = torch.zeros(pairs, dtype=torch.int64)
    for m, start in zip((1, 2), offsets, strict=True):
        stream[start:3 * section[m]:3] = m
    return stream


def angles_at(freqs, positions, lead, section, interleaved, mrope_interleaved, pair_of=None, first_row=False,
              stream_of=None):
    """Per-channel angles [*lead, 1, d2] (float32): channel c from the stream of its pair."""
    d2 = freqs.shape[-1]
    pos = positions.long()
    if pos.dim() == len(lead) or first_row:
        pos = (pos if pos.dim() == len(lead) else pos[0]).expand(3, *lead)
    table = freqs[:, 0, 0, :].float()[pos]  # [3, *lead, d2]
    channel = torch.arange(d2, device=freqs.device)
    pair = pair_of(channel, d2) if pair_of else (channel // 2 if interleaved else channel % (d2 // 2))
    if stream_of is None:
        stream = stream_of_pair(section, d2 // 2, mrope_interleaved).to(freqs.device)[pair]
    else:
        stream = stream_of(pair)
    picked = torch.where(stream == 0, table[0], torch.where(stream == 1, table[1], table[2]))
    return picked.unsqueeze(-2)


def rotate(t, theta, interleaved, math_dtype=torch.float32, tail=True):
    d2 = theta.shape[-1]
    x = t[..., :d2].to(math_dtype)
    if interleaved:
        partner = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    else:
        partner = torch.cat([-x[..., d2 // 2:], x[..., :d2 // 2]], dim=-1)
    out = (x * theta.cos().to(math_dtype) + partner * theta.sin().to(math_dtype)).to(t.dtype)
    return torch.cat([out, t[..., d2:] if tail else torch.zeros_like(t[..., d2:])], dim=-1)


def correct(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False, mrope_interleaved=False):
    theta = angles_at(freqs, positions, t.shape[:-2], mrope_section, interleaved, mrope_interleaved)
    return rotate(t, theta, interleaved)


def math_depends_on_batch(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                          mrope_interleaved=False):
    """A call of a single token computes in float64, more tokens in float32 (a kernel picking its path by the token
    count, as decode and prefill paths do; by the count, not the batch, so that every format of one set of tokens
    takes one path): each result within one rounding, forward and backward, but a token's result depends on what
    else is in the call."""
    theta = angles_at(freqs, positions, t.shape[:-2], mrope_section, interleaved, mrope_interleaved)
    return rotate(t, theta, interleaved, torch.float64 if t.shape[:-2].numel() == 1 else torch.float32)


def first_row_positions(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                        mrope_interleaved=False):
    """A [3, *lead] positions tensor read as its first row (text RoPE on every token)."""
    theta = angles_at(freqs, positions, t.shape[:-2], mrope_section, interleaved, mrope_interleaved, first_row=True)
    return rotate(t, theta, interleaved)


def pair_ignores_interleaved(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                             mrope_interleaved=False):
    """The stream of channel c taken from pair c mod d2/2 whatever the pairing (GPT-J pairs split apart)."""
    theta = angles_at(freqs, positions, t.shape[:-2], mrope_section, interleaved, mrope_interleaved,
                      pair_of=lambda c, d2: c % (d2 // 2))
    return rotate(t, theta, interleaved)


def sections_first_half_only(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                             mrope_interleaved=False):
    """The sections over the first d2/2 channels, stream 0 beyond (the section list not doubled)."""
    theta = angles_at(freqs, positions, t.shape[:-2], mrope_section, interleaved, mrope_interleaved,
                      pair_of=lambda c, d2: torch.where(c < d2 // 2, c // 2 if interleaved else c, 0))
    return rotate(t, theta, interleaved)


def pair_index_mod_3(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                     mrope_interleaved=False):
    """Qwen3-VL's interleaving on every pair and both layouts: pair k reads stream k % 3."""
    theta = angles_at(freqs, positions, t.shape[:-2], mrope_section, interleaved, mrope_interleaved,
                      stream_of=lambda pair: pair % 3)
    return rotate(t, theta, interleaved)


def tail_zeroed(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False, mrope_interleaved=False):
    """Channels past d2 not copied (an output from zeros, written over the rotary width only)."""
    theta = angles_at(freqs, positions, t.shape[:-2], mrope_section, interleaved, mrope_interleaved)
    return rotate(t, theta, interleaved, tail=False)


def math_in_input_dtype(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                        mrope_interleaved=False):
    """cos/sin rounded to t's dtype and the products in it: several 16-bit roundings."""
    theta = angles_at(freqs, positions, t.shape[:-2], mrope_section, interleaved, mrope_interleaved)
    return rotate(t, theta, interleaved, t.dtype)


def positions_batch_major(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                          mrope_interleaved=False):
    """sbhd's positions [3, s, b] read as if they were [3, b, s] (their memory reinterpreted)."""
    lead = t.shape[:-2]
    if tensor_format == "sbhd":
        positions = positions.reshape(*positions.shape[:-2], lead[1], lead[0]).transpose(-1, -2)
    return correct(t, freqs, positions, mrope_section, tensor_format, interleaved, mrope_interleaved)


class _SelfAdjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, theta, interleaved):
        ctx.save_for_backward(theta)
        ctx.interleaved = interleaved
        return rotate(t, theta, interleaved)

    @staticmethod
    def backward(ctx, g):
        (theta,) = ctx.saved_tensors
        return rotate(g, theta, ctx.interleaved), None, None  # R, not its transpose


def backward_not_transposed(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                            mrope_interleaved=False):
    """The backward applies the rotation itself instead of its transpose."""
    theta = angles_at(freqs, positions, t.shape[:-2], mrope_section, interleaved, mrope_interleaved)
    return _SelfAdjoint.apply(t, theta, interleaved)


CORRECT = correct
BUGS = {
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "first_row_positions": (first_row_positions, ("forward",)),
    "pair_ignores_interleaved": (pair_ignores_interleaved, ("forward",)),
    "sections_first_half_only": (sections_first_half_only, ("forward",)),
    "pair_index_mod_3": (pair_index_mod_3, ("forward",)),
    "tail_zeroed": (tail_zeroed, ("forward",)),
    "math_in_input_dtype": (math_in_input_dtype, ("forward",)),
    "positions_batch_major": (positions_batch_major, ("forward", "formats")),
    "backward_not_transposed": (backward_not_transposed, ("backward",)),
}
