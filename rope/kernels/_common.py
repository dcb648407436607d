"""Helpers shared by the kernel families (docs/design.md, "The kernel"): program -> (group, chunk), positions,
angles, rows, tiles, and the pair load and store. Every call passes its arguments by keyword.

A *group* is a set of rows with one position, hence one set of angles; a program handles a chunk of one group's
rows (rows_per_program, a multiple of the tile height BLOCK_R).
- sbhd/bshd without start_positions: group = one s index, rows = all b*h (b, h) pairs.
- sbhd/bshd with start_positions:    group = one (s, b) pair, rows = its h heads.
- thd:                               group = one token, rows = its h heads.
The rotated channels are two [rows, d2/2] halves a and b = partner(a); channels d2..d are the tail.
"""
import triton
import triton.language as tl


@triton.jit
def _tile_ptrs(q_rows_ptr, k_rows_ptr, in_q, cols, stride_qd, stride_kd):
    """Pointers of a [rows, cols] tile whose rows start at q_rows_ptr where in_q, else at k_rows_ptr. Choosing
    among the 2-D pointers, not the row starts, keeps each row's columns visibly contiguous and aligned to the
    compiler, hence its 16-byte accesses."""
    return tl.where(in_q[:, None], q_rows_ptr[:, None] + cols[None, :] * stride_qd,
                    k_rows_ptr[:, None] + cols[None, :] * stride_kd)


@triton.jit
def _to_output(v, out_ty: tl.constexpr, RNE_BF16: tl.constexpr):
    """Round float32 `v` once to the output type. Triton's CPU interpreter converts float32 to bfloat16
    by truncation, the GPU rounds to nearest even: under the interpreter (RNE_BF16) the rounding is done
    on the bits first, so that both give the same, correctly rounded, result."""
    if RNE_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(out_ty)


@triton.jit
def _quotient(x, scale, inv):
    """x / scale in float32, rounded once, as vLLM divides, without a division per element (a correctly rounded
    division per element made the fp8 store several times slower than the bf16 one): with inv = RN(1 / scale),
    q0 = RN(x inv) is within an ulp of x / scale, and one FMA step q0 + inv (x - q0 scale) is the correctly rounded
    quotient (Markstein's theorem, where nothing overflows). Where |q0| >= 896 the value saturates to 448 either
    way, and a zero q0 keeps its sign. Checked against the division for every bf16 value at 1009 scales from 1e-30
    to 1e30: the same e4m3 bytes (tests/rope/test_serving.py checks every bf16 value at two scales)."""
    xf = x.to(tl.float32)
    q0 = xf * inv
    q1 = tl.fma(tl.fma(-q0, scale, xf), inv, q0)
    return tl.where((tl.abs(q0) < 896.0) & (q0 != 0.0), q1, q0)


@triton.jit
def _to_cache(x, scale, inv, cache_ty: tl.constexpr, FP8: tl.constexpr, FP8_BITS: tl.constexpr):
    """x (the model's dtype) as the cache stores it: itself (bitwise), or FP8 e4m3(x / scale) (`_quotient`),
    saturated at 448. FP8_BITS: the CPU interpreter's float32 -> e4m3 conversion misrounds (a carry into the
    exponent is lost), so the value is rounded to nearest even on its bits first (normal range: 3 mantissa bits;
    below 2^-6: multiples of 2^-9, the sign kept) and converted exactly, as `_to_output` does for bfloat16."""
    if not FP8:
        return x
    y = _quotient(x=x, scale=scale, inv=inv)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if FP8_BITS:
        bits = y.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        r = ((tl.abs(y) * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)  # 1.5 * 2^23: rounds to integers
        y = tl.where(tl.abs(y) < 0.015625, tl.where((bits >> 31) != 0, -r, r), normal)  # -0 and tiny negatives: -0
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return y.to(cache_ty)


@triton.jit
def _pin(v, PIN: tl.constexpr):
    """Identity that the compiler may not duplicate (an opaque, side-effecting move). sin/cos are
    computed in the 1-D layout of their load; left alone, the compiler may recompute them in the
    tile's slice layout, where every thread column repeats them, instead of moving the values once
    through shared memory, and the kernel becomes compute-bound. Not available in the interpreter."""
    if PIN:
        v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=False, pack=1)
    return v


