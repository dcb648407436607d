"""The Triton kernels: forward and backward (adjoint) RoPE for every format and mode, and RoPE of per-head
RMS-normalised q and k (`rope_qknorm_kernel`, the NORM section below), and RoPE fused with the KV-cache write
(`rope_cache_kernel`, the KV-CACHE WRITE section) (docs/design.md).

`rope_kernel` rotates one tensor, `rope_qk_kernel` q and k of a layer in one launch; both run `_rope`
(the single-tensor kernel with x as q and as k, and no k rows). A *group* is a set of rows with one
position, hence one set of angles; a program handles a chunk of one group's rows (rows_per_program, a
multiple of the tile height BLOCK_R).
- sbhd/bshd without start_positions: group = one s index, rows = all b*h (b, h) pairs.
- sbhd/bshd with start_positions:    group = one (s, b) pair, rows = its h heads.
- thd:                               group = one token, rows = its h heads.
The 1-D grid follows memory, as a copy kernel's does: program `pid` takes row chunk `pid % inner` of a
run of `inner` consecutive chunks, then the groups, then the runs (`inner` = chunks per group where a
group's rows are contiguous, as in sbhd; chunks per b where they are not, as in bshd).

The rotated channels are two [rows, d2/2] halves a and b = partner(a); channels d2..d are copied.
  forward   out_a = xa cos fa - xb sa        out_b = xb cos fb + xa sb
  backward  out_a = ga cos fa + gb sb        out_b = gb cos fb - ga sa
(sa = sin f[a], sb = sin f[b]): the backward takes (-sb, -sa) for (sa, sb). It is a rotation by -theta
only when fa == fb, which the contract never assumes.
"""
import triton
import triton.language as tl


@triton.jit
def _tile_ptrs(rp_q, rp_k, in_q, cols, sd_q, sd_k):
    """Pointers of a [rows, cols] tile whose rows start at rp_q where in_q, else at rp_k. Choosing among
    the 2-D pointers, not the row starts, keeps each row's columns visibly contiguous and aligned to the
    compiler, hence its 16-byte accesses."""
    return tl.where(in_q[:, None], rp_q[:, None] + cols[None, :] * sd_q, rp_k[:, None] + cols[None, :] * sd_k)


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
    return _item(tl.program_id(0), n_groups, inner, n_batch, magic_groups, magic_inner, magic_batch,
                 GROUP_PER_BATCH, SPLIT)


@triton.jit
def _item(pid, n_groups, inner, n_batch, magic_groups, magic_inner, magic_batch, GROUP_PER_BATCH: tl.constexpr,
          SPLIT: tl.constexpr):
    """`_program` of work item `pid` (a program of the norm's backward takes several items in turn)."""
    if not SPLIT:
        group = pid
        chunk = pid * 0
    else:
        run, in_run = _divmod(pid, inner, magic_inner)
        outer, group = _divmod(run, n_groups, magic_groups)
        chunk = outer * inner + in_run
    if GROUP_PER_BATCH:
        s_idx, b_idx = _divmod(group, n_batch, magic_batch)
        return s_idx.to(tl.int64), b_idx.to(tl.int64), chunk
    return group.to(tl.int64), tl.zeros_like(group).to(tl.int64), chunk


@triton.jit
def _sequence_of(token, cu_ptr, n_seqs, cp_size, FANOUT: tl.constexpr):
    """(index, first local token, local length) of the sequence that holds local token `token`: the
    largest q with cu[q] // cp_size <= token ("largest" skips empty sequences). Each round loads FANOUT
    evenly spaced entries of the candidate range and keeps the sub-range below the first one past
    `token`: few round trips to L2 precede the angles (3 for 2048 sequences, bisection takes 11). The
    bounds are loaded entries: cu[q] the largest found <= token, cu[q + 1] the smallest above it."""
    lanes = tl.arange(0, FANOUT) + 1
    lo = 0
    span = n_seqs + 1  # candidates lo .. lo + span - 1; cu[lo] <= token holds throughout
    start = tl.load(cu_ptr, eviction_policy="evict_last").to(tl.int64) // cp_size
    end = start * 0 + 0x7FFFFFFFFFFFFFFF  # no entry above `token` seen yet (only past the last sequence)
    while span > 1:
        step = (span + FANOUT - 1) // FANOUT
        idx = lo + lanes * step
        ok = (idx < lo + span) & (idx <= n_seqs)
        v = _shared_load(cu_ptr + idx, ok, 0).to(tl.int64) // cp_size
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
def _position(s_idx, b_idx, start_ptr, cu_ptr, seq_len, n_seqs, cp_size, cp_rank, stride_ps, stride_pb, stride_pm,
              stream, IS_THD: tl.constexpr, HAS_START: tl.constexpr, USE_CP: tl.constexpr, FANOUT: tl.constexpr,
              POS_TABLE: tl.constexpr, MROPE: tl.constexpr):
    """Position of the group's token(s) (docs/contract.md section 3). POS_TABLE: cu_ptr holds one
    position per token (a caller's `positions`, or `rope._table`'s table built from cu_seqlens), read
    instead of searching cu_seqlens, at s_idx * stride_ps + b_idx * stride_pb; with MROPE, one per pair
    from the pair's `stream` (rows stride_pm apart)."""
    if POS_TABLE:
        at = cu_ptr + s_idx * stride_ps + b_idx * stride_pb
        if MROPE:
            at += stream * stride_pm
        pos = tl.load(at, eviction_policy="evict_last").to(tl.int64)
    else:
        if IS_THD:
            seq_idx, seq_start, length = _sequence_of(s_idx, cu_ptr, n_seqs, cp_size, FANOUT)
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
            pos = pos + tl.load(start_ptr + seq_idx, mask=seq_idx < n_seqs, other=0,
                                eviction_policy="evict_last").to(tl.int64)
        elif HAS_START:
            pos = pos + tl.load(start_ptr + seq_idx, eviction_policy="evict_last").to(tl.int64)
        if IS_THD:
            # Past the last sequence (cu_seqlens ending short, reachable only with value checks
            # off): no position, so the rotated channels become NaN, as with the position table.
            pos = tl.where(seq_idx < n_seqs, pos, -1)
    return pos


