"""RoPE fused with the KV-cache write (`rope_cache_kernel`; docs/design.md, "RoPE fused with the KV-cache write").

Serving (rope/serving.py): q and k of each token rotated in place, and the rotated k (all its channels) and the
unrotated v stored at the token's cache slot. A group is one token, its rows q's heads then k's; the slot
(block * block_size + offset) is read once per program. A slot outside [0, n_cache_slots) (vLLM's -1 padding),
or a token past the slots given (a short slot_mapping), is rotated and not stored. FP8: the cache holds
e4m3(x / scale), x the value in the model's dtype (k rounded once, as the unfused pair stores it), the division
rounded correctly and the result saturated at +-448, as vLLM's conversion does.
"""
import triton
import triton.language as tl

from ._common import (
    _angles,
    _load_pairs,
    _position,
    _program,
    _rows,
    _store_pairs,
    _store_tail,
    _tile_ptrs,
    _to_cache,
    _to_output,
)

_CACHE_COUNTS = ["q_heads", "k_heads", "q_rows", "k_rows", "n_groups", "inner", "magic_groups", "magic_inner",
                 "freqs_len", "n_slot_entries", "n_cache_slots", "block_size"]


@triton.jit
def _cache_load(q_ptr, k_ptr, v_ptr, q_base, k_base, v_base, r0, r_end, q_rows, q_heads, k_heads, stride_qh,
                stride_qd, stride_kh, stride_kd, stride_vh, stride_vd, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
                INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [r0, r0 + BLOCK_R) of a token: their q/k pointers, which are q's and exist, each row's k head (q rows:
    negative), the loaded channels a, b and tail, and v's row of each k row. v is loaded whether or not the token
    has a slot, so that no load waits for the slot."""
    xq, xk, _, _, in_q, rows_ok = _rows(
        q_ptr=q_ptr, q_out_ptr=q_ptr, k_ptr=k_ptr, k_out_ptr=k_ptr, q_base=q_base, q_out_base=q_base, k_base=k_base,
        k_out_base=k_base, r0=r0, r_end=r_end, q_rows=q_rows, q_heads=q_heads, k_heads=k_heads, magic_qheads=0,
        magic_kheads=0, stride_qb=0, stride_qh=stride_qh, stride_qob=0, stride_qoh=stride_qh, stride_kb=0,
        stride_kh=stride_kh, stride_kob=0, stride_koh=stride_kh, GROUP_PER_BATCH=True, BLOCK_R=BLOCK_R, QK=True)
    xa, xb, tail = _load_pairs(q_rows_ptr=xq, k_rows_ptr=xk, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qd,
                               stride_kd=stride_kd, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED,
                               BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL,
                               LOAD_TAIL=BLOCK_TAIL > 0)
    heads = (r0 + tl.arange(0, BLOCK_R) - q_rows).to(tl.int64)
    d_cols = tl.arange(0, BLOCK_D)
    v_rows = v_ptr + v_base + heads * stride_vh
    v = tl.load(_tile_ptrs(q_rows_ptr=v_rows, k_rows_ptr=v_rows, in_q=in_q, cols=d_cols, stride_qd=stride_vd,
                           stride_kd=stride_vd),
                mask=(rows_ok & (heads >= 0))[:, None] & (d_cols < HEAD_DIM)[None, :])
    return xq, xk, in_q, rows_ok, heads, xa, xb, tail, v


@triton.jit
def _cache_store_v(in_q, rows_ok, heads, v, value_cache_ptr, value_cache_base, stored, v_scale, v_inv, stride_vch,
                   stride_vcd, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                   FP8_BITS: tl.constexpr):
    """Store a loaded tile's v rows at the token's slot if `stored`. Called before the angles are found: v's
    registers are free before k's rotation and conversion need theirs."""
    to_cache = rows_ok & (tl.where(stored, heads, -1) >= 0)
    d_cols = tl.arange(0, BLOCK_D)
    vc_rows = value_cache_ptr + value_cache_base + heads * stride_vch
    tl.store(_tile_ptrs(q_rows_ptr=vc_rows, k_rows_ptr=vc_rows, in_q=in_q, cols=d_cols, stride_qd=stride_vcd,
                        stride_kd=stride_vcd),
             _to_cache(x=v, scale=v_scale, inv=v_inv, cache_ty=value_cache_ptr.dtype.element_ty, FP8=FP8,
                       FP8_BITS=FP8_BITS),
             mask=to_cache[:, None] & (d_cols < HEAD_DIM)[None, :])


@triton.jit
def _cache_store(xq, xk, in_q, rows_ok, heads, xa, xb, tail, cos_a, cos_b, sin_a, sin_b, key_cache_ptr,
                 key_cache_base, stored, k_scale, k_inv, stride_qd, stride_kd, stride_kch, stride_kcd,
                 out_ty: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, RNE_BF16: tl.constexpr,
                 FP8: tl.constexpr, FP8_BITS: tl.constexpr):
    """Rotate a loaded tile in place; store its k rows (rotated) at the token's slot if `stored`."""
    kc_ty = key_cache_ptr.dtype.element_ty
    to_cache = rows_ok & (tl.where(stored, heads, -1) >= 0)
    ya = _to_output(v=xa * cos_a - xb * sin_a, out_ty=out_ty, RNE_BF16=RNE_BF16)
    yb = _to_output(v=xb * cos_b + xa * sin_b, out_ty=out_ty, RNE_BF16=RNE_BF16)
    tl.debug_barrier()  # in place: no store before every thread's load of the tile (`_store_pairs`' BARRIER)
    kc_rows = key_cache_ptr + key_cache_base + heads * stride_kch
    # ya and yb are rounded already: the in-place store converts nothing more (RNE_BF16 off, the type already theirs)
    _store_pairs(q_rows_ptr=xq, k_rows_ptr=xk, in_q=in_q, rows_ok=rows_ok, stride_qd=stride_qd, stride_kd=stride_kd,
                 a=ya, b=yb, out_ty=out_ty, RNE_BF16=False, ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R,
                 BLOCK_HALF=BLOCK_HALF, BARRIER=False)
    _store_pairs(q_rows_ptr=kc_rows, k_rows_ptr=kc_rows, in_q=in_q, rows_ok=to_cache, stride_qd=stride_kcd,
                 stride_kd=stride_kcd, a=ya, b=yb, out_ty=kc_ty, RNE_BF16=False, ROT_DIM=ROT_DIM,
                 INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF, BARRIER=False, scale=k_scale,
                 inv=k_inv, FP8=FP8, FP8_BITS=FP8_BITS)
    if BLOCK_TAIL > 0:
        _store_tail(q_rows_ptr=kc_rows, k_rows_ptr=kc_rows, in_q=in_q, rows_ok=to_cache, stride_qd=stride_kcd,
                    stride_kd=stride_kcd, tail=tail, out_ty=kc_ty, RNE_BF16=False, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM,
                    BLOCK_TAIL=BLOCK_TAIL, scale=k_scale, inv=k_inv, FP8=FP8, FP8_BITS=FP8_BITS)


@triton.jit(do_not_specialize=_CACHE_COUNTS)
def rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, positions_ptr, cos_table_ptr,
    sin_table_ptr, k_scale_ptr, v_scale_ptr,
    q_heads, k_heads, q_rows, k_rows, n_groups, inner, magic_groups, magic_inner, freqs_len, n_slot_entries,
    n_cache_slots, block_size,
    q_strides, k_strides, v_strides, key_cache_strides, value_cache_strides, stride_fs, stride_fd, stride_ps,
    stride_slot,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr, RNE_BF16: tl.constexpr,
    SPLIT: tl.constexpr, FP8: tl.constexpr, FP8_BITS: tl.constexpr,
):
    """q and k of each token rotated in place at positions[t] of the half cos/sin tables, the rotated k and the
    v stored at the token's slot of the caches. One program: one tile (BLOCK_R rows) of a token's q and k rows.
    The tile and its v rows are loaded before the slot, the position and the angles are found: at decode the
    program's time is these loads' latency, which would otherwise come one after another. One tile per program
    keeps no angles live across tiles, hence fewer registers. Strides: (token, head, channel) of q, k and v,
    (block, offset in block, head, channel) of the caches."""
    stride_qs, stride_qh, stride_qd = q_strides
    stride_ks, stride_kh, stride_kd = k_strides
    stride_vs, stride_vh, stride_vd = v_strides
    stride_kcb, stride_kco, stride_kch, stride_kcd = key_cache_strides
    stride_vcb, stride_vco, stride_vch, stride_vcd = value_cache_strides
    # a group is one token: no batch index, so neither n_batch nor its constant is used
    s_idx, b_idx, chunk = _program(n_groups=n_groups, inner=inner, n_batch=1, magic_groups=magic_groups,
                                   magic_inner=magic_inner, magic_batch=0, GROUP_PER_BATCH=False, SPLIT=SPLIT)
    r_begin = chunk * BLOCK_R
    r_end = tl.minimum(r_begin + BLOCK_R, q_rows + k_rows)
    q_base = s_idx * stride_qs
    k_base = s_idx * stride_ks
    v_base = s_idx * stride_vs
    out_ty = q_ptr.dtype.element_ty
    xq, xk, in_q, rows_ok, heads, xa, xb, tail, v = _cache_load(
        q_ptr=q_ptr, k_ptr=k_ptr, v_ptr=v_ptr, q_base=q_base, k_base=k_base, v_base=v_base, r0=r_begin, r_end=r_end,
        q_rows=q_rows, q_heads=q_heads, k_heads=k_heads, stride_qh=stride_qh, stride_qd=stride_qd,
        stride_kh=stride_kh, stride_kd=stride_kd, stride_vh=stride_vh, stride_vd=stride_vd, HEAD_DIM=HEAD_DIM,
        ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL,
        BLOCK_D=BLOCK_D)
    slot = tl.load(slot_mapping_ptr + s_idx * stride_slot, mask=s_idx < n_slot_entries, other=-1).to(tl.int64)
    pos = _position(s_idx=s_idx, b_idx=b_idx, start_positions_ptr=positions_ptr,
                    cu_seqlens_or_positions_ptr=positions_ptr, seq_len=0, n_seqs=0, cp_size=1, cp_rank=0,
                    stride_ps=stride_ps, stride_pb=0, stride_pm=0, stream=0, IS_THD=True, HAS_START=False,
                    USE_CP=False, FANOUT=1, POS_TABLE=True, MROPE=0)
    stored = (slot >= 0) & (slot < n_cache_slots)
    slot = tl.where(stored, slot, 0)
    block = slot // block_size
    offset = slot - block * block_size
    key_cache_base = block * stride_kcb + offset * stride_kco
    value_cache_base = block * stride_vcb + offset * stride_vco
    k_scale = 1.0
    v_scale = 1.0
    k_inv = 1.0
    v_inv = 1.0
    if FP8:
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        v_scale = tl.load(v_scale_ptr).to(tl.float32)
        k_inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), k_scale)  # one division per program, rounded once
        v_inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), v_scale)
    _cache_store_v(in_q=in_q, rows_ok=rows_ok, heads=heads, v=v, value_cache_ptr=value_cache_ptr,
                   value_cache_base=value_cache_base, stored=stored, v_scale=v_scale, v_inv=v_inv,
                   stride_vch=stride_vch, stride_vcd=stride_vcd, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, FP8=FP8,
                   FP8_BITS=FP8_BITS)
    cos_a, cos_b, sin_a, sin_b = _angles(
        cos_or_freqs_ptr=cos_table_ptr, sin_ptr=sin_table_ptr, pos=pos, b_idx=b_idx, stream=0, freqs_len=freqs_len,
        stride_fs=stride_fs, stride_fb=0, stride_fd=stride_fd, stride_fm=0, ROT_DIM=ROT_DIM, INTERLEAVED=INTERLEAVED,
        backward=False, BLOCK_HALF=BLOCK_HALF, PIN=False, TABLE=True, HALF_TABLE=True, MROPE=0)
    _cache_store(xq=xq, xk=xk, in_q=in_q, rows_ok=rows_ok, heads=heads, xa=xa, xb=xb, tail=tail, cos_a=cos_a,
                 cos_b=cos_b, sin_a=sin_a, sin_b=sin_b, key_cache_ptr=key_cache_ptr, key_cache_base=key_cache_base,
                 stored=stored, k_scale=k_scale, k_inv=k_inv, stride_qd=stride_qd, stride_kd=stride_kd,
                 stride_kch=stride_kch, stride_kcd=stride_kcd, out_ty=out_ty, HEAD_DIM=HEAD_DIM, ROT_DIM=ROT_DIM,
                 INTERLEAVED=INTERLEAVED, BLOCK_R=BLOCK_R, BLOCK_HALF=BLOCK_HALF, BLOCK_TAIL=BLOCK_TAIL,
                 RNE_BF16=RNE_BF16, FP8=FP8, FP8_BITS=FP8_BITS)
