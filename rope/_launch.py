"""Launcher: turns a checked call into a grid and kernel arguments, cached per call signature.

Triton's generic `kernel[grid](...)` binds and specializes all arguments on every call, which costs
more host time than a small tensor's kernel takes. Here everything derived from shapes, strides and
flags is computed once per signature into a `Plan`, and after the first launch the compiled kernel is
launched directly. The signature therefore includes everything Triton specializes on: dtypes,
integer argument values (fixed by shapes and strides) and whether each pointer is 16-byte aligned.
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton

from . import _memo
from ._cuda import raw_stream
from ._table import cos_sin_table, token_positions
from .kernels import rope_cache_kernel, rope_kernel, rope_qk_kernel, rope_qknorm_kernel
from .reference import torch_row_reduction

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Tiles and program sizes, tuned on an H200; docs/design.md ("The launch") gives the reasons.
# Kernel evaluating sin/cos: one 16-byte vector (interleaved: four) per thread of the widest tile. A
# program covers several tiles so that its sin/cos are amortised (16 rows for 16-bit types in groups
# spanning the batch, else whole groups, split only until the GPU has enough programs).
_ROWS_HALFSPLIT = 8
_ROWS_INTERLEAVED = 16
_VECTORS_INTERLEAVED = 4
_EVAL_ROWS_16BIT = 16
_PROGRAMS_PER_SM = 8
# Kernel reading the cos/sin table: a program is one tile, as in a copy kernel, with 32 bytes of each
# row-half per thread; 16 for tensors small enough to be in flight at once, and 16-row tiles up to
# 16 KB per SM (decode), whether a group spans the batch or is one token's heads: at decode, 8-row tiles
# load each token's angles in 5 programs (q and k of 32 + 8 heads), one 64-row tile leaves SMs idle
# (benchmarks/decode_study.py, part 4; docs/design.md gives the times).
# thd programs cover 4 KB of `t` where a search of cu_seqlens takes several rounds, 2 KB where they read
# the position table.
_TABLE_ROWS = 8
# Tables given per stream (transformers' multimodal [3, b, s, d]) hold three rows per token, each read once,
# from DRAM: a tile takes up to a token's q and k heads (28 + 4 in Qwen2-VL-7B), so that one gather of angles
# serves all of them (16 rows for tensors small enough to be in flight at once). Positions into one shared
# table (L2-resident rows) keep the tile of 8.
_TABLE_ROWS_PER_STREAM = 32
_TABLE_ROWS_SMALL = 16
_TABLE_ROWS_SMALL_BYTES_PER_SM = 16384
_TABLE_THD_BYTES = 4096
_POS_TABLE_THD_BYTES = 2048
_TABLE_BYTES_PER_THREAD = 32
_TABLE_BYTES_PER_THREAD_SMALL = 16
# Tables given per sequence (transformers' [b, s, d]): a token's row of cos and sin is read by no other group, so a
# program takes all the token's q and k heads (up to 8 tiles), reading the row once instead of once per tile, with
# 16 bytes per thread (two warps per 8-row tile) where the tensor is large (benchmarks/tile_study.py; docs/design.md
# gives the times). Decode keeps a tile per program: there the programs are few.
_TABLE_TILES_PER_SEQUENCE_ROW = 8
_THREADS_PER_SM = 2048
# The interpreter runs programs one after another and a tile operation costs about the same at any size:
# there, tiles take up to 64 rows (tests that need the GPU's decomposition ask for it).
_INTERPRETER_TILE_ROWS = 64 if INTERPRET else 0
# Programmatic dependent launch (PDL, Hopper and later) of the rotation kernels: the kernel is launched while the
# kernel before it in the stream still runs and waits for its writes in its first instruction (`rope_qk_kernel`),
# which hides its launch behind that kernel's last programs. Off by default: benchmarks/decode_study.py measures
# it behind a matmul. Plans made while it is set keep it.
PDL = os.environ.get("ROPE_PDL") == "1"
# thd: cu_seqlens entries loaded per round of the search (`kernels._common._sequence_of`), one per lane of a warp.
_SEARCH_FANOUT = 32
# QK norm's backward: each program writes its partial weight gradients (2 * d float32), so programs take several
# work items in turn (at most _NORM_PROGRAMS_PER_SM programs per SM) of up to _NORM_ROWS rows each: the partials
# stay about 1 MB, against the tens of MB of q and k, whatever the number of tokens. 8 programs per SM keep enough
# loads in flight: faster than 4 per SM (benchmarks/qknorm_study.py, Qwen3-8B forward and backward); 64 or 128 rows
# alike, 32 slower.
_NORM_PROGRAMS_PER_SM = 8
_NORM_ROWS = 64
_NORM_TILE_ROWS = 16  # the rows every QK-norm tile is planned for: at least each kind's cap (`_tile`)
# QK norm's forward holds a whole head per row in float32 until the row's sum of squares is known. For the 16-bit
# half-split tile the compiler takes 128 registers per thread; 96 hold it without spilling (ptxas -v), and the
# warps this adds per SM keep more loads in flight (benchmarks/qknorm_study.py: faster for Gemma's form and partial
# rotary, Qwen3-8B and d 256 unchanged; docs/design.md gives the times). The interleaved tile (77 registers)
# and 32-bit types (70 for fp32 d 128) stay below it, and given a cap ptxas spends up to it (fp32: 94): they are
# left to the compiler.
_NORM_FWD_MAXNREG = 96


def empty(x: torch.Tensor, dense: bool = False) -> torch.Tensor:
    """A new contiguous output for `x` (`nan_outputs` replaces it). `dense`: the plan's output is `empty_like(x)`'s
    (`Plan.dense`: x is contiguous, or the call keeps x's memory order)."""
    return torch.empty_like(x) if dense else torch.empty_like(x, memory_format=torch.contiguous_format)


@contextlib.contextmanager
def nan_outputs():
    """Within it, every output the launcher allocates starts as NaN, so a check that finds none
    knows every element was written (tests and the benchmark's accuracy check use it)."""
    global empty
    saved = empty
    empty = lambda x, dense=False: torch.full_like(  # noqa: E731
        x, float("nan"), memory_format=torch.preserve_format if dense else torch.contiguous_format)
    try:
        yield
    finally:
        empty = saved


_SM_COUNT = _memo.memo("multiprocessor count per GPU", 64)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one at a time: fewer, larger programs are faster
    if device.index not in _SM_COUNT:
        _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device.index]


