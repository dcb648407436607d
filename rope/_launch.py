"""Launcher: turns a checked call into a grid and kernel arguments, cached per call signature.

Host cost matters as much as bandwidth for small tensors (decode, short sequences): Triton's
generic `kernel[grid](...)` path re-binds and re-specializes all ~35 arguments on every call
(tens of microseconds). Here everything derived from shapes, strides and flags is computed once
per signature into a `Plan`, and after the first launch the compiled kernel is launched directly.
The signature must therefore include everything Triton specializes on: dtypes, integer argument
values (all fixed by shapes and strides) and whether each pointer is 16-byte aligned.
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton

from ._kernel import rope_kernel, rope_qk_kernel
from ._table import cos_sin_table, token_positions

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Tiles and program sizes, from sweeps on an H200 (BENCHMARKS.md, notes 11, 13 and 15).
# Kernel evaluating sin/cos itself: 8-row tiles (16 for interleaved, whose single full-width tile
# is split in registers), with as many warps as give every thread one 16-byte vector of the
# *widest* tile (each half of the rotated channels, the pass-through tail). A program covers
# several tiles so that its sin/cos are amortised: 16 rows for 16-bit types in groups that span
# the batch (Llama bf16: 86 -> 91 % of copy, interleaved 88 -> 92 %); otherwise whole groups,
# split only until the GPU has enough programs (at 16 or 32 rows float32 lost 10-20 points,
# partial rotary 10-18, and a thd token, whose search of cu_seqlens precedes its angles, 7 points).
_ROWS_HALFSPLIT = 8
_ROWS_INTERLEAVED = 16
_VECTORS_INTERLEAVED = 4
_EVAL_ROWS_16BIT = 16
# Kernel reading a cos/sin table (`rope._table`): nothing to amortise, so a program is one tile of
# 8 rows with 32 bytes of each row-half per thread, like a copy kernel's (headline bf16 90 -> 96 %
# of copy; larger tiles or several per program were 1-15 points slower). A tensor small enough to
# be in flight at once (under 32 bytes per resident thread: 8.6 MB on an H200) gets 16 bytes per
# thread instead: twice the threads, each with half the chain (launch-bound sizes, 0.05-0.1 µs).
# Up to 16 KB per SM (2.1 MB on an H200), where a group spans the batch, tiles take up to 16 rows:
# half the programs, for sizes whose time is the launch and one program's latency (64x1x16x64
# fp32: clone + 0.25 -> + 0.15 µs in a graph; 128x1x16x128: + 0.35 -> + 0.30). At 4 MB (sbhd
# 256x2x32x128) 16 rows lost 0.26 µs, and groups of one token's heads (decode, thd), whose
# programs wait on a position load, lost 0.05-0.15 µs: they keep 8 rows (note 20).
_TABLE_ROWS = 8
_TABLE_ROWS_SMALL = 16
_TABLE_ROWS_SMALL_BYTES_PER_SM = 16384
# thd reading the table: a program first searches cu_seqlens for its token's sequence. Where that
# takes several rounds of dependent loads (more sequences than _SEARCH_FANOUT), a program covers
# 4 KB of `t` (one token, or part of it) to amortise them: 2 KB measured 5-18 points slower,
# 8-16 KB 1-4 points. With one round, one tile is best again (few long sequences: 92 against
# 91 % of copy; note 15). Where the token's position is read from a table instead (the same
# calls, without start_positions: `rope._table.token_positions`), 2 KB programs are best (2048
# sequences of 8 tokens: 96.3 % of copy against 93.5 with 4 KB; note 19).
_TABLE_THD_BYTES = 4096
_POS_TABLE_THD_BYTES = 2048
_TABLE_BYTES_PER_THREAD = 32
_TABLE_BYTES_PER_THREAD_SMALL = 16
_THREADS_PER_SM = 2048
# Triton's interpreter (the CPU suite) runs one program after another, each tile operation a numpy
# call whose cost hardly depends on the tile's size: there, tiles take up to this many rows of a
# group at once (3-8x fewer steps than GPU tiles at the CPU suite's sizes). The GPU's
# decomposition (several tiles and programs per group, the loop, the memory-ordered grid) is then
# run on the CPU only by the tests that ask for it (`gpu_decomposition` in tests/cases.py); the
# GPU suite runs it everywhere.
_INTERPRETER_TILE_ROWS = 64 if INTERPRET else 0
# Programs wanted per SM before a group's rows are split over several programs.
_PROGRAMS_PER_SM = 8
# thd: cu_seqlens entries a program loads per round of its search for its token's sequence
# (`rope._kernel._sequence_of`): 1 round up to 31 sequences, 2 up to 1023, 3 up to 32767. One warp
# holds them all, so a round's reductions stay within a warp; 64 and 128 measured no faster.
_SEARCH_FANOUT = 32


def empty(x: torch.Tensor, dense: bool = False) -> torch.Tensor:
    """A new contiguous output for `x`. Tests replace it with one that fills NaN, to prove every
    element is written. `dense`: x has exactly a contiguous tensor's strides (`Plan.dense`), so
    `empty_like` may keep x's layout. (`empty_like` costs about half the host time of
    `empty(shape, ...)`, and without its memory-format argument 0.7 µs less again on CI's CPU:
    BENCHMARKS.md, note 21.)"""
    return torch.empty_like(x) if dense else torch.empty_like(x, memory_format=torch.contiguous_format)


@contextlib.contextmanager
def nan_outputs():
    """Within it, every output the launcher allocates starts as NaN, so a check that finds none
    knows every element was written (tests and the benchmark's accuracy check use it)."""
    global empty
    saved = empty
    empty = lambda x, dense=False: torch.full_like(x, float("nan"), memory_format=torch.contiguous_format)  # noqa: E731
    try:
        yield
    finally:
        empty = saved

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

    __slots__ = ("kernel", "grid", "scalars", "num_warps", "device", "dense", "compiled")

    def __init__(self, kernel, grid, scalars, num_warps, device, dense):
        self.kernel = kernel
        self.dense = dense  # per input tensor (x; or q, k): strides exactly those of its new output
        self.device = device.index if device.type == "cuda" else None
        self.grid = grid
        self.scalars = scalars  # every argument after the pointers, in the kernel's order
        self.num_warps = num_warps
        self.compiled = None

    def arg(self, name: str):
        """The value of the kernel's scalar argument `name` (tests and tools; not on the hot path)."""
        names = self.kernel.arg_names
        return self.scalars[names.index(name) - (len(names) - len(self.scalars))]


def _roles(x: torch.Tensor, tensor_format: str) -> tuple:
    """x's strides in the kernel's (s, b, h, d) roles; thd has no b."""
    st = x.stride()
    if tensor_format == "sbhd":
        return st
    if tensor_format == "bshd":
        return st[1], st[0], st[2], st[3]
    return st[0], 0, st[1], st[2]


def _out_roles(x: torch.Tensor, tensor_format: str, inplace: bool) -> tuple:
    """Strides of the output in the same roles: x's own in place, else a new contiguous tensor's."""
    if inplace:
        return _roles(x, tensor_format)
    if tensor_format == "thd":
        _, h, d = x.shape
        return h * d, 0, d, 1
    a, b_, h, d = x.shape  # (s, b) or (b, s)
    outer, inner = (a, b_) if tensor_format == "sbhd" else (b_, a)
    row = h * d
    return (inner * row, row, d, 1) if tensor_format == "sbhd" else (row, outer * row, d, 1)


def _dense(x: torch.Tensor, tensor_format: str) -> bool:
    """Whether x's strides are exactly those of its new contiguous output (then `empty` may keep them)."""
    return _roles(x, tensor_format) == _out_roles(x, tensor_format, False)


def _table_tile(tensor_bytes: int, device, spans_batch: bool) -> tuple:
    """(most rows per tile, bytes of each row-half per thread) for the kernel reading the table."""
    sms = _sm_count(device)
    if tensor_bytes > sms * _THREADS_PER_SM * _TABLE_BYTES_PER_THREAD:
        return _TABLE_ROWS, _TABLE_BYTES_PER_THREAD
    tiny = spans_batch and tensor_bytes <= sms * _TABLE_ROWS_SMALL_BYTES_PER_SM
    return (_TABLE_ROWS_SMALL if tiny else _TABLE_ROWS), _TABLE_BYTES_PER_THREAD_SMALL


def _tile(d: int, d2: int, interleaved: bool, element_size: int, rows_per_group: int, table_tile):
    """(BLOCK_R, BLOCK_HALF, BLOCK_TAIL, num_warps) by the rules above; table_tile as `_table_tile`
    gives it, None for the kernel that evaluates sin/cos."""
    table = table_tile is not None
    block_half = triton.next_power_of_2(d2 // 2)
    block_tail = triton.next_power_of_2(d - d2) if d > d2 else 0
    vec = 16 // element_size  # elements per 16-byte access
    if table:
        widest = max(block_half, block_tail)  # half-split only (functional.angles_for)
        max_rows, bytes_per_thread = table_tile
        block_r = min(triton.next_power_of_2(rows_per_group), max_rows)
        threads = block_r * widest * element_size // bytes_per_thread
    elif interleaved:
        widest = max(2 * block_half, block_tail)
        block_r = min(triton.next_power_of_2(rows_per_group), _ROWS_INTERLEAVED)
        threads = block_r * widest // (vec * _VECTORS_INTERLEAVED)
    else:
        widest = max(block_half, block_tail)
        block_r = min(triton.next_power_of_2(rows_per_group), _ROWS_HALFSPLIT)
        threads = block_r * widest // vec
    if _INTERPRETER_TILE_ROWS:
        block_r = min(triton.next_power_of_2(rows_per_group), _INTERPRETER_TILE_ROWS)
    return block_r, block_half, block_tail, max(1, min(8, threads // 32))


def _rows_per_program(n_groups: int, rows: int, block_r: int, spans_batch: bool, element_size: int,
                      full_rotary: bool, table: bool, device, row_bytes: int = 0, pos_table: bool = False) -> int:
    """Rows of a group per program (a multiple of block_r) by the rules above; `row_bytes` as
    `_thd_row_bytes` gives it."""
    if table:
        if row_bytes:
            program_bytes = _POS_TABLE_THD_BYTES if pos_table else _TABLE_THD_BYTES
            return min(_cdiv(rows, block_r), max(1, program_bytes // (row_bytes * block_r))) * block_r
        return block_r
    if spans_batch and element_size <= 2 and full_rotary:
        return _cdiv(_EVAL_ROWS_16BIT, block_r) * block_r
    target = _PROGRAMS_PER_SM * _sm_count(device)
    splits = min(_cdiv(target, max(n_groups, 1)), _cdiv(rows, block_r)) if n_groups < target else 1
    return _cdiv(_cdiv(rows, splits), block_r) * block_r


_INT32_LIMIT = 2**31


def _check_index_range(programs: int, rows: int) -> None:
    """The kernel's program and row indices are int32 (`rope._kernel._program`)."""
    if programs >= _INT32_LIMIT or rows >= _INT32_LIMIT:
        raise ValueError(f"t: {rows} rows (b*h, or q and k heads) per position in {programs} programs; "
                         f"at most {_INT32_LIMIT - 1} of each are supported")


def _inner(roles: tuple, spans_batch: bool, n_batch: int, heads: int, rows_per_program: int, chunks: int) -> int:
    """Chunks of a group's rows that lie next to each other in memory (the kernel's `inner`).

    A group's rows are contiguous unless it spans the batch and the batch stride exceeds the
    sequence stride (bshd): then only the chunks of one batch entry are, if they tile its `heads`
    rows (0: the rows form no such runs). Any value that divides `chunks` is correct: the order
    is a matter of speed, never of which rows are written."""
    stride_s, stride_b = roles[0], roles[1]
    if not spans_batch or n_batch == 1 or stride_b <= stride_s:
        return chunks
    if rows_per_program < heads and heads % rows_per_program == 0:
        return heads // rows_per_program
    return 1


def reads_positions(tensor_format: str, has_start: bool, n_seqs: int) -> bool:
    """Whether a call reads its tokens' positions from a table (where one may be built) instead of
    searching cu_seqlens: thd without start_positions, where the search takes several rounds."""
    return tensor_format == "thd" and not has_start and n_seqs >= _SEARCH_FANOUT


def _thd_row_bytes(x, layout, tensor_format) -> int:
    """Bytes per row where a thd program's search takes several rounds, or where it reads the
    position table, else 0 (see above)."""
    return x.element_size() * layout.d if tensor_format == "thd" and layout.n_seqs >= _SEARCH_FANOUT else 0


def _decomposition(x, layout, tensor_format, interleaved, per_batch, n_groups, rows, widest_rows, tensor_bytes,
                   table, run_heads, pos_table):
    """(tile, rows per program, chunks per group, inner, x's strides in roles) for a launch over
    `rows` rows per group; `run_heads` as in `_inner`."""
    spans_batch = not per_batch and tensor_format != "thd"
    table_tile = _table_tile(tensor_bytes, x.device, spans_batch) if table else None
    tile = _tile(layout.d, layout.rot_dim, interleaved, x.element_size(), widest_rows, table_tile)
    rows_per_program = _rows_per_program(n_groups, rows, tile[0], spans_batch, x.element_size(),
                                         layout.rot_dim == layout.d, table, x.device,
                                         _thd_row_bytes(x, layout, tensor_format), pos_table)
    chunks = _cdiv(rows, rows_per_program)
    _check_index_range(n_groups * chunks, rows + rows_per_program)
    roles = _roles(x, tensor_format)
    return tile, rows_per_program, chunks, _inner(roles, spans_batch, layout.b, run_heads, rows_per_program,
                                                  chunks), roles


def _groups(layout, tensor_format: str, has_start: bool, h: int):
    """(number of groups, rows per group, whether a group is one (s, b) pair)."""
    per_batch = has_start and tensor_format != "thd"
    if per_batch or tensor_format == "thd":
        return (layout.s * layout.b if per_batch else layout.s), h, per_batch
    return layout.s, layout.b * h, per_batch


def _constexprs(layout, tensor_format, interleaved, backward, per_batch, has_start, cp_size, tile, dtype, inplace,
                table, chunks, pos_table):
    block_r, block_half, block_tail, _ = tile
    return (layout.d, layout.rot_dim, interleaved, backward, tensor_format == "thd", per_batch, has_start,
            cp_size > 1, block_r, block_half, block_tail, INTERPRET and dtype == torch.bfloat16, not INTERPRET,
            inplace, table, chunks > 1, _SEARCH_FANOUT if tensor_format == "thd" and not pos_table else 1,
            pos_table)


def _angle_strides(angles: torch.Tensor) -> tuple:
    """(row stride, channel stride) of the kernel's angle source: `freqs` [s2, 1, 1, d2] as
    float32, or its cos/sin table [s2, 2, d2] (`rope._table`)."""
    return angles.stride(0), angles.stride(-1)


def make_plan(x: torch.Tensor, layout, tensor_format: str, interleaved: bool, has_start: bool,
              cp_size: int, cp_rank: int, angles: torch.Tensor, backward: bool, inplace: bool = False,
              pos_table: bool = False) -> Plan:
    """`angles`: float32 `freqs`, or its cos/sin table (3-D), as the kernel will read it; `pos_table`:
    the kernel's cu_seqlens argument is the position table (`rope._table.token_positions`)."""
    table = angles.dim() == 3
    n_groups, rows, per_batch = _groups(layout, tensor_format, has_start, layout.h)
    tile, rows_per_program, chunks, inner, roles = _decomposition(
        x, layout, tensor_format, interleaved, per_batch, n_groups, rows, rows, x.numel() * x.element_size(), table,
        layout.h, pos_table)
    scalars = (
        layout.h, layout.b, rows, rows_per_program, n_groups, inner, layout.s, layout.n_seqs, layout.freqs_len,
        cp_size, cp_rank, *roles, *_out_roles(x, tensor_format, inplace), *_angle_strides(angles),
        *_constexprs(layout, tensor_format, interleaved, backward, per_batch, has_start, cp_size, tile, x.dtype,
                     inplace, table, chunks, pos_table),
    )
    return Plan(rope_kernel, (n_groups * chunks, 1, 1), scalars, tile[3], x.device, (_dense(x, tensor_format),))


def make_qk_plan(q: torch.Tensor, k: torch.Tensor, layout, k_heads: int, tensor_format: str,
                 interleaved: bool, has_start: bool, cp_size: int, cp_rank: int, angles: torch.Tensor,
                 backward: bool, inplace: bool = False, pos_table: bool = False) -> Plan:
    """One launch for q and k (same tokens, head dim and dtype; head counts may differ)."""
    table = angles.dim() == 3
    n_groups, q_rows, per_batch = _groups(layout, tensor_format, has_start, layout.h)
    _, k_rows, _ = _groups(layout, tensor_format, has_start, k_heads)
    # The joint rows (q's b x h, then k's) hold no run of one batch entry's heads: run_heads=0.
    tile, rows_per_program, chunks, inner, roles = _decomposition(
        q, layout, tensor_format, interleaved, per_batch, n_groups, q_rows + k_rows, max(q_rows, k_rows),
        (q.numel() + k.numel()) * q.element_size(), table, 0, pos_table)
    scalars = (
        layout.h, k_heads, layout.b, q_rows, k_rows, rows_per_program, n_groups, inner, layout.s, layout.n_seqs,
        layout.freqs_len, cp_size, cp_rank,
        *roles, *_out_roles(q, tensor_format, inplace),
        *_roles(k, tensor_format), *_out_roles(k, tensor_format, inplace),
        *_angle_strides(angles),
        *_constexprs(layout, tensor_format, interleaved, backward, per_batch, has_start, cp_size, tile, q.dtype,
                     inplace, table, chunks, pos_table),
    )
    return Plan(rope_qk_kernel, (n_groups * chunks, 1, 1), scalars, tile[3], q.device,
                (_dense(q, tensor_format), _dense(k, tensor_format)))


def _hook_present(hook) -> bool:
    # Triton >= 3.5 keeps an always-present chain of hooks (`HookChain`, empty unless a profiler
    # adds one); older versions a callable or None.
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


def _hook_owner():
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:  # older Triton keeps the hooks on CompiledKernel
        from triton.compiler import CompiledKernel as runtime
    return runtime


_HOOK_OWNER = _hook_owner()  # resolved once; the hooks themselves are read on every launch
# Triton >= 3.5: the chain's class (its instances always have `calls`); None for older Triton.
_HOOK_CHAIN = type(_HOOK_OWNER.launch_enter_hook) if hasattr(_HOOK_OWNER.launch_enter_hook, "calls") else None


def _hooks_set() -> bool:
    enter, exit_ = _HOOK_OWNER.launch_enter_hook, _HOOK_OWNER.launch_exit_hook
    if type(enter) is _HOOK_CHAIN and type(exit_) is _HOOK_CHAIN:
        return bool(enter.calls or exit_.calls)  # the usual case, on the hot path: no further calls
    return _hook_present(enter) or _hook_present(exit_)


_raw_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None


_data_ptr = torch.Tensor.data_ptr


def run(plan: Plan, pointers: tuple):
    """Launch `plan` on its pointer arguments (tensors, in the kernel's order)."""
    compiled = plan.compiled
    if compiled is not None and not _hooks_set():
        # The compiled kernel's C launcher, called as Triton's own CompiledKernel runner calls it
        # (grid, stream, function, metadata, no launch metadata or hooks, then every argument):
        # no argument binding, specialization or cache lookup per call. Valid for this plan only,
        # since the plan's key fixes everything the kernel was specialized on.
        g0, g1, g2 = plan.grid
        compiled.run(g0, g1, g2, _raw_stream(plan.device), compiled.function, compiled.packed_metadata,
                     None, None, None, *pointers, *plan.scalars)
        return
    if compiled is not None:  # a profiler's launch hooks are set: take Triton's path, which calls them
        compiled[plan.grid](*pointers, *plan.scalars)
        return
    compiled = plan.kernel[plan.grid](*pointers, *plan.scalars, num_warps=plan.num_warps)
    if not INTERPRET:
        compiled._init_handles()
        plan.compiled = compiled


# ---- a checked call (rope._validate.Call) -> its plans, angle and position sources, launches ----


def plan_for(call, x, angles, backward, inplace=False, pos_table=False) -> Plan:
    # The call's key fixes x's strides where x is the call's own tensor (forward, and the custom
    # op's calls), not where it is a gradient. It fixes freqs.shape, hence the angle source's
    # shape; angles.stride() has 4 entries for `freqs` and 3 for its table, so it also tells the
    # two sources apart.
    key = (backward, inplace, pos_table, x.stride() if backward else None, x.data_ptr() % 16, angles.stride(),
           angles.data_ptr() % 16)
    plan = call.plans.get(key)
    if plan is None:
        plan = make_plan(x, call.layout, call.tensor_format, call.interleaved, call.has_start, call.cp_size,
                         call.cp_rank, angles, backward, inplace, pos_table)
        call.plans[key] = plan
    return plan


def qk_plan_for(call, q, k, angles, backward, inplace=False, pos_table=False) -> Plan:
    key = ("qk", backward, inplace, pos_table, q.stride(), q.data_ptr() % 16, k.shape, k.stride(),
           k.data_ptr() % 16, angles.stride(), angles.data_ptr() % 16)
    plan = call.plans.get(key)
    if plan is None:
        plan = make_qk_plan(q, k, call.layout, k.shape[-2], call.tensor_format, call.interleaved, call.has_start,
                            call.cp_size, call.cp_rank, angles, backward, inplace, pos_table)
        call.plans[key] = plan
    return plan


def angles_for(call, freqs):
    """What the kernel reads for the angles: the cached cos/sin table of `freqs` (`rope._table`;
    half-split only, interleaved has no table tile), or, where no table may be used, `freqs`
    itself as float32 (the kernel then evaluates sin/cos)."""
    if not call.interleaved:
        table = cos_sin_table(freqs, call.layout.freqs_len, call.layout.rot_dim)
        if table is not None:
            return table
    return freqs if freqs.dtype == torch.float32 else freqs.float()


def token_index_for(call, cu_seqlens):
    """What the kernel reads to place `thd` tokens, and whether it is the position table: the table
    cached per `cu_seqlens` (`rope._table`) where one may be used and a search of cu_seqlens would
    take several rounds, else `cu_seqlens` itself, which each program searches."""
    if reads_positions(call.tensor_format, call.has_start, call.layout.n_seqs):
        table = token_positions(cu_seqlens, call.layout.s, call.cp_size, call.cp_rank)
        if table is not None:
            return table, True
    return cu_seqlens, False


def _pointers(angles, start_positions, token_index):
    # Unused index tensors still need a valid pointer argument; the kernel never reads them.
    return angles, start_positions if start_positions is not None else angles, \
        token_index if token_index is not None else angles


def rotate(call, x, angles, start_positions, token_index, backward, inplace=False, pos_table=False):
    """Rotate x (or its gradient, `backward`) into a new tensor, or in place; returns it."""
    if call.empty:
        return x if inplace else empty(x)
    plan = plan_for(call, x, angles, backward, inplace, pos_table)
    out = x if inplace else empty(x, plan.dense[0])
    run(plan, (x, out, *_pointers(angles, start_positions, token_index)))
    return out


def rotate_qk(call, q, k, angles, start_positions, token_index, backward, inplace=False, pos_table=False):
    """`rotate` for q and k in one launch; returns (q_out, k_out)."""
    if not (q.numel() or k.numel()):
        return (q, k) if inplace else (empty(q), empty(k))
    plan = qk_plan_for(call, q, k, angles, backward, inplace, pos_table)
    qo = q if inplace else empty(q, plan.dense[0])
    ko = k if inplace else empty(k, plan.dense[1])
    run(plan, (q, qo, k, ko, *_pointers(angles, start_positions, token_index)))
    return qo, ko