@triton.jit
def _shared_load(ptrs, mask, other):
    """A load of what many programs read (cos/sin table or angle rows, cu_seqlens, start_positions),
    marked to stay in L2: `t` streams through once, and its lines would otherwise evict a table row
    between the programs that share it (bshd reads row s again one batch entry later)."""
    return tl.load(ptrs, mask=mask, other=other, eviction_policy="evict_last")


@triton.jit
def _divmod(n, d, magic):
    """(n // d, n % d) for int32 0 <= n < 2**31 and 1 <= d < 2**31 by a multiply-high, not a division: `magic`
    holds the launcher's constants m and l for d (`rope._launch.magic`), and n // d = (umulhi(n, m) + n) >> l
    (Granlund and Montgomery, 1994; the sum fits 32 bits as n < 2**31). The GPU has no integer divider: n // d is
    about 25 instructions through a reciprocal and a float conversion, and where n is the program's id it stands in
    front of the first load. This is five, on the uniform datapath there."""
    nu = n.to(tl.uint32, bitcast=True)
    shift = (magic >> 32).to(tl.uint32) & 31
    q = ((tl.umulhi(nu, magic.to(tl.uint32)) + nu) >> shift).to(tl.int32, bitcast=True)
    return q, n - q * d


@triton.jit
def _program(n_groups, inner, n_batch, magic_groups, magic_inner, magic_batch, GROUP_PER_BATCH: tl.constexpr,
             SPLIT: tl.constexpr):
    """(s index, b index, row chunk) of this program, in memory order. Index math is int32 (the launcher
    keeps programs and rows below 2**31); only offsets are 64-bit. Without SPLIT (one chunk per group) and
    GROUP_PER_BATCH nothing is divided. `magic_*`: the divisors' constants for `_divmod`."""
    return _item(item=tl.program_id(0), n_groups=n_groups, inner=inner, n_batch=n_batch, magic_groups=magic_groups,
                 magic_inner=magic_inner, magic_batch=magic_batch, GROUP_PER_BATCH=GROUP_PER_BATCH, SPLIT=SPLIT)


@triton.jit
def _item(item, n_groups, inner, n_batch, magic_groups, magic_inner, magic_batch, GROUP_PER_BATCH: tl.constexpr,
          SPLIT: tl.constexpr):
    """`_program` of work item `item` (a program of the norm's backward takes several items in turn). The 1-D
    order follows memory, as a copy kernel's does: chunk `item % inner` of a run of `inner` consecutive chunks,
    then the groups, then the runs."""
    if not SPLIT:
        group = item
        chunk = item * 0
    else:
        run, in_run = _divmod(n=item, d=inner, magic=magic_inner)
        outer, group = _divmod(n=run, d=n_groups, magic=magic_groups)
        chunk = outer * inner + in_run
    if GROUP_PER_BATCH:
        s_idx, b_idx = _divmod(n=group, d=n_batch, magic=magic_batch)
        return s_idx.to(tl.int64), b_idx.to(tl.int64), chunk
    return group.to(tl.int64), tl.zeros_like(group).to(tl.int64), chunk


@triton.jit
def _sequence_of(token, cu_seqlens_ptr, n_seqs, cp_size, FANOUT: tl.constexpr):
    """(index, first local token, local length) of the sequence that holds local token `token`: the
    largest q with cu[q] // cp_size <= token ("largest" skips empty sequences). Each round loads FANOUT
    evenly spaced entries of the candidate range and keeps the sub-range below the first one past
    `token`: few round trips to L2 precede the angles (3 for 2048 sequences, bisection takes 11). The
    bounds are loaded entries: cu[q] the largest found <= token, cu[q + 1] the smallest above it."""
    lanes = tl.arange(0, FANOUT) + 1
    lo = 0
    span = n_seqs + 1  # candidates lo .. lo + span - 1; cu[lo] <= token holds throughout
    start = tl.load(cu_seqlens_ptr, eviction_policy="evict_last").to(tl.int64) // cp_size
    end = start * 0 + 0x7FFFFFFFFFFFFFFF  # no entry above `token` seen yet (only past the last sequence)
    while span > 1:
        step = (span + FANOUT - 1) // FANOUT
        idx = lo + lanes * step
        ok = (idx < lo + span) & (idx <= n_seqs)
        v = _shared_load(ptrs=cu_seqlens_ptr + idx, mask=ok, other=0).to(tl.int64) // cp_size
        below = ok & (v <= token)
        lo = lo + tl.sum(below.to(tl.int32), axis=0) * step
        start = tl.maximum(start, tl.max(tl.where(below, v, start), axis=0))
        end = tl.minimum(end, tl.min(tl.where(ok & ~below, v, end), axis=0))
        span = step
    return lo, start, end - start