class Angles:
    """What the kernel reads for the angles. `table`: cos and sin tables, any float dtype, read at
    [position * stride_s + batch * stride_b + column * stride_d] (stride_b: tables per batch entry, else
    0), with one column per channel of the rotary width, or, `half`, one per pair. Else `cos` is `freqs`
    as float32 (rows by stride_s, channels by stride_d), whose sin/cos the kernel evaluates, and `sin`
    is unused. `length`: rows; a position outside them gives NaN. Multimodal RoPE: `streams` is the
    kernel's (MROPE, SEC0, SEC1, SEC2), which position stream each pair reads (`kernels._common._stream_of_pair`),
    and `stride_m` the distance between the streams' tables (0: one table for all)."""

    __slots__ = ("cos", "sin", "length", "stride_s", "stride_b", "stride_d", "table", "half", "stride_m", "streams",
                 "_key")

    def __init__(self, *, cos: torch.Tensor, sin: torch.Tensor, length: int, stride_s: int, stride_b: int,
                 stride_d: int, table: bool, half: bool, stride_m: int = 0, streams: tuple = (0, 0, 0, 0)):
        self.cos, self.sin, self.length = cos, sin, length
        self.stride_s, self.stride_b, self.stride_d, self.stride_m = stride_s, stride_b, stride_d, stride_m
        self.table, self.half, self.streams = table, half, streams
        self._key = None

    @property
    def key(self) -> tuple:
        """What a plan depends on (Triton specializes on dtypes, alignment and strides): made on the first launch
        and kept, since a cached table's record serves every call that reads it (and a tensor without storage, under
        a functorch transform, has no alignment to ask before autograd refuses it)."""
        key = self._key
        if key is None:
            key = self._key = (self.cos.dtype, self.stride_s, self.stride_b, self.stride_d, self.table, self.half,
                               self.cos.data_ptr() % 16, self.sin.data_ptr() % 16, self.stride_m, self.streams)
        return key

    def _replace(self, **fields) -> Angles:
        """A copy with `fields` changed (its key made anew)."""
        return Angles(**{name: fields.get(name, getattr(self, name)) for name in Angles.__slots__[:-1]})


def freqs_angles(freqs: torch.Tensor, length: int) -> Angles:
    """`freqs` [s2, 1, 1, d2] as the kernel evaluates it."""
    freqs = freqs if freqs.dtype == torch.float32 else freqs.float()
    return Angles(cos=freqs, sin=freqs, length=length, stride_s=freqs.stride(0), stride_b=0, stride_d=freqs.stride(-1),
                  table=False, half=False)


def table_angles(cos: torch.Tensor, sin: torch.Tensor, half: bool, per_batch: bool = False, per_stream: bool = False,
                 streams: tuple = (0, 0, 0, 0)) -> Angles:
    """cos/sin tables of equal strides, [rows, columns] (columns: rotary channels, or pairs if `half`), with
    `per_batch` a table per batch entry ([b, rows, columns]), with `per_stream` one per position stream ([3, ...]);
    `streams`: multimodal RoPE's (MROPE, SEC0, SEC1, SEC2)."""
    return Angles(cos=cos, sin=sin, length=cos.shape[-2], stride_s=cos.stride(-2),
                  stride_b=cos.stride(-3) if per_batch else 0, stride_d=cos.stride(-1), table=True, half=half,
                  stride_m=cos.stride(0) if per_stream else 0, streams=streams)


# The pointer arguments of each kernel, by name, in the order `run` is given their tensors: `kernel_args` checks them
# against the kernel's own when a plan is made, so the launch passes a plain tuple and a renamed or reordered pointer
# fails there, not as a misplaced argument in the kernel.
ROTATE_POINTERS = ("x_ptr", "out_ptr", "cos_or_freqs_ptr", "sin_ptr", "start_positions_ptr",
                   "cu_seqlens_or_positions_ptr")
ROTATE_QK_POINTERS = ("q_ptr", "q_out_ptr", "k_ptr", "k_out_ptr", "cos_or_freqs_ptr", "sin_ptr", "start_positions_ptr",
                      "cu_seqlens_or_positions_ptr")
NORM_POINTERS = ROTATE_QK_POINTERS + ("q_weight_ptr", "k_weight_ptr", "q_input_ptr", "k_input_ptr",
                                      "weight_grad_partials_ptr")
