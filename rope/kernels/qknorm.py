"""RoPE of per-head RMS-normalised q and k (`rope_qknorm_kernel`; docs/design.md, "QK-RMSNorm fused with RoPE").

NORM (1: x * r * w, 2: Gemma's x * r * (1 + w)), r = rsqrt(mean(x^2) + eps) over the whole head: every row of a
tile is one whole head (channels a, b and the tail), so the norm is a reduction along the tile's rows. The tail
(channels ROT_DIM..HEAD_DIM) is normalised and weighted, not copied, so it is loaded and stored in place too (the
launcher gives it a tile of one masked column where there is none). Backward: the program loops over work items
(pid, pid + n_progs, ...) and writes its partial weight gradients, q's then k's, to row pid of
weight_grad_partials [n_progs, 2 * HEAD_DIM + BLOCK_R]; the launcher sums the rows in a fixed order (no atomics). The
row's last BLOCK_R entries are the program's scratch (each tile's r).
"""
import triton
import triton.language as tl

from ._common import (
    _group_angles,
    _group_of,
    _load_pairs,
    _pair_columns,
    _rows,
    _store_pairs,
    _store_tail,
    _tile_ptrs,
)
from .rope import QK_COUNTS, _in_output, _rotated_eager

_NORM_COUNTS = [n for n in QK_COUNTS if n != "backward"] + ["n_items", "n_progs"]  # its direction is a constexpr


@triton.jit
def _load_head(q_rows_ptr, k_rows_ptr, in_q, rows_ok, stride_qd, stride_kd, HEAD_DIM: tl.constexpr,
               ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
               BLOCK_TAIL: tl.constexpr):
    """A tile of whole heads as float32 (a, b, tail), zero in the lanes past the head, so that row sums
    are over the head's channels only."""
    k_ok, col_a, col_b = _pair_columns(ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_HALF=BLOCK_HALF)
    t_ok = (ROT_DIM + tl.arange(0, BLOCK_TAIL)) < HEAD_DIM
    xa, xb, xt = _load_pairs(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, rows_ok=rows_ok,
                             stride_qd=stride_qd, stride_kd=stride_kd, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM,
                             INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL,
                             LOAD_TAIL=BLOCK_TAIL > 0)
    return (tl.where(k_ok[None, :], xa, 0.0), tl.where(k_ok[None, :], xb, 0.0),
            tl.where(t_ok[None, :], xt.to(tl.float32), 0.0))


@triton.jit
def _row_sum(x):
    """[rows, N] -> [rows], N a power of two: each row summed as a balanced tree, adjacent pairs first (channels
    2j + 1 added to 2j, then the pairs' sums the same way, ...). Each step is a sum over an axis of 2, which is one
    addition whatever layout the compiler gives the tile (addition commutes), so the order is fixed by N alone;
    `tl.sum` adds in the order of the tile's register layout, which Triton picks by the rows' alignment too."""
    for _ in tl.static_range(10):  # N <= 1024 = 2^10 halvings, the rest skipped at compile time
        if x.shape[1] > 1:
            x = tl.sum(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)), axis=2)
    return tl.reshape(x, (x.shape[0],))


@triton.jit
def _inv_rms(xa, xb, xt, eps, HEAD_DIM: tl.constexpr):
    """r = rsqrt(mean(x^2) + eps) per row, as a [rows] vector (float32): the sums of squares of a, of b and of the
    tail, each as `_row_sum`'s tree, then (a + b) + tail. The order is fixed by the head's shape alone: batch
    invariant whatever the rows' alignment."""
    ss = (_row_sum(x=xa * xa) + _row_sum(x=xb * xb)) + _row_sum(x=xt * xt)
    return tl.rsqrt(ss / HEAD_DIM + eps)