@triton.jit
def _pair_columns(ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Channel a of each rotated pair, its partner b = pi(a), and which of the BLOCK_HALF lanes are pairs."""
    k = tl.arange(0, BLOCK_HALF)
    if INTERLEAVED:
        return k < ROT_DIM // 2, 2 * k, 2 * k + 1
    return k < ROT_DIM // 2, k, k + ROT_DIM // 2


@triton.jit
def _angles(freqs_ptr, sin_ptr, pos, b_idx, stream, freqs_len, stride_fs, stride_fb, stride_fd, stride_fm,
            ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
            BLOCK_HALF: tl.constexpr, PIN: tl.constexpr, TABLE: tl.constexpr, HALF_TABLE: tl.constexpr,
            MROPE: tl.constexpr):
    """cos/sin factors of channels a and b = partner(a), as [1, BLOCK_HALF] rows, once per program.

    TABLE: freqs_ptr and sin_ptr are cos and sin tables (`rope._table`'s, or a caller's), any float
    dtype, row `pos` (and, for tables per batch entry, b_idx), read instead of evaluated. HALF_TABLE:
    one column per pair (column k for pair k), else one per channel. Backward uses the adjoint's
    factors: (sin_a, sin_b) -> (-sin f[b], -sin f[a]). A position outside the table or `freqs` (value
    checks skipped) reads nothing and gives NaN. MROPE: `pos` may be one position per pair, and tables
    given per stream are stride_fm apart (pair k reads its `stream`'s)."""
    pos_ok = (pos >= 0) & (pos < freqs_len)
    k_ok, col_a, col_b = _pair_columns(ROT_DIM, INTERLEAVED, BLOCK_HALF)
    row = tl.where(pos_ok, pos, 0) * stride_fs
    if TABLE:
        row += b_idx * stride_fb
    if MROPE:
        row += stream * stride_fm
    if HALF_TABLE:
        col = tl.arange(0, BLOCK_HALF) * stride_fd
        cos_a = tl.where(pos_ok, _shared_load(freqs_ptr + row + col, k_ok, 0.0).to(tl.float32), float("nan"))
        sin_fa = tl.where(pos_ok, _shared_load(sin_ptr + row + col, k_ok, 0.0).to(tl.float32), float("nan"))
        cos_b, sin_fb = cos_a, sin_fa
    elif TABLE:
        ca, cb = row + col_a * stride_fd, row + col_b * stride_fd
        cos_a = tl.where(pos_ok, _shared_load(freqs_ptr + ca, k_ok, 0.0).to(tl.float32), float("nan"))
        cos_b = tl.where(pos_ok, _shared_load(freqs_ptr + cb, k_ok, 0.0).to(tl.float32), float("nan"))
        sin_fa = tl.where(pos_ok, _shared_load(sin_ptr + ca, k_ok, 0.0).to(tl.float32), float("nan"))
        sin_fb = tl.where(pos_ok, _shared_load(sin_ptr + cb, k_ok, 0.0).to(tl.float32), float("nan"))
    else:
        f_row = freqs_ptr + row
        fa = tl.where(pos_ok, _shared_load(f_row + col_a * stride_fd, k_ok, 0.0), float("nan"))
        fb = tl.where(pos_ok, _shared_load(f_row + col_b * stride_fd, k_ok, 0.0), float("nan"))
        cos_a = _pin(tl.cos(fa), PIN)
        cos_b = _pin(tl.cos(fb), PIN)
        sin_fa = _pin(tl.sin(fa), PIN)
        sin_fb = _pin(tl.sin(fb), PIN)
    sin_a, sin_b = (-sin_fb, -sin_fa) if BACKWARD else (sin_fa, sin_fb)
    return cos_a[None, :], cos_b[None, :], sin_a[None, :], sin_b[None, :]


@triton.jit
def _group_of(item, n_groups, inner, magic_groups, magic_inner, magic_batch, n_batch, rows_per_program, q_rows,
              k_rows, stride_qs, stride_qb, stride_qos, stride_qob, stride_ks, stride_kb, stride_kos, stride_kob,
              GROUP_PER_BATCH: tl.constexpr, SPLIT: tl.constexpr):
    """Work item `item`'s group (s and b index), its rows [r_begin, r_end) and the group's offsets in q, q's output,
    k and k's output."""
    s_idx, b_idx, chunk = _item(item, n_groups, inner, n_batch, magic_groups, magic_inner, magic_batch,
                                GROUP_PER_BATCH, SPLIT)
    r_begin = chunk * rows_per_program
    r_end = tl.minimum(r_begin + rows_per_program, q_rows + k_rows)
    return (s_idx, b_idx, r_begin, r_end, s_idx * stride_qs + b_idx * stride_qb,
            s_idx * stride_qos + b_idx * stride_qob, s_idx * stride_ks + b_idx * stride_kb,
            s_idx * stride_kos + b_idx * stride_kob)


@triton.jit
def _group_angles(s_idx, b_idx, freqs_ptr, sin_ptr, start_ptr, cu_ptr, seq_len, n_seqs, freqs_len, cp_size, cp_rank,
                  stride_fs, stride_fb, stride_fd, stride_fm, stride_ps, stride_pb, stride_pm, ROT_DIM: tl.constexpr,
                  INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, IS_THD: tl.constexpr, HAS_START: tl.constexpr,
                  USE_CP: tl.constexpr, BLOCK_HALF: tl.constexpr, PIN: tl.constexpr, TABLE: tl.constexpr,
                  FANOUT: tl.constexpr, POS_TABLE: tl.constexpr, HALF_TABLE: tl.constexpr, MROPE: tl.constexpr,
                  SEC0: tl.constexpr, SEC1: tl.constexpr, SEC2: tl.constexpr):
    """The group's cos/sin factors (`_angles`) at its position (`_position`; mRoPE: each pair's stream's)."""
    stream = _stream_of_pair(BLOCK_HALF, MROPE, SEC0, SEC1, SEC2) if MROPE else 0
    pos = _position(s_idx, b_idx, start_ptr, cu_ptr, seq_len, n_seqs, cp_size, cp_rank, stride_ps, stride_pb,
                    stride_pm, stream, IS_THD, HAS_START, USE_CP, FANOUT, POS_TABLE, MROPE)
    return _angles(freqs_ptr, sin_ptr, pos, b_idx, stream, freqs_len, stride_fs, stride_fb, stride_fd, stride_fm,
                   ROT_DIM, INTERLEAVED, BACKWARD, BLOCK_HALF, PIN, TABLE, HALF_TABLE, MROPE)


@triton.jit
def _row_offsets(x_base, o_base, rows, n_heads, magic_heads, stride_xb, stride_xh, stride_ob, stride_oh,
                 GROUP_PER_BATCH: tl.constexpr):
    """Offsets of a group's `rows` (int32) in x and in out (rows are (b, h) pairs, or heads). A negative row (q's
    rows seen from k's offsets in a tile of both) gives an offset that is never dereferenced."""
    if GROUP_PER_BATCH:  # an else, not an early return: Triton compiles what follows a return in a static branch
        x_row, o_row = x_base + rows.to(tl.int64) * stride_xh, o_base + rows.to(tl.int64) * stride_oh
    else:
        b_of_row, h_of_row = _divmod(rows, n_heads, magic_heads)
        b_of_row = b_of_row.to(tl.int64)
        h_of_row = h_of_row.to(tl.int64)
        x_row = x_base + b_of_row * stride_xb + h_of_row * stride_xh
        o_row = o_base + b_of_row * stride_ob + h_of_row * stride_oh
    return x_row, o_row


@triton.jit
def _rows(q_ptr, qo_ptr, k_ptr, ko_ptr, q_base, qo_base, k_base, ko_base, r0, r_end, q_rows, q_heads, k_heads,
          magic_qheads, magic_kheads,
          stride_qb, stride_qh, stride_qob, stride_qoh, stride_kb, stride_kh, stride_kob, stride_koh,
          GROUP_PER_BATCH: tl.constexpr, BLOCK_R: tl.constexpr, QK: tl.constexpr):
    """Row pointers of rows [r0, r0 + BLOCK_R) of a group, in q and k and in their outputs, which rows
    are q's (in_q) and which exist. With QK a group's rows are q's then k's, so one tile may hold rows
    of both (the pointer not taken is never dereferenced); without, x is both q and k."""
    rows = r0 + tl.arange(0, BLOCK_R)
    in_q = rows < q_rows
    q_row, qo_row = _row_offsets(q_base, qo_base, rows, q_heads, magic_qheads, stride_qb, stride_qh, stride_qob,
                                 stride_qoh, GROUP_PER_BATCH)
    if not QK:
        x_rp, o_rp, r_ok = q_ptr + q_row, qo_ptr + qo_row, rows < r_end
        return x_rp, x_rp, o_rp, o_rp, r_ok, r_ok
    k_row, ko_row = _row_offsets(k_base, ko_base, rows - q_rows, k_heads, magic_kheads, stride_kb, stride_kh,
                                 stride_kob, stride_koh, GROUP_PER_BATCH)
    return q_ptr + q_row, k_ptr + k_row, qo_ptr + qo_row, ko_ptr + ko_row, in_q, rows < r_end


@triton.jit
def _load_chunk(rp_q, rp_k, in_q, r_ok, sd_q, sd_k, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
                INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                BLOCK_TAIL: tl.constexpr, INPLACE: tl.constexpr):
    """The chunk's channels a and b = partner(a) as float32, and its pass-through tail (t's dtype).
    Interleaved reads one contiguous [rows, d2] slice and splits even/odd lanes in registers, so every
    access stays wide. The tail comes with the rotated channels (one round trip per chunk, not two); in
    place it is neither loaded nor stored."""
    k_ok, col_a, col_b = _pair_columns(ROT_DIM, INTERLEAVED, BLOCK_HALF)
    if INTERLEAVED:
        cols = tl.arange(0, 2 * BLOCK_HALF)
        x = tl.load(_tile_ptrs(rp_q, rp_k, in_q, cols, sd_q, sd_k), mask=r_ok[:, None] & (cols < ROT_DIM)[None, :])
        x = x.to(tl.float32)
        xa, xb = tl.split(tl.reshape(x, (BLOCK_R, BLOCK_HALF, 2)))
    else:
        m = r_ok[:, None] & k_ok[None, :]
        xa = tl.load(_tile_ptrs(rp_q, rp_k, in_q, col_a, sd_q, sd_k), mask=m).to(tl.float32)
        xb = tl.load(_tile_ptrs(rp_q, rp_k, in_q, col_b, sd_q, sd_k), mask=m).to(tl.float32)
    if BLOCK_TAIL > 0 and not INPLACE:
        t_cols = ROT_DIM + tl.arange(0, BLOCK_TAIL)
        tail = tl.load(_tile_ptrs(rp_q, rp_k, in_q, t_cols, sd_q, sd_k),
                       mask=r_ok[:, None] & (t_cols < HEAD_DIM)[None, :])
    else:
        tail = xa  # no tail: never stored
    return xa, xb, tail


@triton.jit
def _store_chunk(rp_q, rp_k, in_q, r_ok, sd_q, sd_k, xa, xb, tail, cos_a, cos_b, sin_a, sin_b, out_ty: tl.constexpr,
                 HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
                 RNE_BF16: tl.constexpr, INPLACE: tl.constexpr):
    """Rotate a loaded chunk and store it, and its tail."""
    k_ok, col_a, col_b = _pair_columns(ROT_DIM, INTERLEAVED, BLOCK_HALF)
    out_a = xa * cos_a - xb * sin_a
    out_b = xb * cos_b + xa * sin_b
    if INPLACE:
        # A layout wider than the tile gives some elements to several threads: without the barrier
        # one thread could store the rotated value before another loads the original.
        tl.debug_barrier()
    if INTERLEAVED:
        cols = tl.arange(0, 2 * BLOCK_HALF)
        y = tl.reshape(tl.join(out_a, out_b), (BLOCK_R, 2 * BLOCK_HALF))
        tl.store(_tile_ptrs(rp_q, rp_k, in_q, cols, sd_q, sd_k), _to_output(y, out_ty, RNE_BF16),
                 mask=r_ok[:, None] & (cols < ROT_DIM)[None, :])
    else:
        m = r_ok[:, None] & k_ok[None, :]
        tl.store(_tile_ptrs(rp_q, rp_k, in_q, col_a, sd_q, sd_k), _to_output(out_a, out_ty, RNE_BF16), mask=m)
        tl.store(_tile_ptrs(rp_q, rp_k, in_q, col_b, sd_q, sd_k), _to_output(out_b, out_ty, RNE_BF16), mask=m)
    if BLOCK_TAIL > 0 and not INPLACE:
        t_cols = ROT_DIM + tl.arange(0, BLOCK_TAIL)
        tl.store(_tile_ptrs(rp_q, rp_k, in_q, t_cols, sd_q, sd_k), tail,
                 mask=r_ok[:, None] & (t_cols < HEAD_DIM)[None, :])


# ------------------------------------------------------------------------------------------------------ QK norm
# NORM (1: x * r * w, 2: Gemma's x * r * (1 + w)), r = rsqrt(mean(x^2) + eps) over the whole head: every row of
# a tile is one whole head (channels a, b and the tail), so the norm is a reduction along the tile's rows. The
# tail (channels ROT_DIM..HEAD_DIM) is normalised and weighted, not copied, so it is loaded and stored in place
# too (the launcher gives it a tile of one masked column where there is none). Backward: the program loops over
# work items (pid, pid + n_progs, ...) and writes its partial weight gradients, q's then k's, to row pid of
# part [n_progs, 2, HEAD_DIM]; the launcher sums the rows in a fixed order (no atomics).

@triton.jit
def _load_head(rp_q, rp_k, in_q, r_ok, sd_q, sd_k, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
               INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr):
    """A tile of whole heads as float32 (a, b, tail), zero in the lanes past the head, so that row sums
    are over the head's channels only."""
    k_ok, col_a, col_b = _pair_columns(ROT_DIM, INTERLEAVED, BLOCK_HALF)
    t_ok = (ROT_DIM + tl.arange(0, BLOCK_TAIL)) < HEAD_DIM
    xa, xb, xt = _load_chunk(rp_q, rp_k, in_q, r_ok, sd_q, sd_k, HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_R, BLOCK_HALF,
                             BLOCK_TAIL, False)
    return (tl.where(k_ok[None, :], xa, 0.0), tl.where(k_ok[None, :], xb, 0.0),
            tl.where(t_ok[None, :], xt.to(tl.float32), 0.0))


@triton.jit
def _inv_rms(xa, xb, xt, eps, HEAD_DIM: tl.constexpr):
    """r = rsqrt(mean(x^2) + eps) per row, as a [rows, 1] column (float32)."""
    ss = tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1) + tl.sum(xt * xt, axis=1)
    return tl.rsqrt(ss / HEAD_DIM + eps)[:, None]


@triton.jit
def _store_head(rp_q, rp_k, in_q, r_ok, sd_q, sd_k, out_a, out_b, out_t, out_ty: tl.constexpr, HEAD_DIM: tl.constexpr,
                ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                BLOCK_TAIL: tl.constexpr, RNE_BF16: tl.constexpr, INPLACE: tl.constexpr):
    """Store a tile of whole heads (float32 a, b and tail), each element rounded once."""
    k_ok, col_a, col_b = _pair_columns(ROT_DIM, INTERLEAVED, BLOCK_HALF)
    if INPLACE:
        tl.debug_barrier()  # as in _store_chunk: no store before every thread's load of the tile
    if INTERLEAVED:
        cols = tl.arange(0, 2 * BLOCK_HALF)
        y = tl.reshape(tl.join(out_a, out_b), (BLOCK_R, 2 * BLOCK_HALF))
        tl.store(_tile_ptrs(rp_q, rp_k, in_q, cols, sd_q, sd_k), _to_output(y, out_ty, RNE_BF16),
                 mask=r_ok[:, None] & (cols < ROT_DIM)[None, :])
    else:
        m = r_ok[:, None] & k_ok[None, :]
        tl.store(_tile_ptrs(rp_q, rp_k, in_q, col_a, sd_q, sd_k), _to_output(out_a, out_ty, RNE_BF16), mask=m)
        tl.store(_tile_ptrs(rp_q, rp_k, in_q, col_b, sd_q, sd_k), _to_output(out_b, out_ty, RNE_BF16), mask=m)
    t_cols = ROT_DIM + tl.arange(0, BLOCK_TAIL)
    tl.store(_tile_ptrs(rp_q, rp_k, in_q, t_cols, sd_q, sd_k), _to_output(out_t, out_ty, RNE_BF16),
             mask=r_ok[:, None] & (t_cols < HEAD_DIM)[None, :])


@triton.jit
def _norm_rotate_store(oq, ok, in_q, r_ok, sd_q, sd_k, xa, xb, xt, cos_a, cos_b, sin_a, sin_b, wq_ptr, wk_ptr, eps,
                       out_ty: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
                       RNE_BF16: tl.constexpr, INPLACE: tl.constexpr, NORM: tl.constexpr):
    """Forward of a loaded tile of whole heads: RMS-normalise each row, weight it, rotate it, store it."""
    r = _inv_rms(xa, xb, xt, eps, HEAD_DIM)
    wa, wb, wt = _tile_weights(wq_ptr, wk_ptr, in_q, r_ok, HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_HALF, BLOCK_TAIL,
                               NORM)
    ya, yb = xa * r * wa, xb * r * wb
    _store_head(oq, ok, in_q, r_ok, sd_q, sd_k, ya * cos_a - yb * sin_a, yb * cos_b + ya * sin_b, xt * r * wt, out_ty,
                HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_R, BLOCK_HALF, BLOCK_TAIL, RNE_BF16, INPLACE)


@triton.jit
def _tile_weights(wq_ptr, wk_ptr, in_q, r_ok, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
                  INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, NORM: tl.constexpr):
    """The weights of a tile's rows (q's or k's) for channels a, b and the tail, as float32 tiles in the rows'
    layout (Gemma's form: 1 + w). Read per row from L1, they take a tile's registers, not both tensors' rows."""
    k_ok, col_a, col_b = _pair_columns(ROT_DIM, INTERLEAVED, BLOCK_HALF)
    t_cols = ROT_DIM + tl.arange(0, BLOCK_TAIL)
    rows = tl.zeros_like(in_q.to(tl.int32))  # every row reads its tensor's one weight vector
    wq_rows, wk_rows = wq_ptr + rows, wk_ptr + rows
    if INTERLEAVED:  # as _load_chunk: one contiguous slice split in registers, so that the loads stay wide
        cols = tl.arange(0, 2 * BLOCK_HALF)
        w = tl.load(_tile_ptrs(wq_rows, wk_rows, in_q, cols, 1, 1), mask=r_ok[:, None] & (cols < ROT_DIM)[None, :],
                    other=0.0).to(tl.float32)
        wa, wb = tl.split(tl.reshape(w, (w.shape[0], BLOCK_HALF, 2)))
    else:
        m = r_ok[:, None] & k_ok[None, :]
        wa = tl.load(_tile_ptrs(wq_rows, wk_rows, in_q, col_a, 1, 1), mask=m, other=0.0).to(tl.float32)
        wb = tl.load(_tile_ptrs(wq_rows, wk_rows, in_q, col_b, 1, 1), mask=m, other=0.0).to(tl.float32)
    wt = tl.load(_tile_ptrs(wq_rows, wk_rows, in_q, t_cols, 1, 1), mask=r_ok[:, None] & (t_cols < HEAD_DIM)[None, :],
                 other=0.0).to(tl.float32)
    if NORM == 2:
        wa, wb, wt = wa + 1.0, wb + 1.0, wt + 1.0
    return wa, wb, wt


@triton.jit
def _qknorm(q_ptr, qo_ptr, k_ptr, ko_ptr, freqs_ptr, sin_ptr, start_ptr, cu_ptr, wq_ptr, wk_ptr, sq_ptr, sk_ptr,
            part_ptr, q_heads, k_heads, n_batch, q_rows, k_rows, rows_per_program, n_groups, inner,
            magic_groups, magic_inner, magic_batch, magic_qheads, magic_kheads,
            seq_len, n_seqs, freqs_len, cp_size, cp_rank, n_items, n_progs, eps,
            stride_qs, stride_qb, stride_qh, stride_qd, stride_qos, stride_qob, stride_qoh, stride_qod,
            stride_ks, stride_kb, stride_kh, stride_kd, stride_kos, stride_kob, stride_koh, stride_kod,
            stride_fs, stride_fb, stride_fd, stride_fm, stride_ps, stride_pb, stride_pm,
            stride_sqs, stride_sqb, stride_sqh, stride_sqd, stride_sks, stride_skb, stride_skh, stride_skd,
            HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
            IS_THD: tl.constexpr, GROUP_PER_BATCH: tl.constexpr, HAS_START: tl.constexpr, USE_CP: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, RNE_BF16: tl.constexpr,
            PIN: tl.constexpr, INPLACE: tl.constexpr, TABLE: tl.constexpr, SPLIT: tl.constexpr, FANOUT: tl.constexpr,
            POS_TABLE: tl.constexpr, HALF_TABLE: tl.constexpr, MROPE: tl.constexpr, SEC0: tl.constexpr,
            SEC1: tl.constexpr, SEC2: tl.constexpr, NORM: tl.constexpr):
    """RoPE(RMSNorm(x) * w) of q's and k's heads (forward), or its vector-Jacobian product (BACKWARD: q_ptr and
    k_ptr hold the output gradients, sq_ptr and sk_ptr the inputs, q and k; docs/design.md gives the algebra)."""
    k_ok, col_a, col_b = _pair_columns(ROT_DIM, INTERLEAVED, BLOCK_HALF)
    t_cols = ROT_DIM + tl.arange(0, BLOCK_TAIL)
    t_ok = t_cols < HEAD_DIM
    out_ty = qo_ptr.dtype.element_ty
    pid = tl.program_id(0)
    if not BACKWARD:
        # One work item per program (the launcher's grid). As in _rope, the first tile's loads are issued
        # before the position, the angles and the weights are found.
        s_idx, b_idx, r_begin, r_end, q_base, qo_base, k_base, ko_base = _group_of(
            pid, n_groups, inner, magic_groups, magic_inner, magic_batch, n_batch, rows_per_program, q_rows, k_rows,
            stride_qs, stride_qb, stride_qos, stride_qob, stride_ks, stride_kb, stride_kos, stride_kob, GROUP_PER_BATCH,
            SPLIT)
        xq, xk, oq, ok, in_q, r_ok = _rows(q_ptr, qo_ptr, k_ptr, ko_ptr, q_base, qo_base, k_base, ko_base, r_begin,
                                           r_end, q_rows, q_heads, k_heads, magic_qheads, magic_kheads, stride_qb,
                                           stride_qh, stride_qob, stride_qoh, stride_kb, stride_kh, stride_kob,
                                           stride_koh, GROUP_PER_BATCH, BLOCK_R, True)
        xa, xb, xt = _load_head(xq, xk, in_q, r_ok, stride_qd, stride_kd, HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_R,
                                BLOCK_HALF, BLOCK_TAIL)
        cos_a, cos_b, sin_a, sin_b = _group_angles(
            s_idx, b_idx, freqs_ptr, sin_ptr, start_ptr, cu_ptr, seq_len, n_seqs, freqs_len, cp_size, cp_rank,
            stride_fs, stride_fb, stride_fd, stride_fm, stride_ps, stride_pb, stride_pm, ROT_DIM, INTERLEAVED, False,
            IS_THD, HAS_START, USE_CP, BLOCK_HALF, PIN, TABLE, FANOUT, POS_TABLE, HALF_TABLE, MROPE, SEC0, SEC1, SEC2)
        _norm_rotate_store(oq, ok, in_q, r_ok, stride_qod, stride_kod, xa, xb, xt, cos_a, cos_b, sin_a, sin_b,
                           wq_ptr, wk_ptr, eps, out_ty, HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_R, BLOCK_HALF,
                           BLOCK_TAIL, RNE_BF16, INPLACE, NORM)
        for r0 in range(r_begin + BLOCK_R, r_end, BLOCK_R):
            xq, xk, oq, ok, in_q, r_ok = _rows(q_ptr, qo_ptr, k_ptr, ko_ptr, q_base, qo_base, k_base, ko_base, r0,
                                               r_end, q_rows, q_heads, k_heads, magic_qheads, magic_kheads, stride_qb,
                                               stride_qh, stride_qob, stride_qoh, stride_kb, stride_kh, stride_kob,
                                               stride_koh, GROUP_PER_BATCH, BLOCK_R, True)
            xa, xb, xt = _load_head(xq, xk, in_q, r_ok, stride_qd, stride_kd, HEAD_DIM, ROT_DIM, INTERLEAVED,
                                    BLOCK_R, BLOCK_HALF, BLOCK_TAIL)
            _norm_rotate_store(oq, ok, in_q, r_ok, stride_qod, stride_kod, xa, xb, xt, cos_a, cos_b, sin_a, sin_b,
                               wq_ptr, wk_ptr, eps, out_ty, HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_R, BLOCK_HALF,
                               BLOCK_TAIL, RNE_BF16, INPLACE, NORM)
    else:
        acc_qa = tl.zeros([BLOCK_HALF], tl.float32)
        acc_qb = tl.zeros([BLOCK_HALF], tl.float32)
        acc_ka = tl.zeros([BLOCK_HALF], tl.float32)
        acc_kb = tl.zeros([BLOCK_HALF], tl.float32)
        acc_qt = tl.zeros([BLOCK_TAIL], tl.float32)
        acc_kt = tl.zeros([BLOCK_TAIL], tl.float32)
        for item in range(pid, n_items, n_progs):
            s_idx, b_idx, r_begin, r_end, q_base, qo_base, k_base, ko_base = _group_of(
                item, n_groups, inner, magic_groups, magic_inner, magic_batch, n_batch, rows_per_program, q_rows,
                k_rows, stride_qs, stride_qb, stride_qos, stride_qob, stride_ks, stride_kb, stride_kos, stride_kob,
                GROUP_PER_BATCH, SPLIT)
            sq_base, sk_base = s_idx * stride_sqs + b_idx * stride_sqb, s_idx * stride_sks + b_idx * stride_skb
            cos_a, cos_b, sin_a, sin_b = _group_angles(
                s_idx, b_idx, freqs_ptr, sin_ptr, start_ptr, cu_ptr, seq_len, n_seqs, freqs_len, cp_size, cp_rank,
                stride_fs, stride_fb, stride_fd, stride_fm, stride_ps, stride_pb, stride_pm, ROT_DIM, INTERLEAVED,
                BACKWARD, IS_THD, HAS_START, USE_CP, BLOCK_HALF, PIN, TABLE, FANOUT, POS_TABLE, HALF_TABLE, MROPE,
                SEC0, SEC1, SEC2)
            for r0 in range(r_begin, r_end, BLOCK_R):
                xq, xk, oq, ok, in_q, r_ok = _rows(q_ptr, qo_ptr, k_ptr, ko_ptr, q_base, qo_base, k_base, ko_base, r0,
                                                   r_end, q_rows, q_heads, k_heads, magic_qheads, magic_kheads,
                                                   stride_qb, stride_qh, stride_qob, stride_qoh, stride_kb, stride_kh,
                                                   stride_kob, stride_koh, GROUP_PER_BATCH, BLOCK_R, True)
                ga, gb, gt = _load_head(xq, xk, in_q, r_ok, stride_qd, stride_kd, HEAD_DIM, ROT_DIM, INTERLEAVED,
                                        BLOCK_R, BLOCK_HALF, BLOCK_TAIL)
                sq, sk, _, _, _, _ = _rows(sq_ptr, sq_ptr, sk_ptr, sk_ptr, sq_base, sq_base, sk_base, sk_base, r0,
                                           r_end, q_rows, q_heads, k_heads, magic_qheads, magic_kheads, stride_sqb,
                                           stride_sqh, stride_sqb, stride_sqh, stride_skb, stride_skh, stride_skb,
                                           stride_skh, GROUP_PER_BATCH, BLOCK_R, True)
                xa, xb, xt = _load_head(sq, sk, in_q, r_ok, stride_sqd, stride_skd, HEAD_DIM, ROT_DIM, INTERLEAVED,
                                        BLOCK_R, BLOCK_HALF, BLOCK_TAIL)
                r = _inv_rms(xa, xb, xt, eps, HEAD_DIM)
                wa, wb, wt = _tile_weights(wq_ptr, wk_ptr, in_q, r_ok, HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_HALF,
                                           BLOCK_TAIL, NORM)
                na, nb, nt = xa * r, xb * r, xt * r
                ua = ga * cos_a - gb * sin_a  # R^T g (the adjoint's sines)
                ub = gb * cos_b + ga * sin_b
                gna, gnb, gnt = ua * wa, ub * wb, gt * wt
                dot = (tl.sum(gna * na, axis=1) + tl.sum(gnb * nb, axis=1) + tl.sum(gnt * nt, axis=1))[:, None]
                dot = dot / HEAD_DIM
                _store_head(oq, ok, in_q, r_ok, stride_qod, stride_kod, r * (gna - na * dot), r * (gnb - nb * dot),
                            r * (gnt - nt * dot), out_ty, HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_R, BLOCK_HALF,
                            BLOCK_TAIL, RNE_BF16, False)
                rq = (in_q & r_ok)[:, None]
                rk = (r_ok & ~in_q)[:, None]
                acc_qa += tl.sum(tl.where(rq, ua * na, 0.0), axis=0)
                acc_qb += tl.sum(tl.where(rq, ub * nb, 0.0), axis=0)
                acc_qt += tl.sum(tl.where(rq, gt * nt, 0.0), axis=0)
                acc_ka += tl.sum(tl.where(rk, ua * na, 0.0), axis=0)
                acc_kb += tl.sum(tl.where(rk, ub * nb, 0.0), axis=0)
                acc_kt += tl.sum(tl.where(rk, gt * nt, 0.0), axis=0)
        row = part_ptr + pid.to(tl.int64) * (2 * HEAD_DIM)
        tl.store(row + col_a, acc_qa, mask=k_ok)
        tl.store(row + col_b, acc_qb, mask=k_ok)
        tl.store(row + t_cols, acc_qt, mask=t_ok)
        tl.store(row + HEAD_DIM + col_a, acc_ka, mask=k_ok)
        tl.store(row + HEAD_DIM + col_b, acc_kb, mask=k_ok)
        tl.store(row + HEAD_DIM + t_cols, acc_kt, mask=t_ok)


# ------------------------------------------------------------------------------------------------ KV-cache write
# Serving (rope/serving.py): q and k of each token rotated in place, and the rotated k (all its channels) and the
# unrotated v stored at the token's cache slot. A group is one token, its rows q's heads then k's; the slot
# (block * block_size + offset) is read once per program. A slot outside [0, n_cache_slots) (vLLM's -1 padding),
# or a token past the slots given (a short slot_mapping), is rotated and not stored. FP8: the cache holds
# e4m3(x / scale), x the value in the model's dtype (k rounded once, as the unfused pair stores it), the division
# rounded correctly and the result saturated at +-448, as vLLM's conversion does.

@triton.jit
def _quotient(x, scale, inv):
    """x / scale in float32, rounded once, as vLLM divides, without a division per element (a correctly rounded
    one cost 4.4 µs of the 7.1 of a decode of 64 tokens on an H200): with inv = RN(1 / scale), q0 = RN(x inv) is
    within an ulp of x / scale, and one FMA step q0 + inv (x - q0 scale) is the correctly rounded quotient
    (Markstein's theorem, where nothing overflows). Where |q0| >= 896 the value saturates to 448 either way, and a
    zero q0 keeps its sign. Checked against the division for every bf16 value at 1009 scales from 1e-30 to 1e30:
    the same e4m3 bytes (tests/test_serving.py checks every bf16 value at two scales)."""
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
    y = _quotient(x, scale, inv)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if FP8_BITS:
        bits = y.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        r = ((tl.abs(y) * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)  # 1.5 * 2^23: rounds to integers
        y = tl.where(tl.abs(y) < 0.015625, tl.where((bits >> 31) != 0, -r, r), normal)  # -0 and tiny negatives: -0
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return y.to(cache_ty)


@triton.jit
def _cache_load(q_ptr, k_ptr, v_ptr, q_base, k_base, v_base, r0, r_end, q_rows, q_heads, k_heads, stride_qh,
                stride_qd, stride_kh, stride_kd, stride_vh, stride_vd, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
                INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [r0, r0 + BLOCK_R) of a token: their q/k pointers, which are q's and exist, each row's k head (q rows:
    negative), the loaded channels a, b and tail, and v's row of each k row. v is loaded whether or not the token
    has a slot, so that no load waits for the slot."""
    xq, xk, _, _, in_q, r_ok = _rows(q_ptr, q_ptr, k_ptr, k_ptr, q_base, q_base, k_base, k_base, r0, r_end, q_rows,
                                     q_heads, k_heads, 0, 0, 0, stride_qh, 0, stride_qh, 0, stride_kh, 0, stride_kh,
                                     True, BLOCK_R, True)
    xa, xb, tail = _load_chunk(xq, xk, in_q, r_ok, stride_qd, stride_kd, HEAD_DIM, ROT_DIM, INTERLEAVED,
                               BLOCK_R, BLOCK_HALF, BLOCK_TAIL, False)
    heads = (r0 + tl.arange(0, BLOCK_R) - q_rows).to(tl.int64)
    d_cols = tl.arange(0, BLOCK_D)
    v_rows = v_ptr + v_base + heads * stride_vh
    v = tl.load(_tile_ptrs(v_rows, v_rows, in_q, d_cols, stride_vd, stride_vd),
                mask=(r_ok & (heads >= 0))[:, None] & (d_cols < HEAD_DIM)[None, :])
    return xq, xk, in_q, r_ok, heads, xa, xb, tail, v


@triton.jit
def _cache_store_v(in_q, r_ok, heads, v, vc_ptr, vc_base, stored, v_scale, v_inv, stride_vch, stride_vcd,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, FP8_BITS: tl.constexpr):
    """Store a loaded tile's v rows at the token's slot if `stored`. Called before the angles are found: v's
    registers are free before k's rotation and conversion need theirs."""
    to_cache = r_ok & (tl.where(stored, heads, -1) >= 0)
    d_cols = tl.arange(0, BLOCK_D)
    vc_rows = vc_ptr + vc_base + heads * stride_vch
    tl.store(_tile_ptrs(vc_rows, vc_rows, in_q, d_cols, stride_vcd, stride_vcd),
             _to_cache(v, v_scale, v_inv, vc_ptr.dtype.element_ty, FP8, FP8_BITS),
             mask=to_cache[:, None] & (d_cols < HEAD_DIM)[None, :])


@triton.jit
def _cache_store(xq, xk, in_q, r_ok, heads, xa, xb, tail, cos_a, cos_b, sin_a, sin_b, kc_ptr, kc_base, stored,
                 k_scale, k_inv, stride_qd, stride_kd, stride_kch, stride_kcd, out_ty: tl.constexpr,
                 HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, RNE_BF16: tl.constexpr, FP8: tl.constexpr,
                 FP8_BITS: tl.constexpr):
    """Rotate a loaded tile in place; store its k rows (rotated) at the token's slot if `stored`."""
    kc_ty = kc_ptr.dtype.element_ty
    k_ok, col_a, col_b = _pair_columns(ROT_DIM, INTERLEAVED, BLOCK_HALF)
    to_cache = r_ok & (tl.where(stored, heads, -1) >= 0)
    ya = _to_output(xa * cos_a - xb * sin_a, out_ty, RNE_BF16)
    yb = _to_output(xb * cos_b + xa * sin_b, out_ty, RNE_BF16)
    tl.debug_barrier()  # in place, as in _store_chunk: no store before every thread's load of the tile
    kc_rows = kc_ptr + kc_base + heads * stride_kch
    if INTERLEAVED:
        cols = tl.arange(0, 2 * BLOCK_HALF)
        y = tl.reshape(tl.join(ya, yb), (BLOCK_R, 2 * BLOCK_HALF))
        tl.store(_tile_ptrs(xq, xk, in_q, cols, stride_qd, stride_kd), y,
                 mask=r_ok[:, None] & (cols < ROT_DIM)[None, :])
        tl.store(_tile_ptrs(kc_rows, kc_rows, in_q, cols, stride_kcd, stride_kcd),
                 _to_cache(y, k_scale, k_inv, kc_ty, FP8, FP8_BITS),
                 mask=to_cache[:, None] & (cols < ROT_DIM)[None, :])
    else:
        m = r_ok[:, None] & k_ok[None, :]
        tl.store(_tile_ptrs(xq, xk, in_q, col_a, stride_qd, stride_kd), ya, mask=m)
        tl.store(_tile_ptrs(xq, xk, in_q, col_b, stride_qd, stride_kd), yb, mask=m)
        mc = to_cache[:, None] & k_ok[None, :]
        tl.store(_tile_ptrs(kc_rows, kc_rows, in_q, col_a, stride_kcd, stride_kcd),
                 _to_cache(ya, k_scale, k_inv, kc_ty, FP8, FP8_BITS), mask=mc)
        tl.store(_tile_ptrs(kc_rows, kc_rows, in_q, col_b, stride_kcd, stride_kcd),
                 _to_cache(yb, k_scale, k_inv, kc_ty, FP8, FP8_BITS), mask=mc)
    if BLOCK_TAIL > 0:
        t_cols = ROT_DIM + tl.arange(0, BLOCK_TAIL)
        tl.store(_tile_ptrs(kc_rows, kc_rows, in_q, t_cols, stride_kcd, stride_kcd),
                 _to_cache(tail, k_scale, k_inv, kc_ty, FP8, FP8_BITS),
                 mask=to_cache[:, None] & (t_cols < HEAD_DIM)[None, :])


@triton.jit
def _cache_write(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr, ks_ptr, vs_ptr,
                 q_heads, k_heads, q_rows, k_rows, n_groups, inner, magic_groups, magic_inner,
                 freqs_len, n_slot_entries, n_cache_slots, block_size,
                 stride_qs, stride_qh, stride_qd, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
                 stride_kcb, stride_kco, stride_kch, stride_kcd, stride_vcb, stride_vco, stride_vch, stride_vcd,
                 stride_fs, stride_fd, stride_ps, stride_slot,
                 HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr, RNE_BF16: tl.constexpr,
                 SPLIT: tl.constexpr, FP8: tl.constexpr, FP8_BITS: tl.constexpr):
    """One program: one tile (BLOCK_R rows) of a token's q and k rows rotated in place, its k rows (rotated) and
    v rows stored. As in _rope, the tile and its v rows are loaded before the slot, the position and the angles
    are found: at decode the program's time is these loads' latency, which would otherwise come one after
    another. One tile per program keeps no angles live across tiles, hence fewer registers."""
    # a group is one token: no batch index, so neither n_batch nor its constant is used
    s_idx, b_idx, chunk = _program(n_groups, inner, 1, magic_groups, magic_inner, 0, False, SPLIT)
    r_begin = chunk * BLOCK_R
    r_end = tl.minimum(r_begin + BLOCK_R, q_rows + k_rows)
    q_base = s_idx * stride_qs
    k_base = s_idx * stride_ks
    v_base = s_idx * stride_vs
    out_ty = q_ptr.dtype.element_ty
    xq, xk, in_q, r_ok, heads, xa, xb, tail, v = _cache_load(
        q_ptr, k_ptr, v_ptr, q_base, k_base, v_base, r_begin, r_end, q_rows, q_heads, k_heads, stride_qh, stride_qd,
        stride_kh, stride_kd, stride_vh, stride_vd, HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_R, BLOCK_HALF, BLOCK_TAIL,
        BLOCK_D)
    slot = tl.load(slot_ptr + s_idx * stride_slot, mask=s_idx < n_slot_entries, other=-1).to(tl.int64)
    pos = _position(s_idx, b_idx, pos_ptr, pos_ptr, 0, 0, 1, 0, stride_ps, 0, 0, 0, True, False, False, 1, True, 0)
    stored = (slot >= 0) & (slot < n_cache_slots)
    slot = tl.where(stored, slot, 0)
    block = slot // block_size
    offset = slot - block * block_size
    kc_base = block * stride_kcb + offset * stride_kco
    vc_base = block * stride_vcb + offset * stride_vco
    k_scale = 1.0
    v_scale = 1.0
    k_inv = 1.0
    v_inv = 1.0
    if FP8:
        k_scale = tl.load(ks_ptr).to(tl.float32)
        v_scale = tl.load(vs_ptr).to(tl.float32)
        k_inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), k_scale)  # one division per program, rounded once
        v_inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), v_scale)
    _cache_store_v(in_q, r_ok, heads, v, vc_ptr, vc_base, stored, v_scale, v_inv, stride_vch, stride_vcd, HEAD_DIM,
                   BLOCK_D, FP8, FP8_BITS)
    cos_a, cos_b, sin_a, sin_b = _angles(cos_ptr, sin_ptr, pos, b_idx, 0, freqs_len, stride_fs, 0, stride_fd, 0,
                                         ROT_DIM, INTERLEAVED, False, BLOCK_HALF, False, True, True, 0)
    _cache_store(xq, xk, in_q, r_ok, heads, xa, xb, tail, cos_a, cos_b, sin_a, sin_b, kc_ptr, kc_base, stored,
                 k_scale, k_inv, stride_qd, stride_kd, stride_kch, stride_kcd, out_ty, HEAD_DIM, ROT_DIM, INTERLEAVED,
                 BLOCK_R, BLOCK_HALF, BLOCK_TAIL, RNE_BF16, FP8, FP8_BITS)


