"""Launcher: turns a checked call into a grid and kernel arguments, cached per call signature.

Host cost matters as much as bandwidth for small tensors (decode, short sequences): Triton's
generic `kernel[grid](...)` path re-binds and re-specializes all ~35 arguments on every call
(tens of microseconds). Here everything derived from shapes, strides and flags is computed once
per signature into a `Plan`, and after the first launch the compiled kernel is launched directly.
The signature must therefore include everything Triton specializes on: dtypes, integer argument
values (all fixed by shapes and strides) and whether each pointer is 16-byte aligned.
"""
from __future__ import annotations

import os

import torch
import triton

from ._kernel import rope_kernel
from ._validate import Layout

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Tile shape, from sweeps on an H200 (BENCHMARKS.md): 8 rows per loop iteration (16 for
# interleaved, whose single full-width tile is split in registers) and as many warps as give
# every thread one 16-byte vector of the *narrowest* of the tiles (each half of the rotated
# channels, the pass-through tail). Wider CTAs replicate the narrow tiles across threads and
# lost up to 30 % of bandwidth in the sweep; more rows per thread lost up to 35 %.
_ROWS_HALFSPLIT = 8
_ROWS_INTERLEAVED = 16
_VECTORS_INTERLEAVED = 4
# Programs wanted per SM before a group's rows are split over several programs.
_PROGRAMS_PER_SM = 8

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


class Plan:
    """Grid, scalar arguments and, once compiled, the direct launcher for one call signature."""

    __slots__ = ("grid", "scalars", "num_warps", "compiled")

    def __init__(self, grid, scalars, num_warps):
        self.grid = grid
        self.scalars = scalars  # every argument after the five pointers, in the kernel's order
        self.num_warps = num_warps
        self.compiled = None


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
    vec = 16 // x.element_size()  # elements per 16-byte access
    if interleaved:
        narrowest = min(2 * block_half, block_tail or 2 * block_half)
        block_r = min(triton.next_power_of_2(rows_per_group), _ROWS_INTERLEAVED)
        threads = block_r * narrowest // (vec * _VECTORS_INTERLEAVED)
    else:
        narrowest = min(block_half, block_tail or block_half)
        block_r = min(triton.next_power_of_2(rows_per_group), _ROWS_HALFSPLIT)
        threads = block_r * narrowest // vec
    num_warps = max(1, min(8, threads // 32))

    target = _PROGRAMS_PER_SM * _sm_count(x.device)
    splits = 1
    if n_groups < target:
        splits = min(_cdiv(target, max(n_groups, 1)), _cdiv(rows_per_group, block_r))
    rows_per_program = _cdiv(_cdiv(rows_per_group, splits), block_r) * block_r
    splits = _cdiv(rows_per_group, rows_per_program)

    scalars = (
        h, b, rows_per_group, rows_per_program, s, layout.n_seqs, layout.freqs_len, cp_size, cp_rank,
        xs, xb, xh, xd, os_, ob, oh, freqs_stride[0], freqs_stride[3],
        # constexprs, in the kernel's order
        d, d2, interleaved, backward, is_thd, per_batch, has_start, cp_size > 1,
        block_r, block_half, block_tail, INTERPRET and x.dtype == torch.bfloat16, not INTERPRET,
    )
    return Plan((n_groups, splits, 1), scalars, num_warps)


def _hooks_set() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:  # older Triton keeps the hooks on CompiledKernel
        from triton.compiler import CompiledKernel as runtime
    return runtime.launch_enter_hook is not None or runtime.launch_exit_hook is not None


_raw_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None


def run(plan: Plan, x, out, freqs32, start, cu):
    """Launch; `start`/`cu` may be None (the kernel never reads them then)."""
    if start is None:
        start = freqs32
    if cu is None:
        cu = freqs32
    compiled = plan.compiled
    if compiled is not None and not _hooks_set():
        # The compiled kernel's C launcher, called as Triton's own CompiledKernel runner calls it
        # (grid, stream, function, metadata, no launch metadata or hooks, then every argument):
        # no argument binding, specialization or cache lookup per call. Valid for this plan only,
        # since the plan's key fixes everything the kernel was specialized on.
        g0, g1, g2 = plan.grid
        compiled.run(g0, g1, g2, _raw_stream(x.device.index), compiled.function, compiled.packed_metadata,
                     None, None, None, x, out, freqs32, start, cu, *plan.scalars)
        return
    if compiled is not None:  # a profiler's launch hooks are set: take Triton's path, which calls them
        compiled[plan.grid](x, out, freqs32, start, cu, *plan.scalars)
        return
    compiled = rope_kernel[plan.grid](x, out, freqs32, start, cu, *plan.scalars, num_warps=plan.num_warps)
    if not INTERPRET:
        compiled._init_handles()
        plan.compiled = compiled