@triton.jit
def _eager_sum_of_squares(q_rows_ptr, k_rows_ptr, in_q, rows_ok, stride_qd, stride_kd, HEAD_DIM: tl.constexpr,
                          LANES: tl.constexpr, VEC: tl.constexpr):
    """Each row's sum of x^2 (float32) in the order of PyTorch's CUDA reduction of `x.float().pow(2).mean(-1)` over
    rows of HEAD_DIM channels (ATen's Reduce.cuh, torch 2.10 and later; docs/design.md): LANES threads share a row.
    Without vectorized loads (VEC 1) thread j takes channels j, j + LANES, ..., its m-th into accumulator m % 4;
    with them (VEC 4, HEAD_DIM >= 128) vectors j, j + LANES, ... of 4 channels, channel i of each into accumulator
    i. A thread's sum is ((a0 + a1) + a2) + a3, each accumulator starting at 0; then the threads' sums are folded in
    half, lane j adding lane j + h for h = LANES / 2, ..., 1. Channels past the head add 0, which changes no sum."""
    lanes = tl.arange(0, LANES)
    steps: tl.constexpr = (HEAD_DIM + 4 * LANES - 1) // (4 * LANES)
    ok = rows_ok[:, None]
    if VEC == 4:
        # step k's vectors are the contiguous channels [4 LANES k, 4 LANES (k + 1)): one wide load, split into the
        # four accumulators' channels in registers
        acc0 = tl.zeros((in_q.shape[0], LANES), tl.float32)
        acc1, acc2, acc3 = acc0, acc0, acc0
        for step in tl.static_range(steps):
            cols = step * 4 * LANES + tl.arange(0, 4 * LANES)
            x = tl.load(_tile_ptrs(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, cols=cols,
                                   stride_qd=stride_qd, stride_kd=stride_kd),
                        mask=ok & (cols < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
            x0, x1, x2, x3 = _vector_squares(x=x)
            acc0, acc1, acc2, acc3 = acc0 + x0, acc1 + x1, acc2 + x2, acc3 + x3
        thread = ((acc0 + acc1) + acc2) + acc3
    else:
        thread = tl.zeros((in_q.shape[0], LANES), tl.float32)  # 0 + a0 is a0: the squares are not negative
        for i in tl.static_range(4):  # thread j's m-th channel j + m LANES into accumulator m % 4
            acc = tl.zeros((in_q.shape[0], LANES), tl.float32)
            for step in tl.static_range(steps):
                cols = (4 * step + i) * LANES + lanes
                x = tl.load(_tile_ptrs(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, cols=cols,
                                       stride_qd=stride_qd, stride_kd=stride_kd),
                            mask=ok & (cols < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
                acc = acc + x * x
            thread = thread + acc
    return _fold_lanes(thread=thread)


@triton.jit
def _fold_lanes(thread):
    """[rows, L] threads' sums folded in half, lane j adding lane j + h for h = L / 2, ..., 1: [rows]. Each halving
    is a sum over an axis of 2, which is one addition whatever order the compiler picks (addition commutes); it
    reduces across the lanes that hold the halves without the layout change that a split of them would cost
    (1.07 x the default schedule's time against 1.72 x, Qwen3-8B prefill on an H200, docs/design.md)."""
    for _ in tl.static_range(10):  # L <= 512 = 2^9 halvings, the rest skipped at compile time
        if thread.shape[1] > 1:
            thread = tl.sum(tl.reshape(thread, (thread.shape[0], 2, thread.shape[1] // 2)), axis=1)
    return tl.reshape(thread, (thread.shape[0],))


@triton.jit
def _vector_squares(x):
    """[rows, 4 G] -> four [rows, G]: the squares of channel i = 0..3 of each vector of 4 consecutive channels, split
    in registers by the channel's place i = 2 i_hi + i_lo."""
    even, odd = tl.split(tl.reshape(x * x, (x.shape[0], x.shape[1] // 4, 2, 2)))  # i_lo 0 and 1: [rows, G, i_hi]
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _vector_sums(xa):
    """[rows, 4 G] -> [rows, G]: ((x0^2 + x1^2) + x2^2) + x3^2 of each vector of 4 consecutive channels."""
    x0, x1, x2, x3 = _vector_squares(x=xa)
    return ((x0 + x1) + x2) + x3


@triton.jit
def _eager_inv_rms(q_rows_ptr, k_rows_ptr, in_q, rows_ok, stride_qd, stride_kd, xa, xb, eps, factor_q, factor_k,
                   HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   LANES_Q: tl.constexpr, LANES_K: tl.constexpr, VEC: tl.constexpr):
    """r = rsqrt(mean(x^2) + eps) per row as PyTorch's CUDA kernels compute it, as a [rows, 1] column: the sum
    (`_eager_sum_of_squares`, q's rows and k's each with their own tensor's thread count), times the mean's factor
    float32(rows) / float32(rows * HEAD_DIM) of its tensor, plus eps, then the approximate rsqrt (`rsqrtf`).
    Where each thread of PyTorch's takes one vector of 4 channels (HEAD_DIM = 4 LANES: d 128, as Qwen3's) and the
    head is rotated whole, half-split, the tile's a and b halves are lanes [0, L/2) and [L/2, L): the threads' sums
    come from the registers loaded for the rotation, and the first halving is a's plus b's. The other shapes
    reload the head in PyTorch's order (from L1: 1.07 x the default's time against 0.98 x, Qwen3-8B prefill on an
    H200)."""
    if (VEC == 4 and not INTERLEAVED and ROT_DIM == HEAD_DIM and HEAD_DIM == 4 * LANES_Q and LANES_K == LANES_Q
            and BLOCK_HALF == HEAD_DIM // 2):
        ss = _fold_lanes(thread=_vector_sums(xa=xa) + _vector_sums(xa=xb))
    else:
        ss = _eager_sum_of_squares(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, rows_ok=rows_ok,
                                   stride_qd=stride_qd, stride_kd=stride_kd, HEAD_DIM=HEAD_DIM, LANES=LANES_Q,
                                   VEC=VEC)
        if LANES_K != LANES_Q:
            ss_k = _eager_sum_of_squares(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, rows_ok=rows_ok,
                                         stride_qd=stride_qd, stride_kd=stride_kd, HEAD_DIM=HEAD_DIM, LANES=LANES_K,
                                         VEC=VEC)
            ss = tl.where(in_q, ss, ss_k)
    return tl.rsqrt(ss * tl.where(in_q, factor_q, factor_k) + eps)[:, None]


@triton.jit
def _store_head(q_rows_ptr, k_rows_ptr, in_q, rows_ok, stride_qd, stride_kd, out_a, out_b, out_t,
                out_ty: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, RNE_BF16: tl.constexpr,
                INPLACE: tl.constexpr):
    """Store a tile of whole heads (float32 a, b and tail), each element rounded once."""
    _store_pairs(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qd,
                 stride_kd=stride_kd, a=out_a, b=out_b, out_ty=out_ty, RNE_BF16=RNE_BF16, ROT_DIM=ROT_DIM,
                 INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF, BARRIER=INPLACE)
    _store_tail(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qd,
                stride_kd=stride_kd, tail=out_t, out_ty=out_ty, RNE_BF16=RNE_BF16, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM,
                BLOCK_TAIL=BLOCK_TAIL)


@triton.jit
def _tile_weights(q_weight_ptr, k_weight_ptr, in_q, rows_ok, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
                  INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, NORM: tl.constexpr):
    """The weights of a tile's rows (q's or k's) for channels a, b and the tail, as float32 tiles in the rows'
    layout (Gemma's form: 1 + w). Read per row from L1, they take a tile's registers, not both tensors' rows."""
    k_ok, col_a, col_b = _pair_columns(ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_HALF=BLOCK_HALF)
    t_cols = ROT_DIM + tl.arange(0, BLOCK_TAIL)
    rows = tl.zeros_like(in_q.to(tl.int32))  # every row reads its tensor's one weight vector
    wq_rows, wk_rows = q_weight_ptr + rows, k_weight_ptr + rows
    if INTERLEAVED:  # as _load_pairs: one contiguous slice split in registers, so that the loads stay wide
        cols = tl.arange(0, 2 * BLOCK_HALF)
        w = tl.load(_tile_ptrs(q_rows_ptr=wq_rows, k_rows_ptr=wk_rows, in_q=in_q, cols=cols, stride_qd=1,
                               stride_kd=1),
                    mask=rows_ok[:, None] & (cols < ROT_DIM)[None, :], other=0.0).to(tl.float32)
        wa, wb = tl.split(tl.reshape(w, (w.shape[0], BLOCK_HALF, 2)))
    else:
        m = rows_ok[:, None] & k_ok[None, :]
        wa = tl.load(_tile_ptrs(q_rows_ptr=wq_rows, k_rows_ptr=wk_rows, in_q=in_q, cols=col_a, stride_qd=1,
                                stride_kd=1), mask=m, other=0.0).to(tl.float32)
        wb = tl.load(_tile_ptrs(q_rows_ptr=wq_rows, k_rows_ptr=wk_rows, in_q=in_q, cols=col_b, stride_qd=1,
                                stride_kd=1), mask=m, other=0.0).to(tl.float32)
    wt = tl.load(_tile_ptrs(q_rows_ptr=wq_rows, k_rows_ptr=wk_rows, in_q=in_q, cols=t_cols, stride_qd=1, stride_kd=1),
                 mask=rows_ok[:, None] & (t_cols < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
    if NORM == 2:
        wa, wb, wt = wa + 1.0, wb + 1.0, wt + 1.0
    return wa, wb, wt


@triton.jit
def _norm_rotate_store(q_rows_ptr, k_rows_ptr, in_q, rows_ok, stride_qd, stride_kd, xa, xb, xt, cos_a, cos_b, sin_a,
                       sin_b, q_weight_ptr, k_weight_ptr, eps, x_rows_q, x_rows_k, x_stride_qd, x_stride_kd,
                       factor_q, factor_k, out_ty: tl.constexpr, HEAD_DIM: tl.constexpr,
                       ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, RNE_BF16: tl.constexpr,
                       INPLACE: tl.constexpr, NORM: tl.constexpr, EAGER: tl.constexpr, LANES_Q: tl.constexpr,
                       LANES_K: tl.constexpr, VEC: tl.constexpr):
    """Forward of a loaded tile of whole heads: RMS-normalise each row, weight it, rotate it, store it. EAGER: the
    schedule of Qwen3's (NORM 1) or Gemma 3's (NORM 2) RMSNorm and transformers' rotation run eagerly on CUDA
    (docs/contract.md): r as `_eager_inv_rms`; Qwen3 rounds x * r to the output dtype, then w times it; Gemma rounds
    x * r * (1 + w) once; the rotation takes each product and the sum rounded (`rope_qk_kernel`'s EAGER)."""
    if EAGER:
        r = _eager_inv_rms(q_rows_ptr=x_rows_q, k_rows_ptr=x_rows_k, in_q=in_q, rows_ok=rows_ok, stride_qd=x_stride_qd,
                           stride_kd=x_stride_kd, xa=xa, xb=xb, eps=eps, factor_q=factor_q, factor_k=factor_k,
                           HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_HALF=BLOCK_HALF,
                           LANES_Q=LANES_Q, LANES_K=LANES_K, VEC=VEC)
    else:
        r = _inv_rms(xa=xa, xb=xb, xt=xt, eps=eps, HEAD_DIM=HEAD_DIM)[:, None]
    wa, wb, wt = _tile_weights(q_weight_ptr=q_weight_ptr, k_weight_ptr=k_weight_ptr, in_q=in_q, rows_ok=rows_ok,
                               HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_HALF=BLOCK_HALF,
                               BLOCK_TAIL=BLOCK_TAIL, NORM=NORM)
    if EAGER and NORM == 1:
        ya = _in_output(v=wa * _in_output(v=xa * r, out_ty=out_ty, RNE_BF16=RNE_BF16), out_ty=out_ty,
                        RNE_BF16=RNE_BF16)
        yb = _in_output(v=wb * _in_output(v=xb * r, out_ty=out_ty, RNE_BF16=RNE_BF16), out_ty=out_ty,
                        RNE_BF16=RNE_BF16)
        yt = _in_output(v=wt * _in_output(v=xt * r, out_ty=out_ty, RNE_BF16=RNE_BF16), out_ty=out_ty,
                        RNE_BF16=RNE_BF16)
    elif EAGER:
        ya = _in_output(v=xa * r * wa, out_ty=out_ty, RNE_BF16=RNE_BF16)
        yb = _in_output(v=xb * r * wb, out_ty=out_ty, RNE_BF16=RNE_BF16)
        yt = xt * r * wt
    else:
        ya, yb, yt = xa * r * wa, xb * r * wb, xt * r * wt
    if EAGER:
        # eager QK norm takes its tables in q's dtype (`check_norm_schedule`)
        out_a, out_b = _rotated_eager(xa=ya, xb=yb, cos_a=cos_a, cos_b=cos_b, sin_a=sin_a, sin_b=sin_b, out_ty=out_ty,
                                      RNE_BF16=RNE_BF16, ANGLES_IN_OUT=True)
    else:
        out_a, out_b = ya * cos_a - yb * sin_a, yb * cos_b + ya * sin_b
    _store_head(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qd,
                stride_kd=stride_kd, out_a=out_a, out_b=out_b, out_t=yt,
                out_ty=out_ty, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R,
                BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL, RNE_BF16=RNE_BF16, INPLACE=INPLACE)


@triton.jit(do_not_specialize=_NORM_COUNTS)
def rope_qknorm_kernel(
    q_ptr, q_out_ptr, k_ptr, k_out_ptr, cos_or_freqs_ptr, sin_ptr, start_positions_ptr, cu_seqlens_or_positions_ptr,
    q_weight_ptr, k_weight_ptr, q_input_ptr, k_input_ptr, weight_grad_partials_ptr,
    q_heads, k_heads, n_batch, q_rows, k_rows, rows_per_program, n_groups, inner,
    magic_groups, magic_inner, magic_batch, magic_qheads, magic_kheads,
    seq_len, n_seqs, freqs_len, cp_size, cp_rank, n_items, n_progs, eps, factor_q, factor_k,
    q_strides, q_out_strides, k_strides, k_out_strides, stride_fs, stride_fb, stride_fd, stride_fm, positions_strides,
    q_input_strides, k_input_strides,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
    IS_THD: tl.constexpr, GROUP_PER_BATCH: tl.constexpr, HAS_START: tl.constexpr, USE_CP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, RNE_BF16: tl.constexpr,
    PIN: tl.constexpr, INPLACE: tl.constexpr, TABLE: tl.constexpr, SPLIT: tl.constexpr, FANOUT: tl.constexpr,
    POS_TABLE: tl.constexpr, HALF_TABLE: tl.constexpr, MROPE: tl.constexpr, SEC0: tl.constexpr,
    SEC1: tl.constexpr, SEC2: tl.constexpr, NORM: tl.constexpr, EAGER: tl.constexpr, LANES_Q: tl.constexpr,
    LANES_K: tl.constexpr, VEC: tl.constexpr, MULTI_TILE: tl.constexpr,
):
    """q and k of one layer normalised per head (RMSNorm with weights w_q, w_k) and rotated, in one launch
    (forward), or its vector-Jacobian product (BACKWARD: q_ptr and k_ptr hold the output gradients, q_input_ptr and
    k_input_ptr the forward's inputs q and k, strides q_input_strides and k_input_strides), with the programs'
    partial weight gradients. Pointers, strides and angles as in `rope_qk_kernel`. EAGER (forward): the schedule of
    the PyTorch expressions run eagerly on CUDA (`_norm_rotate_store`); LANES_Q and LANES_K, the threads PyTorch's
    reduction gives a row of q and of k (by each tensor's row count), VEC its vectorized loads, factor_q and
    factor_k its mean's factors. MULTI_TILE (forward): a program may hold more than one tile of rows."""
    stride_qs, stride_qb, stride_qh, stride_qd = q_strides
    stride_qos, stride_qob, stride_qoh, stride_qod = q_out_strides
    stride_ks, stride_kb, stride_kh, stride_kd = k_strides
    stride_kos, stride_kob, stride_koh, stride_kod = k_out_strides
    stride_ps, stride_pb, stride_pm = positions_strides
    stride_sqs, stride_sqb, stride_sqh, stride_sqd = q_input_strides
    stride_sks, stride_skb, stride_skh, stride_skd = k_input_strides
    k_ok, col_a, col_b = _pair_columns(ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_HALF=BLOCK_HALF)
    t_cols = ROT_DIM + tl.arange(0, BLOCK_TAIL)
    t_ok = t_cols < HEAD_DIM
    out_ty = q_out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    if not BACKWARD:
        # One work item per program (the launcher's grid). As in rope_qk_kernel, the first tile's loads are issued
        # before the position, the angles and the weights are found.
        s_idx, b_idx, r_begin, r_end, q_base, q_out_base, k_base, k_out_base = _group_of(
            item=pid, n_groups=n_groups, inner=inner, magic_groups=magic_groups, magic_inner=magic_inner,
            magic_batch=magic_batch, n_batch=n_batch, rows_per_program=rows_per_program, q_rows=q_rows,
            k_rows=k_rows, stride_qs=stride_qs, stride_qb=stride_qb, stride_qos=stride_qos, stride_qob=stride_qob,
            stride_ks=stride_ks, stride_kb=stride_kb, stride_kos=stride_kos, stride_kob=stride_kob,
            GROUP_PER_BATCH=GROUP_PER_BATCH, SPLIT=SPLIT)
        xq, xk, oq, ok, in_q, rows_ok = _rows(
            q_ptr=q_ptr, q_out_ptr=q_out_ptr, k_ptr=k_ptr, k_out_ptr=k_out_ptr, q_base=q_base, q_out_base=q_out_base,
            k_base=k_base, k_out_base=k_out_base, r0=r_begin, r_end=r_end, q_rows=q_rows, q_heads=q_heads,
            k_heads=k_heads, magic_qheads=magic_qheads, magic_kheads=magic_kheads, stride_qb=stride_qb,
            stride_qh=stride_qh, stride_qob=stride_qob, stride_qoh=stride_qoh, stride_kb=stride_kb,
            stride_kh=stride_kh, stride_kob=stride_kob, stride_koh=stride_koh, GROUP_PER_BATCH=GROUP_PER_BATCH,
            BLOCK_R=BLOCK_R, QK=True)
        xa, xb, xt = _load_head(q_rows_ptr=xq, k_rows_ptr=xk, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qd,
                                stride_kd=stride_kd, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED,
                                BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL)
        cos_a, cos_b, sin_a, sin_b = _group_angles(
            s_idx=s_idx, b_idx=b_idx, cos_or_freqs_ptr=cos_or_freqs_ptr, sin_ptr=sin_ptr,
            start_positions_ptr=start_positions_ptr, cu_seqlens_or_positions_ptr=cu_seqlens_or_positions_ptr,
            seq_len=seq_len, n_seqs=n_seqs, freqs_len=freqs_len, cp_size=cp_size, cp_rank=cp_rank,
            stride_fs=stride_fs, stride_fb=stride_fb, stride_fd=stride_fd, stride_fm=stride_fm, stride_ps=stride_ps,
            stride_pb=stride_pb, stride_pm=stride_pm, ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, backward=False,
            IS_THD=IS_THD, HAS_START=HAS_START, USE_CP=USE_CP, BLOCK_HALF=BLOCK_HALF, PIN=PIN, TABLE=TABLE,
            FANOUT=FANOUT, POS_TABLE=POS_TABLE, HALF_TABLE=HALF_TABLE, MROPE=MROPE, SEC0=SEC0, SEC1=SEC1, SEC2=SEC2)
        _norm_rotate_store(q_rows_ptr=oq, k_rows_ptr=ok, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qod,
                           stride_kd=stride_kod, xa=xa, xb=xb, xt=xt, cos_a=cos_a, cos_b=cos_b, sin_a=sin_a,
                           sin_b=sin_b, q_weight_ptr=q_weight_ptr, k_weight_ptr=k_weight_ptr, eps=eps,
                           x_rows_q=xq, x_rows_k=xk, x_stride_qd=stride_qd, x_stride_kd=stride_kd, factor_q=factor_q,
                           factor_k=factor_k, out_ty=out_ty,
                           HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R,
                           BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL, RNE_BF16=RNE_BF16, INPLACE=INPLACE,
                           NORM=NORM, EAGER=EAGER, LANES_Q=LANES_Q, LANES_K=LANES_K, VEC=VEC)
        # else the loop, which would not run, is not compiled: the tile's work is written twice (the first tile's
        # loads go before the angles), and a program of one tile compiles in about half the time
        if MULTI_TILE:
            for r0 in range(r_begin + BLOCK_R, r_end, BLOCK_R):
                xq, xk, oq, ok, in_q, rows_ok = _rows(
                    q_ptr=q_ptr, q_out_ptr=q_out_ptr, k_ptr=k_ptr, k_out_ptr=k_out_ptr, q_base=q_base,
                    q_out_base=q_out_base, k_base=k_base, k_out_base=k_out_base, r0=r0, r_end=r_end, q_rows=q_rows,
                    q_heads=q_heads, k_heads=k_heads, magic_qheads=magic_qheads, magic_kheads=magic_kheads,
                    stride_qb=stride_qb, stride_qh=stride_qh, stride_qob=stride_qob, stride_qoh=stride_qoh,
                    stride_kb=stride_kb, stride_kh=stride_kh, stride_kob=stride_kob, stride_koh=stride_koh,
                    GROUP_PER_BATCH=GROUP_PER_BATCH, BLOCK_R=BLOCK_R, QK=True)
                xa, xb, xt = _load_head(q_rows_ptr=xq, k_rows_ptr=xk, in_q=in_q, rows_ok=rows_ok,
                                        stride_qd=stride_qd, stride_kd=stride_kd, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM,
                                        INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF,
                                        BLOCK_TAIL=BLOCK_TAIL)
                _norm_rotate_store(q_rows_ptr=oq, k_rows_ptr=ok, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qod,
                                   stride_kd=stride_kod, xa=xa, xb=xb, xt=xt, cos_a=cos_a, cos_b=cos_b, sin_a=sin_a,
                                   sin_b=sin_b, q_weight_ptr=q_weight_ptr, k_weight_ptr=k_weight_ptr, eps=eps,
                                   x_rows_q=xq, x_rows_k=xk, x_stride_qd=stride_qd, x_stride_kd=stride_kd,
                                   factor_q=factor_q, factor_k=factor_k, out_ty=out_ty, HEAD_DIM=HEAD_DIM,
                                   ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF,
                                   BLOCK_TAIL=BLOCK_TAIL, RNE_BF16=RNE_BF16, INPLACE=INPLACE, NORM=NORM, EAGER=EAGER,
                                   LANES_Q=LANES_Q, LANES_K=LANES_K, VEC=VEC)
    else:
        row = weight_grad_partials_ptr + pid.to(tl.int64) * (2 * HEAD_DIM + BLOCK_R)
        scratch = row + 2 * HEAD_DIM + tl.arange(0, BLOCK_R)
        acc_qa = tl.zeros([BLOCK_HALF], tl.float32)
        acc_qb = tl.zeros([BLOCK_HALF], tl.float32)
        acc_ka = tl.zeros([BLOCK_HALF], tl.float32)
        acc_kb = tl.zeros([BLOCK_HALF], tl.float32)
        acc_qt = tl.zeros([BLOCK_TAIL], tl.float32)
        acc_kt = tl.zeros([BLOCK_TAIL], tl.float32)
        for item in range(pid, n_items, n_progs):
            s_idx, b_idx, r_begin, r_end, q_base, q_out_base, k_base, k_out_base = _group_of(
                item=item, n_groups=n_groups, inner=inner, magic_groups=magic_groups, magic_inner=magic_inner,
                magic_batch=magic_batch, n_batch=n_batch, rows_per_program=rows_per_program, q_rows=q_rows,
                k_rows=k_rows, stride_qs=stride_qs, stride_qb=stride_qb, stride_qos=stride_qos,
                stride_qob=stride_qob, stride_ks=stride_ks, stride_kb=stride_kb, stride_kos=stride_kos,
                stride_kob=stride_kob, GROUP_PER_BATCH=GROUP_PER_BATCH, SPLIT=SPLIT)
            q_input_base = s_idx * stride_sqs + b_idx * stride_sqb
            k_input_base = s_idx * stride_sks + b_idx * stride_skb
            cos_a, cos_b, sin_a, sin_b = _group_angles(
                s_idx=s_idx, b_idx=b_idx, cos_or_freqs_ptr=cos_or_freqs_ptr, sin_ptr=sin_ptr,
                start_positions_ptr=start_positions_ptr, cu_seqlens_or_positions_ptr=cu_seqlens_or_positions_ptr,
                seq_len=seq_len, n_seqs=n_seqs, freqs_len=freqs_len, cp_size=cp_size, cp_rank=cp_rank,
                stride_fs=stride_fs, stride_fb=stride_fb, stride_fd=stride_fd, stride_fm=stride_fm,
                stride_ps=stride_ps, stride_pb=stride_pb, stride_pm=stride_pm, ROT_DIM=ROT_DIM,
                INTERLEAVED=INTERLEAVED, backward=BACKWARD, IS_THD=IS_THD, HAS_START=HAS_START, USE_CP=USE_CP,
                BLOCK_HALF=BLOCK_HALF, PIN=PIN, TABLE=TABLE, FANOUT=FANOUT, POS_TABLE=POS_TABLE,
                HALF_TABLE=HALF_TABLE, MROPE=MROPE, SEC0=SEC0, SEC1=SEC1, SEC2=SEC2)
            for r0 in range(r_begin, r_end, BLOCK_R):
                gq, gk, oq, ok, in_q, rows_ok = _rows(
                    q_ptr=q_ptr, q_out_ptr=q_out_ptr, k_ptr=k_ptr, k_out_ptr=k_out_ptr, q_base=q_base,
                    q_out_base=q_out_base, k_base=k_base, k_out_base=k_out_base, r0=r0, r_end=r_end, q_rows=q_rows,
                    q_heads=q_heads, k_heads=k_heads, magic_qheads=magic_qheads, magic_kheads=magic_kheads,
                    stride_qb=stride_qb, stride_qh=stride_qh, stride_qob=stride_qob, stride_qoh=stride_qoh,
                    stride_kb=stride_kb, stride_kh=stride_kh, stride_kob=stride_kob, stride_koh=stride_koh,
                    GROUP_PER_BATCH=GROUP_PER_BATCH, BLOCK_R=BLOCK_R, QK=True)
                ga, gb, gt = _load_head(q_rows_ptr=gq, k_rows_ptr=gk, in_q=in_q, rows_ok=rows_ok,
                                        stride_qd=stride_qd, stride_kd=stride_kd, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM,
                                        INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF,
                                        BLOCK_TAIL=BLOCK_TAIL)
                xq, xk, _, _, _, _ = _rows(
                    q_ptr=q_input_ptr, q_out_ptr=q_input_ptr, k_ptr=k_input_ptr, k_out_ptr=k_input_ptr,
                    q_base=q_input_base, q_out_base=q_input_base, k_base=k_input_base, k_out_base=k_input_base,
                    r0=r0, r_end=r_end, q_rows=q_rows, q_heads=q_heads, k_heads=k_heads, magic_qheads=magic_qheads,
                    magic_kheads=magic_kheads, stride_qb=stride_sqb, stride_qh=stride_sqh, stride_qob=stride_sqb,
                    stride_qoh=stride_sqh, stride_kb=stride_skb, stride_kh=stride_skh, stride_kob=stride_skb,
                    stride_koh=stride_skh, GROUP_PER_BATCH=GROUP_PER_BATCH, BLOCK_R=BLOCK_R, QK=True)
                xa, xb, xt = _load_head(q_rows_ptr=xq, k_rows_ptr=xk, in_q=in_q, rows_ok=rows_ok,
                                        stride_qd=stride_sqd, stride_kd=stride_skd, HEAD_DIM=HEAD_DIM,
                                        ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R,
                                        BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL)
                # r passes through the program's scratch row: read back, it takes the tile's layout without the
                # compiler computing na and the weight-gradient partials in the layout of `_row_sum`'s last step
                # (2.4 x the instructions, and spills: sm_90 SASS)
                tl.store(scratch, _inv_rms(xa=xa, xb=xb, xt=xt, eps=eps, HEAD_DIM=HEAD_DIM))
                tl.debug_barrier()
                r = tl.load(scratch)[:, None]
                tl.debug_barrier()  # every thread has read r before the next tile's store
                wa, wb, wt = _tile_weights(q_weight_ptr=q_weight_ptr, k_weight_ptr=k_weight_ptr, in_q=in_q,
                                           rows_ok=rows_ok, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM,
                                           INTERLEAVED=INTERLEAVED, BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL,
                                           NORM=NORM)
                na, nb, nt = xa * r, xb * r, xt * r
                ua = ga * cos_a - gb * sin_a  # R^T g (the adjoint's sines)
                ub = gb * cos_b + ga * sin_b
                gna, gnb, gnt = ua * wa, ub * wb, gt * wt
                dot = ((_row_sum(x=gna * na) + _row_sum(x=gnb * nb)) + _row_sum(x=gnt * nt))[:, None]
                dot = dot / HEAD_DIM
                _store_head(q_rows_ptr=oq, k_rows_ptr=ok, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qod,
                            stride_kd=stride_kod, out_a=r * (gna - na * dot), out_b=r * (gnb - nb * dot),
                            out_t=r * (gnt - nt * dot), out_ty=out_ty, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM,
                            INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL,
                            RNE_BF16=RNE_BF16, INPLACE=False)
                rq = (in_q & rows_ok)[:, None]
                rk = (rows_ok & ~in_q)[:, None]
                acc_qa += tl.sum(tl.where(rq, ua * na, 0.0), axis=0)
                acc_qb += tl.sum(tl.where(rq, ub * nb, 0.0), axis=0)
                acc_qt += tl.sum(tl.where(rq, gt * nt, 0.0), axis=0)
                acc_ka += tl.sum(tl.where(rk, ua * na, 0.0), axis=0)
                acc_kb += tl.sum(tl.where(rk, ub * nb, 0.0), axis=0)
                acc_kt += tl.sum(tl.where(rk, gt * nt, 0.0), axis=0)
        tl.store(row + col_a, acc_qa, mask=k_ok)
        tl.store(row + col_b, acc_qb, mask=k_ok)
        tl.store(row + t_cols, acc_qt, mask=t_ok)
        tl.store(row + HEAD_DIM + col_a, acc_ka, mask=k_ok)
        tl.store(row + HEAD_DIM + col_b, acc_kb, mask=k_ok)
        tl.store(row + HEAD_DIM + t_cols, acc_kt, mask=t_ok)