# Integer arguments that are counts, not strides: Triton would specialize each on == 1 and on
# divisibility by 16, multiplying the compiled variants for no faster code; strides keep their
# specialization, which proves 16-byte alignment.
_MAGIC = ["magic_groups", "magic_inner", "magic_batch", "magic_qheads", "magic_kheads"]
_COUNTS = ["n_heads", "n_batch", "rows_per_group", "rows_per_program", "n_groups", "inner", "seq_len", "n_seqs",
           "freqs_len", "cp_rank", "stride_fb", "magic_groups", "magic_inner", "magic_batch", "magic_heads"]
_QK_COUNTS = ["q_heads", "k_heads", "n_batch", "q_rows", "k_rows", "rows_per_program", "n_groups", "inner", "seq_len",
              "n_seqs", "freqs_len", "cp_rank", "stride_fb"] + _MAGIC
_NORM_COUNTS = _QK_COUNTS + ["n_items", "n_progs"]
_CACHE_COUNTS = ["q_heads", "k_heads", "q_rows", "k_rows", "n_groups", "inner", "magic_groups", "magic_inner",
                 "freqs_len", "n_slot_entries", "n_cache_slots", "block_size"]


@triton.jit
def _rope(q_ptr, qo_ptr, k_ptr, ko_ptr, freqs_ptr, sin_ptr, start_ptr, cu_ptr,
          q_heads, k_heads, n_batch, q_rows, k_rows, rows_per_program, n_groups, inner,
          magic_groups, magic_inner, magic_batch, magic_qheads, magic_kheads,
          seq_len, n_seqs, freqs_len, cp_size, cp_rank,
          stride_qs, stride_qb, stride_qh, stride_qd, stride_qos, stride_qob, stride_qoh, stride_qod,
          stride_ks, stride_kb, stride_kh, stride_kd, stride_kos, stride_kob, stride_koh, stride_kod,
          stride_fs, stride_fb, stride_fd, stride_fm, stride_ps, stride_pb, stride_pm,
          HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
          IS_THD: tl.constexpr, GROUP_PER_BATCH: tl.constexpr, HAS_START: tl.constexpr, USE_CP: tl.constexpr,
          BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, RNE_BF16: tl.constexpr,
          PIN: tl.constexpr, INPLACE: tl.constexpr, TABLE: tl.constexpr, SPLIT: tl.constexpr, FANOUT: tl.constexpr,
          POS_TABLE: tl.constexpr, HALF_TABLE: tl.constexpr, MROPE: tl.constexpr, SEC0: tl.constexpr,
          SEC1: tl.constexpr, SEC2: tl.constexpr, QK: tl.constexpr, PDL: tl.constexpr):
    """One program of either kernel: its chunks of a group's rows, rotated by the group's angles."""
    if PDL:  # launched as a programmatic dependent of the kernel before it: wait for that kernel's writes first
        tl.extra.cuda.gdc_wait()
    s_idx, b_idx, r_begin, r_end, q_base, qo_base, k_base, ko_base = _group_of(
        tl.program_id(0), n_groups, inner, magic_groups, magic_inner, magic_batch, n_batch, rows_per_program, q_rows,
        k_rows, stride_qs, stride_qb, stride_qos, stride_qob, stride_ks, stride_kb, stride_kos, stride_kob,
        GROUP_PER_BATCH, SPLIT)
    out_ty = qo_ptr.dtype.element_ty
    # The first chunk is loaded before the angles: its loads are in flight while they are found.
    xq, xk, oq, ok, in_q, r_ok = _rows(q_ptr, qo_ptr, k_ptr, ko_ptr, q_base, qo_base, k_base, ko_base, r_begin, r_end,
                                       q_rows, q_heads, k_heads, magic_qheads, magic_kheads, stride_qb, stride_qh,
                                       stride_qob, stride_qoh, stride_kb, stride_kh, stride_kob, stride_koh,
                                       GROUP_PER_BATCH, BLOCK_R, QK)
    xa, xb, tail = _load_chunk(xq, xk, in_q, r_ok, stride_qd, stride_kd, HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_R,
                               BLOCK_HALF, BLOCK_TAIL, INPLACE)
    cos_a, cos_b, sin_a, sin_b = _group_angles(
        s_idx, b_idx, freqs_ptr, sin_ptr, start_ptr, cu_ptr, seq_len, n_seqs, freqs_len, cp_size, cp_rank, stride_fs,
        stride_fb, stride_fd, stride_fm, stride_ps, stride_pb, stride_pm, ROT_DIM, INTERLEAVED, BACKWARD, IS_THD,
        HAS_START, USE_CP, BLOCK_HALF, PIN, TABLE, FANOUT, POS_TABLE, HALF_TABLE, MROPE, SEC0, SEC1, SEC2)
    _store_chunk(oq, ok, in_q, r_ok, stride_qod, stride_kod, xa, xb, tail, cos_a, cos_b, sin_a, sin_b, out_ty,
                 HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_R, BLOCK_HALF, BLOCK_TAIL, RNE_BF16, INPLACE)
    for r0 in range(r_begin + BLOCK_R, r_end, BLOCK_R):
        xq, xk, oq, ok, in_q, r_ok = _rows(q_ptr, qo_ptr, k_ptr, ko_ptr, q_base, qo_base, k_base, ko_base, r0, r_end,
                                           q_rows, q_heads, k_heads, magic_qheads, magic_kheads, stride_qb, stride_qh,
                                           stride_qob, stride_qoh, stride_kb, stride_kh, stride_kob, stride_koh,
                                           GROUP_PER_BATCH, BLOCK_R, QK)
        xa, xb, tail = _load_chunk(xq, xk, in_q, r_ok, stride_qd, stride_kd, HEAD_DIM, ROT_DIM, INTERLEAVED,
                                   BLOCK_R, BLOCK_HALF, BLOCK_TAIL, INPLACE)
        _store_chunk(oq, ok, in_q, r_ok, stride_qod, stride_kod, xa, xb, tail, cos_a, cos_b, sin_a, sin_b, out_ty,
                     HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_R, BLOCK_HALF, BLOCK_TAIL, RNE_BF16, INPLACE)


