"""The rotation kernels: forward and backward (adjoint) RoPE for every format and mode (docs/design.md).

`rope_qk_kernel` rotates q and k of a layer in one launch; `rope_kernel` rotates one tensor through the same body,
with x as q and as k and no k rows, so that its launch carries none of k's arguments. The 1-D grid follows memory
(`_common._item`): program `pid` takes row chunk `pid % inner` of a run of `inner` consecutive chunks, then the
groups, then the runs (`inner` = chunks per group where a group's rows are contiguous, as in sbhd; chunks per b
where they are not, as in bshd).

  forward   out_a = xa cos fa - xb sa        out_b = xb cos fb + xa sb
  backward  out_a = ga cos fa + gb sb        out_b = gb cos fb - ga sa
(sa = sin f[a], sb = sin f[b]): the backward takes (-sb, -sa) for (sa, sb). It is a rotation by -theta
only when fa == fb, which the contract never assumes.
"""
import triton
import triton.language as tl

from ._common import _group_angles, _group_of, _load_pairs, _rows, _store_pairs, _store_tail, _to_output

# Integer arguments that are counts, not strides: Triton would specialize each on == 1 and on
# divisibility by 16, multiplying the compiled variants for no faster code; strides keep their
# specialization, which proves 16-byte alignment (a table's batch stride, often 0, is a count here).
MAGIC = ["magic_groups", "magic_inner", "magic_batch", "magic_qheads", "magic_kheads"]
QK_COUNTS = ["q_heads", "k_heads", "n_batch", "q_rows", "k_rows", "rows_per_program", "n_groups", "inner", "seq_len",
             "n_seqs", "freqs_len", "cp_rank", "stride_fb", "backward"] + MAGIC
_COUNTS = ["n_heads", "n_batch", "rows_per_group", "rows_per_program", "n_groups", "inner", "seq_len", "n_seqs",
           "freqs_len", "cp_rank", "stride_fb", "backward", "magic_groups", "magic_inner", "magic_batch", "magic_heads"]


@triton.jit
def _in_output(v, out_ty: tl.constexpr, RNE_BF16: tl.constexpr):
    """float32 `v` rounded to the output type and read back as float32: one step of the eager schedule."""
    return _to_output(v=v, out_ty=out_ty, RNE_BF16=RNE_BF16).to(tl.float32)


@triton.jit
def _rotated_eager(xa, xb, cos_a, cos_b, sin_a, sin_b, out_ty: tl.constexpr, RNE_BF16: tl.constexpr,
                   ANGLES_IN_OUT: tl.constexpr):
    """The pair (a, b) rotated as `x * cos + rotate_half(x) * sin` runs eagerly in the output dtype: cos and sin
    rounded to it, then each product, then the sum (the rotate_half sign flip is exact); float32 values. xa and xb
    hold values of the output dtype (a 16-bit output is the inputs' dtype in every eager call).
    Two forms, the same bits. The float32 form rounds each step on the way. The 16-bit form computes in the output
    dtype: an fp16 or bf16 product is the exact float32 product rounded once, and a sum of two is float32's sum
    rounded (float32 carries at least 2p + 2 bits of a p-bit format, so rounding twice is rounding once), which is
    PyTorch's eager arithmetic. The 16-bit form is taken where the angles still need their rounding (ANGLES_IN_OUT
    false: a float32 cache, angles from freqs), which it folds into the products: vLLM's decode 64 on an H200, 1.08
    against 1.02 x the default's time; with angles already in the output dtype, the float32 form is the faster
    (transformers' decode 64, 0.99 against 1.06 x). The interpreter (RNE_BF16) has no bf16 arithmetic: there each
    step is rounded on the bits."""
    if out_ty == tl.float32 or RNE_BF16 or ANGLES_IN_OUT:
        cos_a = _in_output(v=cos_a, out_ty=out_ty, RNE_BF16=RNE_BF16)
        cos_b = _in_output(v=cos_b, out_ty=out_ty, RNE_BF16=RNE_BF16)
        sin_a = _in_output(v=sin_a, out_ty=out_ty, RNE_BF16=RNE_BF16)
        sin_b = _in_output(v=sin_b, out_ty=out_ty, RNE_BF16=RNE_BF16)
        a = (_in_output(v=xa * cos_a, out_ty=out_ty, RNE_BF16=RNE_BF16)
             - _in_output(v=xb * sin_a, out_ty=out_ty, RNE_BF16=RNE_BF16))
        b = (_in_output(v=xb * cos_b, out_ty=out_ty, RNE_BF16=RNE_BF16)
             + _in_output(v=xa * sin_b, out_ty=out_ty, RNE_BF16=RNE_BF16))
    else:
        xa, xb = xa.to(out_ty), xb.to(out_ty)
        a = (xa * cos_a.to(out_ty) - xb * sin_a.to(out_ty)).to(tl.float32)
        b = (xb * cos_b.to(out_ty) + xa * sin_b.to(out_ty)).to(tl.float32)
    return a, b