@triton.jit
def _stream_of_pair(BLOCK_HALF: tl.constexpr, MROPE: tl.constexpr, SEC0: tl.constexpr, SEC1: tl.constexpr,
                    SEC2: tl.constexpr):
    """Multimodal RoPE (docs/contract.md section 7b): the position stream (0, 1 or 2) each rotary pair
    reads. MROPE 1: sections of SEC0, SEC1 and SEC2 consecutive pairs; MROPE 2 (Qwen3-VL's interleaved
    layout): pair k reads stream k % 3 while k < 3 * SEC[k % 3], stream 0 beyond."""
    k = tl.arange(0, BLOCK_HALF)
    if MROPE == 1:
        return (k >= SEC0).to(tl.int64) + (k >= SEC0 + SEC1).to(tl.int64)
    m = k % 3
    return tl.where((m == 1) & (k < 3 * SEC1), 1, tl.where((m == 2) & (k < 3 * SEC2), 2, 0)).to(tl.int64)


@triton.jit
def _position(s_idx, b_idx, start_positions_ptr, cu_seqlens_or_positions_ptr, seq_len, n_seqs, cp_size, cp_rank,
              stride_ps, stride_pb, stride_pm, stream, IS_THD: tl.constexpr, HAS_START: tl.constexpr,
              USE_CP: tl.constexpr, FANOUT: tl.constexpr, POS_TABLE: tl.constexpr, MROPE: tl.constexpr):
    """Position of the group's token(s) (docs/contract.md section 3). POS_TABLE: cu_seqlens_or_positions_ptr
    holds one position per token (a caller's `positions`, or `rope._table`'s table built from cu_seqlens), read
    instead of searching cu_seqlens, at s_idx * stride_ps + b_idx * stride_pb; with MROPE, one per pair from the
    pair's `stream` (rows stride_pm apart). Otherwise it holds cu_seqlens (thd)."""
    if POS_TABLE:
        at = cu_seqlens_or_positions_ptr + s_idx * stride_ps + b_idx * stride_pb
        if MROPE:
            at += stream * stride_pm
        pos = tl.load(at, eviction_policy="evict_last").to(tl.int64)
    else:
        if IS_THD:
            seq_idx, seq_start, length = _sequence_of(token=s_idx, cu_seqlens_ptr=cu_seqlens_or_positions_ptr,
                                                      n_seqs=n_seqs, cp_size=cp_size, FANOUT=FANOUT)
            j = s_idx - seq_start
        else:
            length = seq_len
            j = s_idx
            seq_idx = b_idx
        pos = j
        if USE_CP:
            c = length // 2
            pos = tl.where(j < c, j + cp_rank * c, j - c + (2 * cp_size - 1 - cp_rank) * c)
        if HAS_START and IS_THD:  # a token past the last sequence must not read start_positions[n]
            pos = pos + tl.load(start_positions_ptr + seq_idx, mask=seq_idx < n_seqs, other=0,
                                eviction_policy="evict_last").to(tl.int64)
        elif HAS_START:
            pos = pos + tl.load(start_positions_ptr + seq_idx, eviction_policy="evict_last").to(tl.int64)
        if IS_THD:
            # Past the last sequence (cu_seqlens ending short, reachable only with value checks
            # off): no position, so the rotated channels become NaN, as with the position table.
            pos = tl.where(seq_idx < n_seqs, pos, -1)
    return pos