# where the QK-norm kernel's tile rows are among a plan's scalars (`kernel_args`): the backward's scratch per program
_NORM_BLOCK_R = [n for n in rope_qknorm_kernel.arg_names if not n.endswith("_ptr")].index("BLOCK_R")
CACHE_POINTERS = ("q_ptr", "k_ptr", "v_ptr", "key_cache_ptr", "value_cache_ptr", "slot_mapping_ptr", "positions_ptr",
                  "cos_table_ptr", "sin_table_ptr", "k_scale_ptr", "v_scale_ptr")


def kernel_args(kernel, pointers: tuple, named: dict) -> tuple:
    """The kernel's arguments after its pointers (every name not ending in `_ptr`), in its order, from `named`;
    made once per plan, so the launch passes a ready tuple. `pointers`: the names of the tensors the launch passes
    first, in their order, which must be the kernel's pointer arguments. A name missing, left over or out of order
    is an error here, at planning, not a misplaced argument in the kernel."""
    if tuple(n for n in kernel.arg_names if n.endswith("_ptr")) != tuple(pointers):
        raise RuntimeError(f"{kernel.__name__}: pointer arguments are "
                           f"{[n for n in kernel.arg_names if n.endswith('_ptr')]}, not {list(pointers)}")
    order = [n for n in kernel.arg_names if not n.endswith("_ptr")]
    missing, extra = set(order) - named.keys(), named.keys() - set(order)
    if missing or extra:
        raise RuntimeError(f"{kernel.__name__}: arguments missing {sorted(missing)}, unknown {sorted(extra)}")
    return tuple(named[n] for n in order)


class Plan:
    """Grid, scalar arguments and, once compiled, the direct launcher for one call signature."""

    __slots__ = ("kernel", "grid", "scalars", "num_warps", "device", "dense", "compiled", "options")

    def __init__(self, kernel, grid, scalars, num_warps, device, dense, options=None):
        self.kernel = kernel
        self.dense = dense  # per input tensor (x; or q, k): strides exactly those of its new output
        self.device = device.index if device.type == "cuda" else None
        self.grid = grid
        self.scalars = scalars  # every argument after the pointers, in the kernel's order (`kernel_args`)
        self.num_warps = num_warps
        self.compiled = None
        # Triton's compile options beyond num_warps (launch_pdl, maxnreg). No plan lets the compiler fuse a product
        # into a sum: whether it fuses, and which product, varies with the compiled variant (tile, layout), which
        # the call's shapes choose, so a sequence's result would depend on the rest of the batch (the H200 gave
        # DeepSeek-V3's float32 gradients another last bit alone than in a batch of three). Without fusion every
        # variant computes each element by the same float32 operations: the `float32` schedule, bitwise, anywhere.
        self.options = dict(enable_fp_fusion=False, **(options or {}))

    def arg(self, name: str):
        """The value of the kernel's scalar argument `name` (tests and tools; not on the hot path)."""
        return self.scalars[[n for n in self.kernel.arg_names if not n.endswith("_ptr")].index(name)]


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


def _like(x: torch.Tensor, tensor_format: str) -> tuple:
    """The strides, in the kernel's roles, of `empty_like(x)`: PyTorch's elementwise result for x, x's own where x
    is a permuted contiguous tensor, else dense in x's order of strides."""
    return _roles(torch.empty_like(x, device="meta"), tensor_format)


def _large(tensor_bytes: int, device) -> bool:
    """Whether the tensors exceed what the GPU's threads hold in flight at 32 bytes each."""
    return tensor_bytes > _sm_count(device) * _THREADS_PER_SM * _TABLE_BYTES_PER_THREAD


def _table_tile(tensor_bytes: int, device, spans_batch: bool, per_stream: bool = False,
                per_sequence: bool = False) -> tuple:
    """(most rows per tile, bytes of each row-half per thread) for the kernel reading the table. `per_sequence`:
    the table has a row per token of each sequence (`_TABLE_TILES_PER_SEQUENCE_ROW`)."""
    sms = _sm_count(device)
    if _large(tensor_bytes, device):
        if per_sequence and not per_stream:
            return _TABLE_ROWS, _TABLE_BYTES_PER_THREAD_SMALL
        return (_TABLE_ROWS_PER_STREAM if per_stream else _TABLE_ROWS), _TABLE_BYTES_PER_THREAD
    tiny = tensor_bytes <= sms * _TABLE_ROWS_SMALL_BYTES_PER_SM or per_stream
    return (_TABLE_ROWS_SMALL if tiny else _TABLE_ROWS), _TABLE_BYTES_PER_THREAD_SMALL


