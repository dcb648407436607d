"""Rotary pairs and the float64 rotation, written once for every convention.

Half-split (rotate_half, GPT-NeoX, `is_neox`): channel i < r/2 pairs with i + r/2. Interleaved (GPT-J,
Meta's complex form): 2i pairs with 2i + 1. r is the rotary width; channels r.. are copied.
out_i = x_i cos_i + sign_i x_partner(i) sin_i, sign -1 on the first member of each pair, +1 on the second.
"""
from __future__ import annotations

import torch


def partner_and_sign(rot: int, interleaved: bool):
    i = torch.arange(rot)
    if interleaved:
        partner = i ^ 1
        sign = torch.where(i % 2 == 0, -1.0, 1.0)
    else:
        half = rot // 2
        partner = torch.where(i < half, i + half, i - half)
        sign = torch.where(i < half, -1.0, 1.0)
    return partner, sign.double()


def rotate(x, cos, sin, interleaved: bool):
    """x [..., d] rotated over its first r = cos.shape[-1] channels by per-channel cos/sin (broadcast against
    x[..., :r]); the rest copied. In float64 (x, cos and sin converted as given); differentiable."""
    x = x.double()
    rot = cos.shape[-1]
    partner, sign = partner_and_sign(rot, interleaved)
    head = x[..., :rot]
    out = head * cos.double() + sign.to(x.device) * head[..., partner.to(x.device)] * sin.double()
    return torch.cat([out, x[..., rot:]], dim=-1)


def per_channel(half, interleaved: bool):
    """A table with one column per pair [..., r/2] -> one per channel [..., r]."""
    return half.repeat_interleave(2, dim=-1) if interleaved else torch.cat([half, half], dim=-1)


def pair_scale(x, rot: int, interleaved: bool):
    """|x_i| + |x_partner(i)| on the rotated channels, 0 on the copied ones (float64): the accuracy scale."""
    a = x.detach().double().abs()
    partner, _ = partner_and_sign(rot, interleaved)
    scale = torch.zeros_like(a)
    scale[..., :rot] = a[..., :rot] + a[..., :rot][..., partner.to(a.device)]
    return scale


def copied_mask(d: int, rot: int, device=None):
    """True on the channels past the rotary width (compared bitwise)."""
    return torch.arange(d, device=device) >= rot