@triton.jit
def _pair_columns(ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Which of the BLOCK_HALF lanes are pairs, channel a of each rotated pair and its partner b = pi(a)."""
    k = tl.arange(0, BLOCK_HALF)
    if INTERLEAVED:
        return k < ROT_DIM // 2, 2 * k, 2 * k + 1
    return k < ROT_DIM // 2, k, k + ROT_DIM // 2


@triton.jit
def _angles(cos_or_freqs_ptr, sin_ptr, pos, b_idx, stream, freqs_len, stride_fs, stride_fb, stride_fd, stride_fm,
            backward, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
            BLOCK_HALF: tl.constexpr, PIN: tl.constexpr, TABLE: tl.constexpr, HALF_TABLE: tl.constexpr,
            MROPE: tl.constexpr):
    """cos/sin factors of channels a and b = partner(a), as [1, BLOCK_HALF] rows, once per program.

    TABLE: cos_or_freqs_ptr and sin_ptr are cos and sin tables (`rope._table`'s, or a caller's), any float
    dtype, row `pos` (and, for tables per batch entry, b_idx), read instead of evaluated. HALF_TABLE:
    one column per pair (column k for pair k), else one per channel. Else cos_or_freqs_ptr holds the angles
    (`freqs`, float32), whose sin/cos are evaluated here, and sin_ptr is not read. Backward uses the adjoint's
    factors: (sin_a, sin_b) -> (-sin f[b], -sin f[a]). A position outside the table or `freqs` (value
    checks skipped) reads nothing and gives NaN. MROPE: `pos` may be one position per pair, and tables
    given per stream are stride_fm apart (pair k reads its `stream`'s)."""
    pos_ok = (pos >= 0) & (pos < freqs_len)
    k_ok, col_a, col_b = _pair_columns(ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_HALF=BLOCK_HALF)
    row = tl.where(pos_ok, pos, 0) * stride_fs
    if TABLE:
        row += b_idx * stride_fb
    if MROPE:
        row += stream * stride_fm
    if HALF_TABLE:
        col = tl.arange(0, BLOCK_HALF) * stride_fd
        cos_a = tl.where(pos_ok, _shared_load(ptrs=cos_or_freqs_ptr + row + col, mask=k_ok, other=0.0).to(tl.float32),
                         float("nan"))
        sin_fa = tl.where(pos_ok, _shared_load(ptrs=sin_ptr + row + col, mask=k_ok, other=0.0).to(tl.float32),
                          float("nan"))
        cos_b, sin_fb = cos_a, sin_fa
    elif TABLE:
        ca, cb = row + col_a * stride_fd, row + col_b * stride_fd
        cos_a = tl.where(pos_ok, _shared_load(ptrs=cos_or_freqs_ptr + ca, mask=k_ok, other=0.0).to(tl.float32),
                         float("nan"))
        cos_b = tl.where(pos_ok, _shared_load(ptrs=cos_or_freqs_ptr + cb, mask=k_ok, other=0.0).to(tl.float32),
                         float("nan"))
        sin_fa = tl.where(pos_ok, _shared_load(ptrs=sin_ptr + ca, mask=k_ok, other=0.0).to(tl.float32), float("nan"))
        sin_fb = tl.where(pos_ok, _shared_load(ptrs=sin_ptr + cb, mask=k_ok, other=0.0).to(tl.float32), float("nan"))
    else:
        f_row = cos_or_freqs_ptr + row
        fa = tl.where(pos_ok, _shared_load(ptrs=f_row + col_a * stride_fd, mask=k_ok, other=0.0), float("nan"))
        fb = tl.where(pos_ok, _shared_load(ptrs=f_row + col_b * stride_fd, mask=k_ok, other=0.0), float("nan"))
        cos_a = _pin(v=tl.cos(fa), PIN=PIN)
        cos_b = _pin(v=tl.cos(fb), PIN=PIN)
        sin_fa = _pin(v=tl.sin(fa), PIN=PIN)
        sin_fb = _pin(v=tl.sin(fb), PIN=PIN)
    # `backward`: a value (the rotation kernels: one compile serves both directions) or a constant; a branch once per
    # program, on a row of BLOCK_HALF factors
    if backward:
        sin_a, sin_b = -sin_fb, -sin_fa
    else:
        sin_a, sin_b = sin_fa, sin_fb
    return cos_a[None, :], cos_b[None, :], sin_a[None, :], sin_b[None, :]


@triton.jit
def _group_of(item, n_groups, inner, magic_groups, magic_inner, magic_batch, n_batch, rows_per_program, q_rows,
              k_rows, stride_qs, stride_qb, stride_qos, stride_qob, stride_ks, stride_kb, stride_kos, stride_kob,
              GROUP_PER_BATCH: tl.constexpr, SPLIT: tl.constexpr):
    """Work item `item`'s group (s and b index), its rows [r_begin, r_end) and the group's offsets in q, q's output,
    k and k's output."""
    s_idx, b_idx, chunk = _item(item=item, n_groups=n_groups, inner=inner, n_batch=n_batch,
                                magic_groups=magic_groups, magic_inner=magic_inner, magic_batch=magic_batch,
                                GROUP_PER_BATCH=GROUP_PER_BATCH, SPLIT=SPLIT)
    r_begin = chunk * rows_per_program
    r_end = tl.minimum(r_begin + rows_per_program, q_rows + k_rows)
    return (s_idx, b_idx, r_begin, r_end, s_idx * stride_qs + b_idx * stride_qb,
            s_idx * stride_qos + b_idx * stride_qob, s_idx * stride_ks + b_idx * stride_kb,
            s_idx * stride_kos + b_idx * stride_kob)


@triton.jit
def _group_angles(s_idx, b_idx, cos_or_freqs_ptr, sin_ptr, start_positions_ptr, cu_seqlens_or_positions_ptr,
                  seq_len, n_seqs, freqs_len, cp_size, cp_rank, stride_fs, stride_fb, stride_fd, stride_fm, stride_ps,
                  stride_pb, stride_pm, backward, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                  IS_THD: tl.constexpr, HAS_START: tl.constexpr, USE_CP: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  PIN: tl.constexpr, TABLE: tl.constexpr, FANOUT: tl.constexpr, POS_TABLE: tl.constexpr,
                  HALF_TABLE: tl.constexpr, MROPE: tl.constexpr, SEC0: tl.constexpr, SEC1: tl.constexpr,
                  SEC2: tl.constexpr):
    """The group's cos/sin factors (`_angles`) at its position (`_position`; mRoPE: each pair's stream's)."""
    stream = _stream_of_pair(BLOCK_HALF=BLOCK_HALF, MROPE=MROPE, SEC0=SEC0, SEC1=SEC1, SEC2=SEC2) if MROPE else 0
    pos = _position(s_idx=s_idx, b_idx=b_idx, start_positions_ptr=start_positions_ptr,
                    cu_seqlens_or_positions_ptr=cu_seqlens_or_positions_ptr, seq_len=seq_len, n_seqs=n_seqs,
                    cp_size=cp_size, cp_rank=cp_rank, stride_ps=stride_ps, stride_pb=stride_pb, stride_pm=stride_pm,
                    stream=stream, IS_THD=IS_THD, HAS_START=HAS_START, USE_CP=USE_CP, FANOUT=FANOUT,
                    POS_TABLE=POS_TABLE, MROPE=MROPE)
    return _angles(cos_or_freqs_ptr=cos_or_freqs_ptr, sin_ptr=sin_ptr, pos=pos, b_idx=b_idx, stream=stream,
                   freqs_len=freqs_len, stride_fs=stride_fs, stride_fb=stride_fb, stride_fd=stride_fd,
                   stride_fm=stride_fm, backward=backward, ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED,
                   BLOCK_HALF=BLOCK_HALF, PIN=PIN, TABLE=TABLE, HALF_TABLE=HALF_TABLE, MROPE=MROPE)


@triton.jit
def _row_offsets(x_base, out_base, rows, n_heads, magic_heads, stride_xb, stride_xh, stride_ob, stride_oh,
                 GROUP_PER_BATCH: tl.constexpr):
    """Offsets of a group's `rows` (int32) in x and in out (rows are (b, h) pairs, or heads). A negative row (q's
    rows seen from k's offsets in a tile of both) gives an offset that is never dereferenced."""
    if GROUP_PER_BATCH:  # an else, not an early return: Triton compiles what follows a return in a static branch
        x_row, o_row = x_base + rows.to(tl.int64) * stride_xh, out_base + rows.to(tl.int64) * stride_oh
    else:
        b_of_row, h_of_row = _divmod(n=rows, d=n_heads, magic=magic_heads)
        b_of_row = b_of_row.to(tl.int64)
        h_of_row = h_of_row.to(tl.int64)
        x_row = x_base + b_of_row * stride_xb + h_of_row * stride_xh
        o_row = out_base + b_of_row * stride_ob + h_of_row * stride_oh
    return x_row, o_row


@triton.jit
def _rows(q_ptr, q_out_ptr, k_ptr, k_out_ptr, q_base, q_out_base, k_base, k_out_base, r0, r_end, q_rows, q_heads,
          k_heads, magic_qheads, magic_kheads, stride_qb, stride_qh, stride_qob, stride_qoh, stride_kb, stride_kh,
          stride_kob, stride_koh, GROUP_PER_BATCH: tl.constexpr, BLOCK_R: tl.constexpr, QK: tl.constexpr):
    """Row pointers of rows [r0, r0 + BLOCK_R) of a group, in q and k and in their outputs, which rows
    are q's (in_q) and which exist. With QK a group's rows are q's then k's, so one tile may hold rows
    of both (the pointer not taken is never dereferenced); without, x is both q and k."""
    rows = r0 + tl.arange(0, BLOCK_R)
    in_q = rows < q_rows
    q_row, qo_row = _row_offsets(x_base=q_base, out_base=q_out_base, rows=rows, n_heads=q_heads,
                                 magic_heads=magic_qheads, stride_xb=stride_qb, stride_xh=stride_qh,
                                 stride_ob=stride_qob, stride_oh=stride_qoh, GROUP_PER_BATCH=GROUP_PER_BATCH)
    if not QK:
        x_rows, out_rows, rows_ok = q_ptr + q_row, q_out_ptr + qo_row, rows < r_end
        return x_rows, x_rows, out_rows, out_rows, rows_ok, rows_ok
    k_row, ko_row = _row_offsets(x_base=k_base, out_base=k_out_base, rows=rows - q_rows, n_heads=k_heads,
                                 magic_heads=magic_kheads, stride_xb=stride_kb, stride_xh=stride_kh,
                                 stride_ob=stride_kob, stride_oh=stride_koh, GROUP_PER_BATCH=GROUP_PER_BATCH)
    return q_ptr + q_row, k_ptr + k_row, q_out_ptr + qo_row, k_out_ptr + ko_row, in_q, rows < r_end


@triton.jit
def _load_pairs(q_rows_ptr, k_rows_ptr, in_q, rows_ok, stride_qd, stride_kd, HEAD_DIM: tl.constexpr,
                ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                BLOCK_TAIL: tl.constexpr, LOAD_TAIL: tl.constexpr, ROT_START: tl.constexpr = 0):
    """The pair load: a tile's channels a and b = partner(a) as float32, and, LOAD_TAIL, its tail (the tensor's
    dtype; else `a` stands in, never stored). Interleaved reads one contiguous [rows, d2] slice and splits even/odd
    lanes in registers, so every access stays wide. The tail comes with the rotated channels (one round trip per
    tile, not two). ROT_START > 0: the row pointers are at the rotated channels, which are the head's last, and the
    tail is the ROT_START channels before them (`_tail_columns`)."""
    k_ok, col_a, col_b = _pair_columns(ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_HALF=BLOCK_HALF)
    if INTERLEAVED:
        cols = tl.arange(0, 2 * BLOCK_HALF)
        x = tl.load(_tile_ptrs(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, cols=cols,
                               stride_qd=stride_qd, stride_kd=stride_kd),
                    mask=rows_ok[:, None] & (cols < ROT_DIM)[None, :])
        x = x.to(tl.float32)
        xa, xb = tl.split(tl.reshape(x, (BLOCK_R, BLOCK_HALF, 2)))
    else:
        m = rows_ok[:, None] & k_ok[None, :]
        xa = tl.load(_tile_ptrs(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, cols=col_a,
                                stride_qd=stride_qd, stride_kd=stride_kd), mask=m).to(tl.float32)
        xb = tl.load(_tile_ptrs(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, cols=col_b,
                                stride_qd=stride_qd, stride_kd=stride_kd), mask=m).to(tl.float32)
    if LOAD_TAIL:
        t_cols, t_ok = _tail_columns(HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM, BLOCK_TAIL=BLOCK_TAIL, ROT_START=ROT_START)
        tail = tl.load(_tile_ptrs(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, cols=t_cols,
                                  stride_qd=stride_qd, stride_kd=stride_kd),
                       mask=rows_ok[:, None] & t_ok[None, :])
    else:
        tail = xa
    return xa, xb, tail


@triton.jit
def _stored(v, out_ty: tl.constexpr, RNE_BF16: tl.constexpr, scale, inv, FP8: tl.constexpr, FP8_BITS: tl.constexpr):
    """`v` as a store writes it: rounded once to `out_ty` (`_to_output`; a value of that type already passes
    unchanged with RNE_BF16 off), or, FP8, as a KV cache holds it (`_to_cache`)."""
    if FP8:
        return _to_cache(x=v, scale=scale, inv=inv, cache_ty=out_ty, FP8=FP8, FP8_BITS=FP8_BITS)
    return _to_output(v=v, out_ty=out_ty, RNE_BF16=RNE_BF16)


@triton.jit
def _store_pairs(q_rows_ptr, k_rows_ptr, in_q, rows_ok, stride_qd, stride_kd, a, b, out_ty: tl.constexpr,
                 RNE_BF16: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BARRIER: tl.constexpr, scale=1.0, inv=1.0, FP8: tl.constexpr = False,
                 FP8_BITS: tl.constexpr = False):
    """The pair store: channels a and b of a tile's rows (`rows_ok`), each element converted once (`_stored`: to
    `out_ty`, or FP8 with `scale` and its reciprocal `inv`). Interleaved joins the halves in registers into one
    contiguous [rows, d2] slice, so every access stays wide. BARRIER (in place): a register layout wider than the
    tile gives some elements to several threads, so without the barrier one thread could store a result before
    another has loaded the original."""
    k_ok, col_a, col_b = _pair_columns(ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_HALF=BLOCK_HALF)
    if BARRIER:
        tl.debug_barrier()
    if INTERLEAVED:
        cols = tl.arange(0, 2 * BLOCK_HALF)
        y = tl.reshape(tl.join(a, b), (BLOCK_R, 2 * BLOCK_HALF))
        tl.store(_tile_ptrs(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, cols=cols,
                            stride_qd=stride_qd, stride_kd=stride_kd),
                 _stored(v=y, out_ty=out_ty, RNE_BF16=RNE_BF16, scale=scale, inv=inv, FP8=FP8, FP8_BITS=FP8_BITS),
                 mask=rows_ok[:, None] & (cols < ROT_DIM)[None, :])
    else:
        m = rows_ok[:, None] & k_ok[None, :]
        tl.store(_tile_ptrs(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, cols=col_a,
                            stride_qd=stride_qd, stride_kd=stride_kd),
                 _stored(v=a, out_ty=out_ty, RNE_BF16=RNE_BF16, scale=scale, inv=inv, FP8=FP8, FP8_BITS=FP8_BITS),
                 mask=m)
        tl.store(_tile_ptrs(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, cols=col_b,
                            stride_qd=stride_qd, stride_kd=stride_kd),
                 _stored(v=b, out_ty=out_ty, RNE_BF16=RNE_BF16, scale=scale, inv=inv, FP8=FP8, FP8_BITS=FP8_BITS),
                 mask=m)


@triton.jit
def _store_tail(q_rows_ptr, k_rows_ptr, in_q, rows_ok, stride_qd, stride_kd, tail, out_ty: tl.constexpr,
                RNE_BF16: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_TAIL: tl.constexpr,
                scale=1.0, inv=1.0, FP8: tl.constexpr = False, FP8_BITS: tl.constexpr = False,
                ROT_START: tl.constexpr = 0):
    """The tail's store: the channels of a tile's rows (`rows_ok`) that are not rotated (`_tail_columns`),
    converted as `_store_pairs` converts."""
    t_cols, t_ok = _tail_columns(HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM, BLOCK_TAIL=BLOCK_TAIL, ROT_START=ROT_START)
    tl.store(_tile_ptrs(q_rows_ptr=q_rows_ptr, k_rows_ptr=k_rows_ptr, in_q=in_q, cols=t_cols,
                        stride_qd=stride_qd, stride_kd=stride_kd),
             _stored(v=tail, out_ty=out_ty, RNE_BF16=RNE_BF16, scale=scale, inv=inv, FP8=FP8, FP8_BITS=FP8_BITS),
             mask=rows_ok[:, None] & t_ok[None, :])


@triton.jit
def _tail_columns(HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_TAIL: tl.constexpr, ROT_START: tl.constexpr):
    """The tail's columns relative to the row pointers, and which are in the head: channels ROT_DIM..HEAD_DIM
    where the rotated channels come first; ROT_START > 0 (they come last, the pointers at the first of them): the
    ROT_START channels before them."""
    if ROT_START > 0:
        lanes = tl.arange(0, BLOCK_TAIL)
        return lanes - ROT_START, lanes < ROT_START
    t_cols = ROT_DIM + tl.arange(0, BLOCK_TAIL)
    return t_cols, t_cols < HEAD_DIM
