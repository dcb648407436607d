"""TransformerEngine's convention in float64, written from the contract, independently of any implementation:
    apply_rotary_pos_emb(t, freqs, tensor_format, start_positions, interleaved, fused, cu_seqlens, cp_size, cp_rank)
Token positions follow docs/contract.md section 3 (the dual-chunk context-parallel layout, start_positions per
sequence, packed sequences restarting at 0); the angles are read as float32, as TE's kernel reads them, so the
oracle rotates by the float32 angles' exact cos and sin. The te convention (spec/te.py) defines its call with it,
and rope's own tests of its TE call (tests/rope) compare against it; it is differentiable in t.
"""
from __future__ import annotations

from .pairing import rotate
from .positions import token_positions


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=True,
                         cu_seqlens=None, cp_size=1, cp_rank=0):
    theta = freqs[:, 0, 0, :].float().double().to(t.device)
    pos = token_positions(t.shape, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, t.device)
    if tensor_format == "sbhd":
        pos = pos.t()  # [s, b]
    angle = theta[pos].unsqueeze(-2)  # [*tokens, 1, d2]
    return rotate(t.double(), angle.cos(), angle.sin(), interleaved)