@triton.jit(do_not_specialize=_COUNTS)
def rope_kernel(
    x_ptr, out_ptr, freqs_ptr, sin_ptr, start_ptr, cu_ptr,
    n_heads, n_batch, rows_per_group, rows_per_program, n_groups, inner, magic_groups, magic_inner, magic_batch,
    magic_heads,
    seq_len, n_seqs, freqs_len, cp_size, cp_rank,
    stride_xs, stride_xb, stride_xh, stride_xd,
    stride_os, stride_ob, stride_oh, stride_od,
    stride_fs, stride_fb, stride_fd, stride_fm, stride_ps, stride_pb, stride_pm,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
    IS_THD: tl.constexpr, GROUP_PER_BATCH: tl.constexpr, HAS_START: tl.constexpr, USE_CP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    RNE_BF16: tl.constexpr, PIN: tl.constexpr, INPLACE: tl.constexpr, TABLE: tl.constexpr, SPLIT: tl.constexpr,
    FANOUT: tl.constexpr, POS_TABLE: tl.constexpr, HALF_TABLE: tl.constexpr, MROPE: tl.constexpr,
    SEC0: tl.constexpr, SEC1: tl.constexpr, SEC2: tl.constexpr, PDL: tl.constexpr,
):
    """One tensor: x is q and k, and there are no k rows."""
    _rope(x_ptr, out_ptr, x_ptr, out_ptr, freqs_ptr, sin_ptr, start_ptr, cu_ptr,
          n_heads, n_heads, n_batch, rows_per_group, 0, rows_per_program, n_groups, inner,
          magic_groups, magic_inner, magic_batch, magic_heads, magic_heads,
          seq_len, n_seqs, freqs_len, cp_size, cp_rank,
          stride_xs, stride_xb, stride_xh, stride_xd, stride_os, stride_ob, stride_oh, stride_od,
          stride_xs, stride_xb, stride_xh, stride_xd, stride_os, stride_ob, stride_oh, stride_od,
          stride_fs, stride_fb, stride_fd, stride_fm, stride_ps, stride_pb, stride_pm,
          HEAD_DIM, ROT_DIM, INTERLEAVED, BACKWARD, IS_THD,
          GROUP_PER_BATCH, HAS_START, USE_CP, BLOCK_R, BLOCK_HALF, BLOCK_TAIL, RNE_BF16, PIN, INPLACE, TABLE, SPLIT,
          FANOUT, POS_TABLE, HALF_TABLE, MROPE, SEC0, SEC1, SEC2, False, PDL)