@triton.jit
def _rotate_and_store(q_rows_ptr, k_rows_ptr, in_q, rows_ok, stride_qd, stride_kd, xa, xb, tail, cos_a, cos_b, sin_a,
                      sin_b, out_ty: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
                      INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                      BLOCK_TAIL: tl.constexpr, RNE_BF16: tl.constexpr, INPLACE: tl.constexpr, EAGER: tl.constexpr,
                      ROT_START: tl.constexpr, ANGLES_IN_OUT: tl.constexpr):
    """Rotate a loaded tile and store it, and its tail (in place the tail is neither loaded nor stored).
    EAGER: the schedule of the PyTorch expression run eagerly in the output dtype (docs/contract.md): cos and sin
    rounded to it, then each product, then the sum (the plan compiles without fused multiply-adds)."""
    if EAGER:
        a, b = _rotated_eager(xa=xa, xb=xb, cos_a=cos_a, cos_b=cos_b, sin_a=sin_a, sin_b=sin_b, out_ty=out_ty,
                              RNE_BF16=RNE_BF16, ANGLES_IN_OUT=ANGLES_IN_OUT)
    else:
        a = xa * cos_a - xb * sin_a
        b = xb * cos_b + xa * sin_b
    _store_pairs(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qd,
                 stride_kd=stride_kd, a=a, b=b, out_ty=out_ty, RNE_BF16=RNE_BF16, ROT_DIM=ROT_DIM,
                 INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF, BARRIER=INPLACE)
    if BLOCK_TAIL > 0 and not INPLACE:
        _store_tail(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qd,
                    stride_kd=stride_kd, tail=tail, out_ty=out_ty, RNE_BF16=False, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM,
                    BLOCK_TAIL=BLOCK_TAIL, ROT_START=ROT_START)  # the tail is copied: the input's dtype is the output's


@triton.jit
def _at_rotated(xq, xk, oq, ok, stride_qd, stride_kd, stride_qod, stride_kod, ROT_START: tl.constexpr):
    """The row pointers moved to the first rotated channel where the rotated channels are the head's last
    (ROT_START > 0, DeepSeek-V4's [pass-through | rope] head): one pass writes the whole head, its leading channels
    copied as a partial rotation's tail."""
    if ROT_START > 0:
        xq, xk = xq + ROT_START * stride_qd, xk + ROT_START * stride_kd
        oq, ok = oq + ROT_START * stride_qod, ok + ROT_START * stride_kod
    return xq, xk, oq, ok


