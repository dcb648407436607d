"""`RotaryPositionEmbedding`: builds the angle tensor that `apply_rotary_pos_emb` consumes."""
from __future__ import annotations

import math
from typing import Optional

import torch


def _check_number(name: str, value) -> None:
    """A real number > 0 and finite: a base or factor of 0, a negative one, inf or NaN gives angles of NaN or inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")


class RotaryPositionEmbedding(torch.nn.Module):
    """Angles theta_p,i = p * base^(-2i/dim') for positions p, as TransformerEngine builds them.

    forward(max_seq_len, offset=0) returns float32 [max_seq_len, 1, 1, dim'] with
    dim' = int(dim * rotary_percent), laid out as cat(theta, theta) (half-split) or
    [theta0, theta0, theta1, theta1, ...] (interleaved). Computed in float32 even under autocast.
    """

    def __init__(self, dim: int, rotary_percent: float = 1.0, seq_len_interpolation_factor: Optional[float] = None,
                 pretrained_max_position_embeddings: Optional[int] = None, rotary_base: float = 10000.0,
                 interleaved: bool = False, device=None):
        super().__init__()
        _check_number("rotary_base", rotary_base)
        _check_number("rotary_percent", rotary_percent)
        if seq_len_interpolation_factor is not None:
            _check_number("seq_len_interpolation_factor", seq_len_interpolation_factor)
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim: expected an int, got {type(dim).__name__}")
        if pretrained_max_position_embeddings is not None and (
                isinstance(pretrained_max_position_embeddings, bool) or
                not isinstance(pretrained_max_position_embeddings, int) or pretrained_max_position_embeddings < 1):
            raise ValueError(f"pretrained_max_position_embeddings: expected an int >= 1 or None, got "
                             f"{pretrained_max_position_embeddings!r}")
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim < 2 or dim % 2:
            raise ValueError(f"dim: the rotary width dim * rotary_percent must be even and >= 2, got {dim}")
        if not isinstance(interleaved, bool):
            raise TypeError(f"interleaved: expected a bool, got {type(interleaved).__name__}")
        self.dim = dim
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.interleaved = interleaved
        exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base ** exponent), persistent=False)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        # else torch.arange's own message, which names no argument (SymInt: a size traced by torch.compile)
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, (int, torch.SymInt)) or max_seq_len < 0:
            raise ValueError(f"max_seq_len: expected an int >= 0, got {max_seq_len!r}")
        with torch.autocast(device_type=self.inv_freq.device.type, enabled=False):
            seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
            pretrained, factor = self.pretrained_max_position_embeddings, self.seq_len_interpolation_factor
            if pretrained is not None and factor is not None:
                # TransformerEngine's rule: fixed linear scaling by `factor`, or, past the length the
                # scaled model has seen, dynamic scaling back into the pretrained range.
                if max_seq_len > pretrained * factor:
                    seq = seq * (1.0 / (max_seq_len / pretrained))
                else:
                    seq = seq * (1.0 / factor)
            theta = torch.outer(seq, self.inv_freq.float())  # [s, dim/2]
            if self.interleaved:
                emb = torch.stack((theta, theta), dim=-1).reshape(max_seq_len, self.dim)
            else:
                emb = torch.cat((theta, theta), dim=-1)
        return emb.reshape(max_seq_len, 1, 1, self.dim)
