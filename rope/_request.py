"""What a rotation reads beside the rotated tensors, as one named record.

A convention's front end checks its signature (`rope._checks`) and hands `rope._backend.dispatch` its tensors and
flags; the back end finds the checked signature (`rope._backend.Call`) and what the kernel reads, and passes them to
`record` or `norm_rotate` by these names; where autograd records, the node keeps them as a `Request` for the backward.
A call that records nothing builds none: the launcher takes the values directly (a record costs more host time than
the launch path's own work).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._launch import Angles


class Request(NamedTuple):
    """One rotation: the checked signature, the angle source, the position source, in-place kind and, for QK norm
    fused with RoPE, the norm.

    `token_index`: what places the tokens beside the call's layout: `cu_seqlens` (thd, searched by each program), or,
    with `pos_table`, each token's position ([T], or [streams, s, b] in the kernel's roles; any strides)."""

    call: object  # rope._backend.Call: layout, flags and the launch plans of this signature
    angles: Angles  # the angles as the kernel reads them: cos/sin tables, or freqs
    start_positions: Optional[torch.Tensor] = None
    token_index: Optional[torch.Tensor] = None
    pos_table: bool = False
    inplace: bool = False
    norm: int = 0  # QK norm's form: 0 none, 1 RMSNorm(x) * w, 2 Gemma's RMSNorm(x) * (1 + w)
    eps: float = 0.0  # QK norm's epsilon