@triton.jit(do_not_specialize=_QK_COUNTS)
def rope_qk_kernel(
    q_ptr, qo_ptr, k_ptr, ko_ptr, freqs_ptr, sin_ptr, start_ptr, cu_ptr,
    q_heads, k_heads, n_batch, q_rows, k_rows, rows_per_program, n_groups, inner,
    magic_groups, magic_inner, magic_batch, magic_qheads, magic_kheads,
    seq_len, n_seqs, freqs_len, cp_size, cp_rank,
    stride_qs, stride_qb, stride_qh, stride_qd,
    stride_qos, stride_qob, stride_qoh, stride_qod,
    stride_ks, stride_kb, stride_kh, stride_kd,
    stride_kos, stride_kob, stride_koh, stride_kod,
    stride_fs, stride_fb, stride_fd, stride_fm, stride_ps, stride_pb, stride_pm,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
    IS_THD: tl.constexpr, GROUP_PER_BATCH: tl.constexpr, HAS_START: tl.constexpr, USE_CP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    RNE_BF16: tl.constexpr, PIN: tl.constexpr, INPLACE: tl.constexpr, TABLE: tl.constexpr, SPLIT: tl.constexpr,
    FANOUT: tl.constexpr, POS_TABLE: tl.constexpr, HALF_TABLE: tl.constexpr, MROPE: tl.constexpr,
    SEC0: tl.constexpr, SEC1: tl.constexpr, SEC2: tl.constexpr, PDL: tl.constexpr,
):
    """q and k of one layer in one launch: a group's rows are q's then k's, its angles found once for both."""
    _rope(q_ptr, qo_ptr, k_ptr, ko_ptr, freqs_ptr, sin_ptr, start_ptr, cu_ptr,
          q_heads, k_heads, n_batch, q_rows, k_rows, rows_per_program, n_groups, inner,
          magic_groups, magic_inner, magic_batch, magic_qheads, magic_kheads,
          seq_len, n_seqs, freqs_len, cp_size, cp_rank,
          stride_qs, stride_qb, stride_qh, stride_qd, stride_qos, stride_qob, stride_qoh, stride_qod,
          stride_ks, stride_kb, stride_kh, stride_kd, stride_kos, stride_kob, stride_koh, stride_kod,
          stride_fs, stride_fb, stride_fd, stride_fm, stride_ps, stride_pb, stride_pm,
          HEAD_DIM, ROT_DIM, INTERLEAVED, BACKWARD, IS_THD,
          GROUP_PER_BATCH, HAS_START, USE_CP, BLOCK_R, BLOCK_HALF, BLOCK_TAIL, RNE_BF16, PIN, INPLACE, TABLE, SPLIT,
          FANOUT, POS_TABLE, HALF_TABLE, MROPE, SEC0, SEC1, SEC2, True, PDL)