def _tile(d: int, d2: int, interleaved: bool, element_size: int, rows_per_group: int, table_tile):
    """(BLOCK_R, BLOCK_HALF, BLOCK_TAIL, num_warps) by the rules above; table_tile as `_table_tile`
    gives it for the half-split kernel reading tables, None otherwise (interleaved tables take the
    interleaved tile)."""
    table = table_tile is not None and not interleaved
    block_half = triton.next_power_of_2(d2 // 2)
    block_tail = triton.next_power_of_2(d - d2) if d > d2 else 0
    vec = 16 // element_size  # elements per 16-byte access
    if table:
        widest = max(block_half, block_tail)  # half-split only (`angles_for`)
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
                      full_rotary: bool, table: bool, device, row_bytes: int = 0, pos_table: bool = False,
                      sequence_rows: bool = False) -> int:
    """Rows of a group per program (a multiple of block_r) by the rules above. `sequence_rows`: a large call whose
    groups each read a table row of their own (`_TABLE_TILES_PER_SEQUENCE_ROW`)."""
    if table:
        if row_bytes:
            program_bytes = _POS_TABLE_THD_BYTES if pos_table else _TABLE_THD_BYTES
            return min(triton.cdiv(rows, block_r), max(1, program_bytes // (row_bytes * block_r))) * block_r
        if sequence_rows:
            return min(triton.cdiv(rows, block_r), _TABLE_TILES_PER_SEQUENCE_ROW) * block_r
        return block_r
    if spans_batch and element_size <= 2 and full_rotary:
        return triton.cdiv(_EVAL_ROWS_16BIT, block_r) * block_r
    target = _PROGRAMS_PER_SM * _sm_count(device)
    splits = min(triton.cdiv(target, max(n_groups, 1)), triton.cdiv(rows, block_r)) if n_groups < target else 1
    return triton.cdiv(triton.cdiv(rows, splits), block_r) * block_r


def magic(d: int) -> int:
    """The constants of `kernels._common._divmod` for a divisor 1 <= d < 2**31: m = 2**32 * (2**l - d) // d + 1 with
    l = ceil(log2 d), so that n // d = (umulhi(n, m) + n) >> l for every 0 <= n < 2**31. Packed as
    m + 2**32 * (32 + l): bit 37 set keeps the value above int32, so Triton always passes it as int64."""
    if not 1 <= d < 2**31:
        raise ValueError(f"divisor {d} outside [1, 2**31)")
    shift = (d - 1).bit_length()
    return (2**32 * (2**shift - d) // d + 1) + ((32 + shift) << 32)


def _magic_args(**divisors: int) -> dict:
    """Kernel arguments magic_<name> for each divisor (a count of an empty tensor's dims may be 0: never divided)."""
    return {f"magic_{name}": magic(max(d, 1)) for name, d in divisors.items()}


def _check_index_range(programs: int, rows: int) -> None:
    """The kernel's program and row indices are int32 (`rope.kernels._common._program`)."""
    if max(programs, rows) >= 2**31:
        raise ValueError(f"t: {rows} rows (b*h, or q and k heads) per position in {programs} programs; "
                         f"at most {2**31 - 1} of each are supported")


def _inner(roles: tuple, spans_batch: bool, n_batch: int, heads: int, rows_per_program: int, chunks: int) -> int:
    """Chunks of a group's rows that lie next to each other in memory (the kernel's `inner`). A group's
    rows are contiguous unless it spans the batch and the batch stride exceeds the sequence stride
    (bshd): then only one batch entry's chunks are, if they tile its `heads` rows (0: no such runs).
    Any divisor of `chunks` is correct: the order is a matter of speed only."""
    stride_s, stride_b = roles[0], roles[1]
    if not spans_batch or n_batch == 1 or stride_b <= stride_s:
        return chunks
    if rows_per_program < heads and heads % rows_per_program == 0:
        return heads // rows_per_program
    return 1


def _groups(layout, tensor_format: str, has_start: bool, h: int):
    """(number of groups, rows per group, whether a group is one (s, b) pair)."""
    per_batch = has_start and tensor_format != "thd"
    if per_batch or tensor_format == "thd":
        return (layout.s * layout.b if per_batch else layout.s), h, per_batch
    return layout.s, layout.b * h, per_batch


def make_plan(x: torch.Tensor, layout, tensor_format: str, interleaved: bool, has_start: bool,
              cp_size: int, cp_rank: int, angles: Angles, backward: bool, inplace: bool = False,
              pos_table: bool = False, k: torch.Tensor | None = None, pos_strides: tuple = (0, 1, 0),
              norm: int = 0, eps: float = 0.0, saved: tuple = (), schedule: str | None = None,
              permute: bool = False, tail_first: bool = False, keep_order: bool = False) -> Plan:
    """The plan for x, or with `k` for x = q and k in one launch (same tokens, head dim and dtype; head
    counts may differ). `angles`: what the kernel reads (`Angles`); `pos_table`: the kernel's
    cu_seqlens_or_positions argument holds one position per token, at the (stream, s, b) strides `pos_strides`.
    `norm` (1, or 2 for Gemma's 1 + w): q and k RMS-normalised per head first (`rope_qknorm_kernel`); backward,
    `saved` holds the inputs (q, k) while x and k are the output gradients. `schedule` (a call's forward; None for
    a gradient): None or "float32", float32 math (each product and the sum rounded to float32, as PyTorch's
    operations: no plan fuses a multiply-add, `Plan`), then one rounding to the output; "eager", the PyTorch
    expression run eagerly in the output dtype (`EAGER`: each operand, product and the sum rounded to it).
    `backward` is the direction (a call's `inverse` forward runs backward). `permute`: pairs read interleaved and
    written half-split, the backward the other way round (`PERMUTE`). `tail_first`: the rotated channels are the
    head's last `layout.rot_dim`, and the channels before them are copied (`ROT_START`). `keep_order`: a new output
    keeps the memory order of its input as PyTorch's elementwise operations do (`empty_like`, `_like`)."""
    tensors = (x,) if k is None else (x, k)
    table = angles.table
    # angles differ per batch entry: a group is one (s, b) pair
    per_row = has_start or angles.stride_b != 0 or (pos_table and pos_strides[2] != 0 and layout.b > 1)
    # a table row per token of each sequence, read by one group only (transformers' per-sequence tables)
    sequence_table = table and angles.stride_b != 0 and angles.stride_m == 0 and not interleaved
    n_groups, q_rows, per_batch = _groups(layout, tensor_format, per_row, layout.h)
    k_rows = 0 if k is None else _groups(layout, tensor_format, per_row, k.shape[-2])[1]
    rows = q_rows + k_rows
    spans_batch = not per_batch and tensor_format != "thd"
    # bytes per row of thd programs that search cu_seqlens in several rounds, or read the position table
    row_bytes = x.element_size() * layout.d if tensor_format == "thd" and layout.n_seqs >= _SEARCH_FANOUT else 0
    tensor_bytes = sum(t.numel() for t in tensors) * x.element_size()
    sequence_rows = sequence_table and not norm and _large(tensor_bytes, x.device)
    if norm:
        # A row's sum of squares (backward: its dot products) is reduced in the order of the tile's layout: a tile
        # fixed by the row's shape alone, not by the call's row count or size, keeps each row's result independent
        # of what else the call holds (batch invariance, docs/contract.md), at large shapes the tile they take anyway.
        table_tile = (_TABLE_ROWS, _TABLE_BYTES_PER_THREAD) if table else None
        tile_rows = _NORM_TILE_ROWS
    else:
        table_tile = (_table_tile(tensor_bytes, x.device, spans_batch, angles.stride_m != 0, sequence_table)
                      if table else None)
        tile_rows = max(q_rows, k_rows)
    block_r, block_half, block_tail, num_warps = _tile(layout.d, layout.rot_dim, interleaved, x.element_size(),
                                                       tile_rows, table_tile)
    if norm and backward:
        rows_per_program = min(triton.cdiv(rows, block_r), max(1, _NORM_ROWS // block_r)) * block_r
    else:
        rows_per_program = _rows_per_program(n_groups, rows, block_r, spans_batch, x.element_size(),
                                             layout.rot_dim == layout.d, table, x.device,
                                             row_bytes, pos_table, sequence_rows)
    if norm:
        block_tail = max(block_tail, 1)  # the norm's tail is stored in place too: one masked column where none
    chunks = triton.cdiv(rows, rows_per_program)
    _check_index_range(n_groups * chunks, rows + rows_per_program)
    # The joint rows of q and k (q's b x h, then k's) hold no run of one batch entry's heads.
    inner = _inner(_roles(x, tensor_format), spans_batch, layout.b, layout.h if k is None else 0, rows_per_program,
                   chunks)
    kernel = rope_kernel if k is None else rope_qk_kernel
    names = ("x", "out") if k is None else ("q", "q_out", "k", "k_out")
    like = keep_order and not inplace  # the outputs are `empty_like`'s (`Plan.dense`)
    outs = (_like(t, tensor_format) if like else _out_roles(t, tensor_format, inplace) for t in tensors)
    roles = [r for t, o in zip(tensors, outs, strict=True) for r in (_roles(t, tensor_format), o)]
    args = dict(
        rows_per_program=rows_per_program, n_groups=n_groups, inner=inner, seq_len=layout.s, n_seqs=layout.n_seqs,
        freqs_len=angles.length, cp_size=cp_size, cp_rank=cp_rank, n_batch=layout.b,
        **_magic_args(groups=n_groups, inner=inner, batch=layout.b),
        **{f"{name}_strides": tuple(rs) for name, rs in zip(names, roles, strict=True)},
        stride_fs=angles.stride_s, stride_fb=angles.stride_b, stride_fd=angles.stride_d, stride_fm=angles.stride_m,
        positions_strides=(pos_strides[1], pos_strides[2], pos_strides[0]),
        HEAD_DIM=layout.d, ROT_DIM=layout.rot_dim, INTERLEAVED=interleaved,
        IS_THD=tensor_format == "thd", GROUP_PER_BATCH=per_batch, HAS_START=has_start, USE_CP=cp_size > 1,
        BLOCK_R=block_r, BLOCK_HALF=block_half, BLOCK_TAIL=block_tail, RNE_BF16=INTERPRET and x.dtype == torch.bfloat16,
        PIN=not INTERPRET, INPLACE=inplace, TABLE=table, SPLIT=chunks > 1,
        FANOUT=_SEARCH_FANOUT if tensor_format == "thd" and not pos_table else 1, POS_TABLE=pos_table,
        HALF_TABLE=angles.half, MROPE=angles.streams[0], SEC0=angles.streams[1], SEC1=angles.streams[2],
        SEC2=angles.streams[3],
    )
    if k is None:
        args.update(n_heads=layout.h, rows_per_group=q_rows, **_magic_args(heads=layout.h))
    else:
        args.update(q_heads=layout.h, k_heads=k.shape[-2], q_rows=q_rows, k_rows=k_rows,
                    **_magic_args(qheads=layout.h, kheads=k.shape[-2]))
        if not norm:
            args.update(QK=True)
    dense = tuple(like or _dense(t, tensor_format) for t in tensors)
    pdl = PDL and x.is_cuda and not norm
    if not norm:  # the rotation kernels take the direction as a value (one compile for both), QK norm as a constant
        args.update(backward=int(backward), PDL=pdl, EAGER=schedule == "eager",
                    PERMUTE=(2 if backward else 1) if permute else 0,
                    ROT_START=layout.d - layout.rot_dim if tail_first else 0, MULTI_TILE=rows_per_program > block_r)
    if norm:
        items = n_groups * chunks
        progs = min(items, _NORM_PROGRAMS_PER_SM * _sm_count(x.device)) if backward else items
        saved_roles = [_roles(t, tensor_format) for t in saved] if saved else [(0,) * 4] * 2
        # the eager schedule's reduction plan (constexprs: fixed where the schedule is not asked for, so that the
        # default's compiled variants do not follow the row count)
        eager = schedule == "eager"
        (lanes_q, vec, factor_q), (lanes_k, _, factor_k) = (
            torch_row_reduction(t.numel() // layout.d, layout.d) if eager else (1, 1, 1.0) for t in tensors)
        args.update(n_items=items, n_progs=max(progs, 1), eps=float(eps), NORM=norm, BACKWARD=backward,
                    q_input_strides=tuple(saved_roles[0]), k_input_strides=tuple(saved_roles[1]),
                    EAGER=eager, LANES_Q=lanes_q, LANES_K=lanes_k, VEC=vec, factor_q=factor_q,
                    factor_k=factor_k, MULTI_TILE=not backward and rows_per_program > block_r)
        cap = _NORM_FWD_MAXNREG if not backward and x.is_cuda and x.element_size() == 2 and not interleaved else None
        return Plan(rope_qknorm_kernel, (progs, 1, 1), kernel_args(rope_qknorm_kernel, NORM_POINTERS, args), num_warps,
                    x.device, dense, None if cap is None else dict(maxnreg=cap))
    pointers = ROTATE_POINTERS if k is None else ROTATE_QK_POINTERS
    options = dict(launch_pdl=True) if pdl else {}
    return Plan(kernel, (n_groups * chunks, 1, 1), kernel_args(kernel, pointers, args), num_warps, x.device, dense,
                options)


def _hook_present(hook) -> bool:
    # Triton >= 3.5 keeps an always-present hook chain (empty unless a profiler adds one); older, a callable or None.
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


_HOOK_OWNER = getattr(getattr(triton, "knobs", None), "runtime", None)
if _HOOK_OWNER is None:  # older Triton keeps the hooks on CompiledKernel
    _HOOK_OWNER = triton.compiler.CompiledKernel
# Triton >= 3.5: the chain's class (its instances always have `calls`); None for older Triton.
_HOOK_CHAIN = type(_HOOK_OWNER.launch_enter_hook) if hasattr(_HOOK_OWNER.launch_enter_hook, "calls") else None


def _hooks_set() -> bool:
    enter, exit_ = _HOOK_OWNER.launch_enter_hook, _HOOK_OWNER.launch_exit_hook
    if type(enter) is _HOOK_CHAIN and type(exit_) is _HOOK_CHAIN:
        return bool(enter.calls or exit_.calls)  # the usual case, on the hot path: no further calls
    return _hook_present(enter) or _hook_present(exit_)


def run(plan: Plan, pointers: tuple):
    """Launch `plan` on its pointer arguments (tensors, in the kernel's order)."""
    compiled = plan.compiled
    if compiled is not None and not _hooks_set():
        # The compiled kernel's C launcher, called as Triton's runner calls it without launch metadata or
        # hooks: no binding, specialization or cache lookup. The plan's key fixes all it was specialized on.
        g0, g1, g2 = plan.grid
        compiled.run(g0, g1, g2, raw_stream(plan.device), compiled.function, compiled.packed_metadata,
                     None, None, None, *pointers, *plan.scalars)
        return
    if compiled is not None:  # a profiler's launch hooks are set: take Triton's path, which calls them
        compiled[plan.grid](*pointers, *plan.scalars)
        return
    # compile options live in the compiled kernel: its launcher applies them (PDL) on every later call
    compiled = plan.kernel[plan.grid](*pointers, *plan.scalars, num_warps=plan.num_warps, **plan.options)
    if not INTERPRET:
        compiled._init_handles()
        plan.compiled = compiled


def plan_for(call, x, angles, backward, inplace=False, pos_table=False, k=None, pos_strides=(0, 1, 0),
             index_key=(None, None)) -> Plan:
    """The call's plan for x (with `k`: q = x and k in one launch), made on first use. `index_key`: the dtypes
    and 16-byte alignment of start_positions and of the token index or positions, which Triton specializes on
    like every pointer (a kernel compiled for int32 positions reads int64 ones as pairs of int32)."""
    # The call's key fixes x's strides where x is its own tensor (forward, the custom op), not a gradient.
    key = (backward, inplace, pos_table, pos_strides, x.stride() if backward or k is not None else None,
           x.data_ptr() % 16, angles.key, index_key)
    if k is not None:
        key += (k.shape, k.stride(), k.data_ptr() % 16)
    plan = call.plans.get(key)
    if plan is None:
        plan = make_plan(x, call.layout, call.tensor_format, call.interleaved, call.has_start, call.cp_size,
                         call.cp_rank, angles, backward != call.inverse, inplace, pos_table, k, pos_strides,
                         schedule=None if backward else call.schedule,
                         permute=call.permute, tail_first=call.tail_first, keep_order=call.keep_order)
        call.plans[key] = plan
    return plan


def angles_for(call, freqs):
    """What the kernel reads for `freqs`: its cached cos/sin tables (`rope._table`; half-split only:
    the interleaved kernel evaluating sin/cos is as fast), or, where no table may be used, `freqs`
    itself as float32 (the kernel then evaluates sin/cos)."""
    if not call.interleaved:
        angles = cos_sin_table(freqs, call.layout.freqs_len, call.layout.rot_dim, _half_split_tables)
        if angles is not None:
            return angles
    return freqs_angles(freqs, call.layout.freqs_len)


def _half_split_tables(cos, sin) -> Angles:
    # kept with the table (`cos_sin_table`): the record costs more host time than the table's lookup
    return table_angles(cos, sin, half=False)


def token_index_for(call, cu_seqlens):
    """What the kernel reads to place `thd` tokens, and whether it is the position table: the table
    cached per `cu_seqlens` (`rope._table`) where one may be used and a search of cu_seqlens would
    take several rounds, else `cu_seqlens` itself, which each program searches."""
    if call.tensor_format == "thd" and not call.has_start and call.layout.n_seqs >= _SEARCH_FANOUT:
        table = token_positions(cu_seqlens, call.layout.s, call.cp_size, call.cp_rank)
        if table is not None:
            return table, True
    return cu_seqlens, False


def _pointers(angles, start_positions, token_index):
    """The tensors of the kernels' cos_or_freqs, sin, start_positions and cu_seqlens_or_positions pointers (the last
    four of `ROTATE_POINTERS`). Unused index tensors still need a valid pointer argument; the kernel never reads
    them."""
    cos_or_freqs = angles.cos
    return cos_or_freqs, angles.sin, start_positions if start_positions is not None else cos_or_freqs, \
        token_index if token_index is not None else cos_or_freqs


def _index_key(start_positions, token_index) -> tuple:
    """What Triton specializes on in the index pointers: their dtypes and 16-byte alignment."""
    if start_positions is None and token_index is None:
        return _NO_INDEX
    return (None if start_positions is None else (start_positions.dtype, start_positions.data_ptr() % 16),
            None if token_index is None else (token_index.dtype, token_index.data_ptr() % 16))


_NO_INDEX = (None, None)


_NO_POS_STRIDES = (0, 1, 0)


def _pos_strides(positions) -> tuple:
    """(stream, s, b) strides of positions [T] (one stream, thd or s), or [streams, s, b] in kernel roles."""
    st = positions.stride()
    return (0, st[0], 0) if len(st) == 1 else st


def rotate(call, x, angles, start_positions, token_index, backward, inplace=False, pos_table=False):
    """Rotate x (or its gradient, `backward`) into a new tensor, or in place; returns it. With
    `pos_table`, `token_index` holds the positions, [T] or [streams, s, b] (thd: b = 1), any strides."""
    if call.empty:
        return x if inplace else empty(x)
    plan = plan_for(call, x, angles, backward, inplace, pos_table, None,
                    _pos_strides(token_index) if pos_table else _NO_POS_STRIDES,
                    _index_key(start_positions, token_index))
    out = x if inplace else empty(x, plan.dense[0])
    cos = angles.cos  # `_pointers`, inline on the hot path
    run(plan, (x, out, cos, angles.sin, cos if start_positions is None else start_positions,
               cos if token_index is None else token_index))
    return out


def rotate_qk(call, q, k, angles, start_positions, token_index, backward, inplace=False, pos_table=False):
    """`rotate` for q and k in one launch; returns (q_out, k_out)."""
    if not (q.numel() or k.numel()):
        return (q, k) if inplace else (empty(q), empty(k))
    plan = plan_for(call, q, angles, backward, inplace, pos_table, k,
                    _pos_strides(token_index) if pos_table else _NO_POS_STRIDES,
                    _index_key(start_positions, token_index))
    qo = q if inplace else empty(q, plan.dense[0])
    ko = k if inplace else empty(k, plan.dense[1])
    cos = angles.cos  # `_pointers`, inline on the hot path
    run(plan, (q, qo, k, ko, cos, angles.sin, cos if start_positions is None else start_positions,
               cos if token_index is None else token_index))
    return qo, ko


def _norm_plan(call, q, k, angles, backward, inplace, pos_table, pos_strides, index_key, norm, eps, weights,
               saved) -> Plan:
    """`plan_for` of the QK-norm kernel: the key adds the norm's form, eps, the weights' dtypes and alignment
    and, backward, the inputs' strides and alignment (Triton specializes on all but eps, a scalar of the plan)."""
    key = ("norm", norm, eps, backward, inplace, pos_table, pos_strides, q.stride(), q.data_ptr() % 16, angles.key,
           index_key, k.shape, k.stride(), k.data_ptr() % 16,
           *((w.dtype, w.data_ptr() % 16) for w in weights), *((t.stride(), t.data_ptr() % 16) for t in saved))
    plan = call.plans.get(key)
    if plan is None:
        plan = make_plan(q, call.layout, call.tensor_format, call.interleaved, call.has_start, call.cp_size,
                         call.cp_rank, angles, backward, inplace, pos_table, k, pos_strides, norm, eps, saved,
                         schedule=None if backward else call.schedule)
        call.plans[key] = plan
    return plan


def norm_rotate_qk(call, q, k, weights, norm, eps, angles, start_positions, token_index, pos_table=False,
                   inplace=False):
    """RoPE(RMSNorm(x) * w) of q and k in one launch (`weights`: (w_q, w_k), contiguous; norm 2: 1 + w), into
    new tensors or in place; returns (q_out, k_out)."""
    if not (q.numel() or k.numel()):
        return (q, k) if inplace else (empty(q), empty(k))
    pos_strides = _pos_strides(token_index) if pos_table else _NO_POS_STRIDES
    plan = _norm_plan(call, q, k, angles, False, inplace, pos_table, pos_strides,
                      _index_key(start_positions, token_index), norm, eps, weights, ())
    qo = q if inplace else empty(q, plan.dense[0])
    ko = k if inplace else empty(k, plan.dense[1])
    cos, sin, start, index = _pointers(angles, start_positions, token_index)
    run(plan, (q, qo, k, ko, cos, sin, start, index, *weights, q, k, cos))
    return qo, ko


def norm_rotate_qk_backward(call, grad_q, grad_k, q, k, weights, norm, eps, angles, start_positions, token_index,
                            pos_table=False):
    """The vector-Jacobian product of `norm_rotate_qk` at inputs (q, k) for output gradients (grad_q, grad_k):
    (grad of q, grad of k, grad of w_q, grad of w_k), the weights' summed over tokens and heads in a fixed order
    (each program's partial sums, then their sum over programs: deterministic, no atomics)."""
    d = q.shape[-1]
    if not (q.numel() or k.numel()):
        zero = (torch.zeros(d, dtype=w.dtype, device=w.device) for w in weights)
        return (empty(q), empty(k), *zero)
    pos_strides = _pos_strides(token_index) if pos_table else _NO_POS_STRIDES
    plan = _norm_plan(call, grad_q, grad_k, angles, True, False, pos_table, pos_strides,
                      _index_key(start_positions, token_index), norm, eps, weights, (q, k))
    gq, gk = empty(grad_q, plan.dense[0]), empty(grad_k, plan.dense[1])
    # per program: q's and k's partial weight gradients, then the kernel's scratch (`rope_qknorm_kernel`)
    part = torch.empty((plan.grid[0], 2 * d + plan.scalars[_NORM_BLOCK_R]), dtype=torch.float32, device=q.device)
    cos, sin, start, index = _pointers(angles, start_positions, token_index)
    run(plan, (grad_q, gq, grad_k, gk, cos, sin, start, index, *weights, q, k, part))
    gw = part[:, :2 * d].sum(0).view(2, d)
    return gq, gk, gw[0].to(weights[0].dtype), gw[1].to(weights[1].dtype)


# RoPE fused with the KV-cache write (`kernels.rope_cache_kernel`): plans per signature, as `plan_for`'s.
_CACHE_PLANS = _memo.memo("launch plans of the KV-cache write", 1024)


def _align(*tensors) -> tuple:
    return tuple(t.data_ptr() % 16 for t in tensors)


def _cache_plan(q, k, v, key_cache, value_cache, slots, positions, cos, sin, rows, interleaved, fp8) -> Plan:
    """The plan of one call: a program takes one tile of a token's q and k rows (the table kernel's tile, as for
    thd with positions) and reads the token's slot once."""
    t, hq, d = q.shape
    hk = k.shape[1]
    rot = 2 * cos.shape[1]
    block_r, block_half, block_tail, num_warps = _tile(d, rot, interleaved, q.element_size(), hq + hk,
                                                       _table_tile((q.numel() + 2 * k.numel()) * q.element_size(),
                                                                   q.device, False))
    chunks = triton.cdiv(hq + hk, block_r)
    _check_index_range(t * chunks, hq + hk + block_r)
    n_blocks, block_size = key_cache.shape[:2]
    args = dict(
        q_heads=hq, k_heads=hk, q_rows=hq, k_rows=hk, n_groups=t, inner=chunks, **_magic_args(groups=t, inner=chunks),
        freqs_len=rows, n_slot_entries=slots.shape[0], n_cache_slots=n_blocks * block_size, block_size=block_size,
        q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride(), key_cache_strides=key_cache.stride(),
        value_cache_strides=value_cache.stride(), stride_fs=cos.stride(0), stride_fd=cos.stride(1),
        stride_ps=positions.stride(0), stride_slot=slots.stride(0),
        HEAD_DIM=d, ROT_DIM=rot, INTERLEAVED=interleaved, BLOCK_R=block_r, BLOCK_HALF=block_half,
        BLOCK_TAIL=block_tail, BLOCK_D=triton.next_power_of_2(d), RNE_BF16=INTERPRET and q.dtype == torch.bfloat16,
        SPLIT=chunks > 1, FP8=fp8, FP8_BITS=INTERPRET and fp8,
    )
    return Plan(rope_cache_kernel, (t * chunks, 1, 1), kernel_args(rope_cache_kernel, CACHE_POINTERS, args),
                num_warps, q.device, (True,))


def rotate_and_cache(q, k, v, key_cache, value_cache, slots, positions, cos, sin, rows, interleaved, fp8=False,
                     k_scale=None, v_scale=None) -> None:
    """Rotate q [T, hq, d] and k [T, hk, d] in place at `positions` [T] of the half tables cos, sin [rows, rot/2],
    and store the rotated k and v [T, hk, d] at slot slots[t] of key_cache and value_cache [n_blocks, block_size,
    hk, d] (slot = block * block_size + offset); tokens past `slots`, or at a slot outside the caches, are rotated
    only. fp8: the caches are float8_e4m3fn, holding x / scale (k_scale, v_scale: float32, one element each)."""
    if q.shape[0] == 0:
        return
    ks = k_scale if fp8 else cos
    vs = v_scale if fp8 else cos
    tensors = (q, k, v, key_cache, value_cache, slots, positions, cos, sin, ks, vs)
    key = (interleaved, fp8, rows, *((x.shape, x.stride(), x.dtype) for x in tensors), _align(*tensors))
    plan = _CACHE_PLANS.get(key)
    if plan is None:
        plan = _CACHE_PLANS.put(key, _cache_plan(q, k, v, key_cache, value_cache, slots, positions, cos, sin, rows,
                                                 interleaved, fp8))
    run(plan, tensors)