@triton.jit(do_not_specialize=QK_COUNTS)
def rope_qk_kernel(
    q_ptr, q_out_ptr, k_ptr, k_out_ptr, cos_or_freqs_ptr, sin_ptr, start_positions_ptr, cu_seqlens_or_positions_ptr,
    q_heads, k_heads, n_batch, q_rows, k_rows, rows_per_program, n_groups, inner,
    magic_groups, magic_inner, magic_batch, magic_qheads, magic_kheads,
    seq_len, n_seqs, freqs_len, cp_size, cp_rank, backward,
    q_strides, q_out_strides, k_strides, k_out_strides, stride_fs, stride_fb, stride_fd, stride_fm, positions_strides,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    IS_THD: tl.constexpr, GROUP_PER_BATCH: tl.constexpr, HAS_START: tl.constexpr, USE_CP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, RNE_BF16: tl.constexpr,
    PIN: tl.constexpr, INPLACE: tl.constexpr, TABLE: tl.constexpr, SPLIT: tl.constexpr, FANOUT: tl.constexpr,
    POS_TABLE: tl.constexpr, HALF_TABLE: tl.constexpr, MROPE: tl.constexpr, SEC0: tl.constexpr,
    SEC1: tl.constexpr, SEC2: tl.constexpr, QK: tl.constexpr, PDL: tl.constexpr, EAGER: tl.constexpr,
    PERMUTE: tl.constexpr, ROT_START: tl.constexpr, MULTI_TILE: tl.constexpr,
):
    """q and k of one layer in one launch (QK: a group's rows are q's then k's, its angles found once for both), or
    one tensor (`rope_kernel`): a program's chunks of a group's rows, rotated by the group's angles.
    cos_or_freqs_ptr: the cos table (TABLE) or the angles `freqs`; cu_seqlens_or_positions_ptr: the positions
    (POS_TABLE) or cu_seqlens (thd). `backward` (0 or 1) is the direction, a value: one compile serves both, and it
    steers only the sign of the group's sines (`_angles`). Each tensor's strides are one tuple, (s, b, h, d) in the
    kernel's roles; positions_strides is (s, b, stream). The angles' strides are scalars: `stride_fb` must not be
    specialized (QK_COUNTS), and Triton's do_not_specialize takes whole parameters. PERMUTE (DeepSeek-V3's form,
    half-split angles): 1 reads the pairs interleaved (2i, 2i + 1) and writes them half-split (i, i + d2/2); 2, its
    backward, the other way round; 0 reads and writes the pairs INTERLEAVED says. In place too (Megatron-LM's MLA
    form): a tile's pairs are all loaded before any is stored (`_store_pairs`' barrier)."""
    if PDL:  # launched as a programmatic dependent of the kernel before it: wait for that kernel's writes first
        tl.extra.cuda.gdc_wait()
    stride_qs, stride_qb, stride_qh, stride_qd = q_strides
    stride_qos, stride_qob, stride_qoh, stride_qod = q_out_strides
    stride_ks, stride_kb, stride_kh, stride_kd = k_strides
    stride_kos, stride_kob, stride_koh, stride_kod = k_out_strides
    stride_ps, stride_pb, stride_pm = positions_strides
    s_idx, b_idx, r_begin, r_end, q_base, q_out_base, k_base, k_out_base = _group_of(
        item=tl.program_id(0), n_groups=n_groups, inner=inner, magic_groups=magic_groups, magic_inner=magic_inner,
        magic_batch=magic_batch, n_batch=n_batch, rows_per_program=rows_per_program, q_rows=q_rows, k_rows=k_rows,
        stride_qs=stride_qs, stride_qb=stride_qb, stride_qos=stride_qos, stride_qob=stride_qob, stride_ks=stride_ks,
        stride_kb=stride_kb, stride_kos=stride_kos, stride_kob=stride_kob, GROUP_PER_BATCH=GROUP_PER_BATCH,
        SPLIT=SPLIT)
    out_ty = q_out_ptr.dtype.element_ty
    # the angles are read as values of the output dtype: a table in it (the eager schedule's form, `_rotated_eager`)
    angles_in_out: tl.constexpr = TABLE and cos_or_freqs_ptr.dtype.element_ty == out_ty
    # The first chunk is loaded before the angles: its loads are in flight while they are found.
    xq, xk, oq, ok, in_q, rows_ok = _rows(
        q_ptr=q_ptr, q_out_ptr=q_out_ptr, k_ptr=k_ptr, k_out_ptr=k_out_ptr, q_base=q_base, q_out_base=q_out_base,
        k_base=k_base, k_out_base=k_out_base, r0=r_begin, r_end=r_end, q_rows=q_rows, q_heads=q_heads,
        k_heads=k_heads, magic_qheads=magic_qheads, magic_kheads=magic_kheads, stride_qb=stride_qb,
        stride_qh=stride_qh, stride_qob=stride_qob, stride_qoh=stride_qoh, stride_kb=stride_kb, stride_kh=stride_kh,
        stride_kob=stride_kob, stride_koh=stride_koh, GROUP_PER_BATCH=GROUP_PER_BATCH, BLOCK_R=BLOCK_R, QK=QK)
    xq, xk, oq, ok = _at_rotated(xq=xq, xk=xk, oq=oq, ok=ok, stride_qd=stride_qd, stride_kd=stride_kd,
                                 stride_qod=stride_qod, stride_kod=stride_kod, ROT_START=ROT_START)
    xa, xb, tail = _load_pairs(q_rows_ptr=xq, k_rows_ptr=xk, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qd,
                               stride_kd=stride_kd, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM,
                               INTERLEAVED=INTERLEAVED or PERMUTE == 1,
                               BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL,
                               LOAD_TAIL=BLOCK_TAIL > 0 and not INPLACE, ROT_START=ROT_START)
    cos_a, cos_b, sin_a, sin_b = _group_angles(
        s_idx=s_idx, b_idx=b_idx, cos_or_freqs_ptr=cos_or_freqs_ptr, sin_ptr=sin_ptr,
        start_positions_ptr=start_positions_ptr, cu_seqlens_or_positions_ptr=cu_seqlens_or_positions_ptr,
        seq_len=seq_len, n_seqs=n_seqs, freqs_len=freqs_len, cp_size=cp_size, cp_rank=cp_rank, stride_fs=stride_fs,
        stride_fb=stride_fb, stride_fd=stride_fd, stride_fm=stride_fm, stride_ps=stride_ps, stride_pb=stride_pb,
        stride_pm=stride_pm, backward=backward, ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, IS_THD=IS_THD,
        HAS_START=HAS_START, USE_CP=USE_CP, BLOCK_HALF=BLOCK_HALF, PIN=PIN, TABLE=TABLE, FANOUT=FANOUT,
        POS_TABLE=POS_TABLE, HALF_TABLE=HALF_TABLE, MROPE=MROPE, SEC0=SEC0, SEC1=SEC1, SEC2=SEC2)
    _rotate_and_store(q_rows_ptr=oq, k_rows_ptr=ok, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qod,
                      stride_kd=stride_kod, xa=xa, xb=xb, tail=tail, cos_a=cos_a, cos_b=cos_b, sin_a=sin_a,
                      sin_b=sin_b, out_ty=out_ty, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM,
                      INTERLEAVED=INTERLEAVED or PERMUTE == 2,
                      BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL, RNE_BF16=RNE_BF16,
                      INPLACE=INPLACE, EAGER=EAGER, ROT_START=ROT_START, ANGLES_IN_OUT=angles_in_out)
    # MULTI_TILE: a program may hold more than one tile of rows; else the loop, which would not run, is not compiled
    if MULTI_TILE:
        for r0 in range(r_begin + BLOCK_R, r_end, BLOCK_R):
            xq, xk, oq, ok, in_q, rows_ok = _rows(
                q_ptr=q_ptr, q_out_ptr=q_out_ptr, k_ptr=k_ptr, k_out_ptr=k_out_ptr, q_base=q_base,
                q_out_base=q_out_base, k_base=k_base, k_out_base=k_out_base, r0=r0, r_end=r_end, q_rows=q_rows,
                q_heads=q_heads,
                k_heads=k_heads, magic_qheads=magic_qheads, magic_kheads=magic_kheads, stride_qb=stride_qb,
                stride_qh=stride_qh, stride_qob=stride_qob, stride_qoh=stride_qoh, stride_kb=stride_kb,
                stride_kh=stride_kh, stride_kob=stride_kob, stride_koh=stride_koh, GROUP_PER_BATCH=GROUP_PER_BATCH,
                BLOCK_R=BLOCK_R, QK=QK)
            xq, xk, oq, ok = _at_rotated(xq=xq, xk=xk, oq=oq, ok=ok, stride_qd=stride_qd, stride_kd=stride_kd,
                                         stride_qod=stride_qod, stride_kod=stride_kod, ROT_START=ROT_START)
            xa, xb, tail = _load_pairs(q_rows_ptr=xq, k_rows_ptr=xk, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qd,
                                       stride_kd=stride_kd, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM,
                                       INTERLEAVED=INTERLEAVED or PERMUTE == 1, BLOCK_R=BLOCK_R,
                                       BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL,
                                       LOAD_TAIL=BLOCK_TAIL > 0 and not INPLACE, ROT_START=ROT_START)
            _rotate_and_store(q_rows_ptr=oq, k_rows_ptr=ok, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qod,
                              stride_kd=stride_kod, xa=xa, xb=xb, tail=tail, cos_a=cos_a, cos_b=cos_b, sin_a=sin_a,
                              sin_b=sin_b, out_ty=out_ty, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM,
                              INTERLEAVED=INTERLEAVED or PERMUTE == 2, BLOCK_R=BLOCK_R,
                              BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL, RNE_BF16=RNE_BF16,
                              INPLACE=INPLACE, EAGER=EAGER, ROT_START=ROT_START, ANGLES_IN_OUT=angles_in_out)