@triton.jit(do_not_specialize=_NORM_COUNTS)
def rope_qknorm_kernel(
    q_ptr, qo_ptr, k_ptr, ko_ptr, freqs_ptr, sin_ptr, start_ptr, cu_ptr, wq_ptr, wk_ptr, sq_ptr, sk_ptr, part_ptr,
    q_heads, k_heads, n_batch, q_rows, k_rows, rows_per_program, n_groups, inner,
    magic_groups, magic_inner, magic_batch, magic_qheads, magic_kheads,
    seq_len, n_seqs, freqs_len, cp_size, cp_rank, n_items, n_progs, eps,
    stride_qs, stride_qb, stride_qh, stride_qd,
    stride_qos, stride_qob, stride_qoh, stride_qod,
    stride_ks, stride_kb, stride_kh, stride_kd,
    stride_kos, stride_kob, stride_koh, stride_kod,
    stride_fs, stride_fb, stride_fd, stride_fm, stride_ps, stride_pb, stride_pm,
    stride_sqs, stride_sqb, stride_sqh, stride_sqd,
    stride_sks, stride_skb, stride_skh, stride_skd,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
    IS_THD: tl.constexpr, GROUP_PER_BATCH: tl.constexpr, HAS_START: tl.constexpr, USE_CP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    RNE_BF16: tl.constexpr, PIN: tl.constexpr, INPLACE: tl.constexpr, TABLE: tl.constexpr, SPLIT: tl.constexpr,
    FANOUT: tl.constexpr, POS_TABLE: tl.constexpr, HALF_TABLE: tl.constexpr, MROPE: tl.constexpr,
    SEC0: tl.constexpr, SEC1: tl.constexpr, SEC2: tl.constexpr, NORM: tl.constexpr,
):
    """q and k of one layer normalised per head (RMSNorm with weights w_q, w_k) and rotated, in one launch; the
    backward gives their gradients and the programs' partial weight gradients (part)."""
    _qknorm(q_ptr, qo_ptr, k_ptr, ko_ptr, freqs_ptr, sin_ptr, start_ptr, cu_ptr, wq_ptr, wk_ptr, sq_ptr, sk_ptr,
            part_ptr, q_heads, k_heads, n_batch, q_rows, k_rows, rows_per_program, n_groups, inner,
            magic_groups, magic_inner, magic_batch, magic_qheads, magic_kheads,
            seq_len, n_seqs, freqs_len, cp_size, cp_rank, n_items, n_progs, eps,
            stride_qs, stride_qb, stride_qh, stride_qd, stride_qos, stride_qob, stride_qoh, stride_qod,
            stride_ks, stride_kb, stride_kh, stride_kd, stride_kos, stride_kob, stride_koh, stride_kod,
            stride_fs, stride_fb, stride_fd, stride_fm, stride_ps, stride_pb, stride_pm,
            stride_sqs, stride_sqb, stride_sqh, stride_sqd, stride_sks, stride_skb, stride_skh, stride_skd,
            HEAD_DIM, ROT_DIM, INTERLEAVED, BACKWARD, IS_THD, GROUP_PER_BATCH, HAS_START, USE_CP, BLOCK_R, BLOCK_HALF,
            BLOCK_TAIL, RNE_BF16, PIN, INPLACE, TABLE, SPLIT, FANOUT, POS_TABLE, HALF_TABLE, MROPE, SEC0, SEC1, SEC2,
            NORM)


