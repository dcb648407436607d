"""Launcher: turns a checked call into a grid and kernel arguments, cached per call signature.

Everything derived from shapes, strides and flags is computed once per signature and kept in
`_PLANS`; a repeated call only builds the key, allocates the output and launches.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton

from ._kernel import rope_kernel
from ._validate import Layout

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Elements of x one program touches per loop iteration. 2048 bf16 elements over 4 warps is
# 16 elements (two 16-byte vectors) per thread per load: enough bytes in flight per SM to cover
# HBM latency without spilling.
_TILE_ELEMS = 2048
# Programs wanted per SM before a group's rows are split over several programs.
_PROGRAMS_PER_SM = 8


class Plan(NamedTuple):
    grid: tuple
    ints: tuple  # the kernel's integer arguments, in order
    out_strides: tuple
    constexprs: dict
    num_warps: int


_PLANS: dict = {}
# Output allocator; tests replace it with one that fills NaN, to prove every element is written.
empty = torch.empty
_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one at a time: fewer, larger programs are faster
    n = _SM_COUNT.get(device.index)
    if n is None:
        n = torch.cuda.get_device_properties(device).multi_processor_count
        _SM_COUNT[device.index] = n
    return n


def _cdiv(a, b):
    return -(-a // b)


def make_plan(x: torch.Tensor, layout: Layout, tensor_format: str, interleaved: bool, has_start: bool,
              cp_size: int, cp_rank: int, freqs_stride: tuple, backward: bool) -> Plan:
    s, b, h, d, d2 = layout.s, layout.b, layout.h, layout.d, layout.rot_dim
    st = x.stride()
    if tensor_format == "sbhd":
        xs, xb, xh, xd = st
        os_, ob, oh = b * h * d, h * d, d
    elif tensor_format == "bshd":
        xb, xs, xh, xd = st
        os_, ob, oh = h * d, s * h * d, d
    else:
        xs, xh, xd = st
        xb = 0
        os_, ob, oh = h * d, 0, d
    is_thd = tensor_format == "thd"
    per_batch = has_start and not is_thd
    rows_per_group = h if (per_batch or is_thd) else b * h
    n_groups = s * b if per_batch else s

    block_half = triton.next_power_of_2(d2 // 2)
    block_tail = triton.next_power_of_2(d - d2) if d > d2 else 0
    width = 2 * block_half + block_tail
    block_r = max(1, min(triton.next_power_of_2(rows_per_group), _TILE_ELEMS // width))
    num_warps = max(1, min(8, block_r * width // 512))

    target = _PROGRAMS_PER_SM * _sm_count(x.device)
    splits = 1
    if n_groups < target:
        splits = min(_cdiv(target, max(n_groups, 1)), _cdiv(rows_per_group, block_r))
    rows_per_program = _cdiv(_cdiv(rows_per_group, splits), block_r) * block_r
    splits = _cdiv(rows_per_group, rows_per_program)

    ints = (h, b, rows_per_group, rows_per_program, s, layout.n_seqs, layout.freqs_len, cp_size, cp_rank,
            xs, xb, xh, xd, os_, ob, oh, freqs_stride[0], freqs_stride[3])
    constexprs = dict(
        HEAD_DIM=d, ROT_DIM=d2, INTERLEAVED=interleaved, BACKWARD=backward, IS_THD=is_thd,
        GROUP_PER_BATCH=per_batch, HAS_START=has_start, USE_CP=cp_size > 1,
        BLOCK_R=block_r, BLOCK_HALF=block_half, BLOCK_TAIL=block_tail,
        RNE_BF16=INTERPRET and x.dtype == torch.bfloat16,
    )
    return Plan((n_groups, splits), ints, None, constexprs, num_warps)


def launch(x, freqs32, start_positions, cu_seqlens, layout, tensor_format, interleaved, cp_size, cp_rank,
           backward: bool) -> torch.Tensor:
    """Run the kernel on x (t in forward, the upstream gradient in backward); returns a new tensor."""
    out = empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    key = (x.shape, x.stride(), x.dtype, x.device, freqs32.shape, freqs32.stride(), tensor_format,
           interleaved, start_positions is not None, cu_seqlens is not None, cp_size, cp_rank, backward)
    plan = _PLANS.get(key)
    if plan is None:
        plan = make_plan(x, layout, tensor_format, interleaved, start_positions is not None, cp_size,
                         cp_rank, freqs32.stride(), backward)
        _PLANS[key] = plan
    # Unused pointer arguments get a valid tensor; the kernel never reads them (constexpr flags).
    start = start_positions if start_positions is not None else freqs32
    cu = cu_seqlens if cu_seqlens is not None else freqs32
    rope_kernel[plan.grid](x, out, freqs32, start, cu, *plan.ints, **plan.constexprs,
                           num_warps=plan.num_warps)
    return out
