"""Token positions of TransformerEngine's layouts (docs/contract.md section 3), written once for the suite: the TE
oracle, the packed-QKV convention and the adapters that turn TE's call into per-token positions use it."""
from __future__ import annotations

import torch


def token_positions(t_shape, tensor_format, start_positions=None, cu_seqlens=None, cp_size=1, cp_rank=0,
                    device=None) -> torch.Tensor:
    """int64 positions: [b, s] for sbhd/bshd (batch-major whatever the format), [T] for thd.

    Written from the contract, independently of the package under test: position j of a local sequence of L
    tokens, mapped by the dual-chunk layout when cp_size > 1, then shifted by start_positions[sequence].
    """
    if tensor_format == "thd":
        T = t_shape[0]
        local = cu_seqlens.detach().to("cpu", torch.int64) // cp_size
        x = torch.arange(T, dtype=torch.int64)
        seq = torch.searchsorted(local, x, right=True) - 1  # the last sequence starting at or before x
        j = x - local[seq]
        length = local[seq + 1] - local[seq]
    else:
        s, b = (t_shape[0], t_shape[1]) if tensor_format == "sbhd" else (t_shape[1], t_shape[0])
        j = torch.arange(s, dtype=torch.int64)[None, :].expand(b, s)
        seq = torch.arange(b, dtype=torch.int64)[:, None].expand(b, s)
        length = torch.full_like(j, s)
    if cp_size > 1:
        c = length // 2
        j = torch.where(j < c, j + cp_rank * c, j - c + (2 * cp_size - 1 - cp_rank) * c)
    if start_positions is not None:
        j = j + start_positions.detach().to("cpu", torch.int64)[seq]
    return j.contiguous().to(device)
