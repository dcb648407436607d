"""The kernel as a PyTorch custom op, for `torch.compile`: Dynamo cannot trace the cached direct launch.

`torch.ops.rope.rotate` is opaque, with a fake implementation (a new contiguous tensor). Its autograd is
`rope._apply.Rotation`, the node of every rotation, which traced code records around it (`_apply.apply_traced`):
the backward is the same op in the other direction. Eager calls skip the op: the dispatcher would add several
microseconds to every call.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _launch
from ._validate import checked_call

OP_NAME = "rope::rotate"


@torch.library.custom_op(OP_NAME, mutates_args=())
def rotate(x: torch.Tensor, freqs: torch.Tensor, start_positions: Optional[torch.Tensor],
           cu_seqlens: Optional[torch.Tensor], tensor_format: str, interleaved: bool, cp_size: int,
           cp_rank: int, backward: bool) -> torch.Tensor:
    call = checked_call(x, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
    token_index, pos_table = _launch.token_index_for(call, cu_seqlens)
    angles = _launch.angles_for(call, freqs)
    return _launch.rotate(call, x, angles, start_positions, token_index, backward, False, pos_table)


@rotate.register_fake
def _(x, freqs, start_positions, cu_seqlens, tensor_format, interleaved, cp_size, cp_rank, backward):
    return x.new_empty(x.shape)  # a new contiguous tensor of x's shape and dtype, as the kernel writes