@triton.jit(do_not_specialize=_COUNTS)
def rope_kernel(
    x_ptr, out_ptr, cos_or_freqs_ptr, sin_ptr, start_positions_ptr, cu_seqlens_or_positions_ptr,
    n_heads, n_batch, rows_per_group, rows_per_program, n_groups, inner, magic_groups, magic_inner, magic_batch,
    magic_heads, seq_len, n_seqs, freqs_len, cp_size, cp_rank, backward,
    x_strides, out_strides, stride_fs, stride_fb, stride_fd, stride_fm, positions_strides,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    IS_THD: tl.constexpr, GROUP_PER_BATCH: tl.constexpr, HAS_START: tl.constexpr, USE_CP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, RNE_BF16: tl.constexpr,
    PIN: tl.constexpr, INPLACE: tl.constexpr, TABLE: tl.constexpr, SPLIT: tl.constexpr, FANOUT: tl.constexpr,
    POS_TABLE: tl.constexpr, HALF_TABLE: tl.constexpr, MROPE: tl.constexpr, SEC0: tl.constexpr,
    SEC1: tl.constexpr, SEC2: tl.constexpr, PDL: tl.constexpr, EAGER: tl.constexpr, PERMUTE: tl.constexpr,
    ROT_START: tl.constexpr, MULTI_TILE: tl.constexpr,
):
    """One tensor: `rope_qk_kernel`'s body with x as q and as k, and no k rows."""
    rope_qk_kernel(
        q_ptr=x_ptr, q_out_ptr=out_ptr, k_ptr=x_ptr, k_out_ptr=out_ptr, cos_or_freqs_ptr=cos_or_freqs_ptr,
        sin_ptr=sin_ptr, start_positions_ptr=start_positions_ptr,
        cu_seqlens_or_positions_ptr=cu_seqlens_or_positions_ptr, q_heads=n_heads, k_heads=n_heads, n_batch=n_batch,
        q_rows=rows_per_group, k_rows=0, rows_per_program=rows_per_program, n_groups=n_groups, inner=inner,
        magic_groups=magic_groups, magic_inner=magic_inner, magic_batch=magic_batch, magic_qheads=magic_heads,
        magic_kheads=magic_heads, seq_len=seq_len, n_seqs=n_seqs, freqs_len=freqs_len, cp_size=cp_size,
        cp_rank=cp_rank, backward=backward, q_strides=x_strides, q_out_strides=out_strides, k_strides=x_strides,
        k_out_strides=out_strides, stride_fs=stride_fs, stride_fb=stride_fb, stride_fd=stride_fd, stride_fm=stride_fm,
        positions_strides=positions_strides, HEAD_DIM=HEAD_DIM,
        ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, IS_THD=IS_THD, GROUP_PER_BATCH=GROUP_PER_BATCH,
        HAS_START=HAS_START, USE_CP=USE_CP, BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL,
        RNE_BF16=RNE_BF16, PIN=PIN, INPLACE=INPLACE, TABLE=TABLE, SPLIT=SPLIT, FANOUT=FANOUT, POS_TABLE=POS_TABLE,
        HALF_TABLE=HALF_TABLE, MROPE=MROPE, SEC0=SEC0, SEC1=SEC1, SEC2=SEC2, QK=False, PDL=PDL, EAGER=EAGER,
        PERMUTE=PERMUTE, ROT_START=ROT_START, MULTI_TILE=MULTI_TILE)