@triton.jit(do_not_specialize=_CACHE_COUNTS)
def rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr, ks_ptr, vs_ptr,
    q_heads, k_heads, q_rows, k_rows, n_groups, inner, magic_groups, magic_inner, freqs_len, n_slot_entries,
    n_cache_slots, block_size,
    stride_qs, stride_qh, stride_qd, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd, stride_vcb, stride_vco, stride_vch, stride_vcd,
    stride_fs, stride_fd, stride_ps, stride_slot,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr, RNE_BF16: tl.constexpr,
    SPLIT: tl.constexpr, FP8: tl.constexpr, FP8_BITS: tl.constexpr,
):
    """q and k of each token rotated in place at positions[t] of the half cos/sin tables, the rotated k and the
    v stored at the token's slot of the caches (the KV-CACHE WRITE section above)."""
    _cache_write(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr, ks_ptr, vs_ptr,
                 q_heads, k_heads, q_rows, k_rows, n_groups, inner, magic_groups, magic_inner,
                 freqs_len, n_slot_entries, n_cache_slots, block_size,
                 stride_qs, stride_qh, stride_qd, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
                 stride_kcb, stride_kco, stride_kch, stride_kcd, stride_vcb, stride_vco, stride_vch, stride_vcd,
                 stride_fs, stride_fd, stride_ps, stride_slot,
                 HEAD_DIM, ROT_DIM, INTERLEAVED, BLOCK_R, BLOCK_HALF, BLOCK_TAIL, BLOCK_D, RNE_BF16, SPLIT, FP8,
                 FP8_BITS)
