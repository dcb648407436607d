"""Megatron-LM's MLA training RoPE (spec/megatron_mla.py): a correct implementation and planted bugs, each a mistake a
port of `fused_mla_rope_inplace` to a kernel or to another library's RoPE makes."""
from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)


def _check(t, cos, sin, nope_dim, emb_dim, cu_seqlens_q, cp_rank, cp_size, rotary_interleaved, inverse,
           remove_interleaving, position_ids):
    """Megatron's asserts, and what its kernel would read out of bounds, refused by the argument at fault."""
    check_float("t", t)
    check_widths(nope_dim=nope_dim, emb_dim=emb_dim)
    check_flags(emb_dim, cp_rank, cp_size, rotary_interleaved=rotary_interleaved, inverse=inverse,
                remove_interleaving=remove_interleaving)
    thd = cu_seqlens_q is not None
    if t.dim() != (3 if thd else 4) or t.shape[-1] != nope_dim + emb_dim:
        raise ValueError(f"t: expected {'[T, h, d]' if thd else '[s, b, h, d]'} with d = nope_dim + emb_dim, got "
                         f"{tuple(t.shape)}")
    if torch._debug_has_internal_overlap(t) == 1:
        raise ValueError("t: its elements overlap: it cannot be written in place")
    check_tables(cos, sin, t, emb_dim)
    if not thd:
        if position_ids is not None:
            raise ValueError("position_ids: only with cu_seqlens_q")
        return
    check_packing("cu_seqlens_q", cu_seqlens_q, position_ids is None)
    if position_ids is None:
        return
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in INTS:
        raise TypeError("position_ids: expected an int32 or int64 tensor")
    if tuple(position_ids.shape) != (t.shape[0],):
        raise ValueError(f"position_ids: expected [{t.shape[0]}]")
    if position_ids.numel() and (position_ids.min() < 0 or position_ids.max() >= cos.shape[0]):
        raise ValueError("position_ids: expected rows of cos")


# The checks of Megatron's two functions alike.

def check_float(name, x):
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOATS:
        raise TypeError(f"{name}: expected a float32, float16 or bfloat16 tensor")


def check_widths(**widths):
    for name, v in widths.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {v!r}")


def check_flags(emb_dim, cp_rank, cp_size, **flags):
    """emb_dim a multiple of 4, the flags bools, rotary_interleaved False, cp_rank within cp_size."""
    if emb_dim == 0 or emb_dim % 4:
        raise ValueError(f"emb_dim: expected a positive multiple of 4, got {emb_dim}")
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")
    if flags["rotary_interleaved"]:
        raise ValueError("rotary_interleaved: only False")
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size: expected an int >= 1, got {cp_size!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank: expected an int in [0, {cp_size}), got {cp_rank!r}")


def check_tables(cos, sin, x, emb_dim):
    for name, tab in (("cos", cos), ("sin", sin)):
        if not isinstance(tab, torch.Tensor) or tab.dtype not in FLOATS:
            raise TypeError(f"{name}: expected a float32, float16 or bfloat16 tensor")
        if tab.device != x.device:
            raise ValueError(f"{name}: expected the device of the rotated tensor")
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise ValueError("sin: expected cos's shape and dtype")
    if cos.dim() not in (2, 4) or cos.shape[-1] != emb_dim or (cos.dim() == 4 and cos.shape[1:3] != (1, 1)):
        raise ValueError(f"cos: expected [rows, 1, 1, emb_dim] or [rows, emb_dim], got {tuple(cos.shape)}")


def check_packing(name, cu_seqlens, by_rows: bool):
    """cu_seqlens an int tensor [n + 1]; `by_rows` (its values give the rows): from 0, non-decreasing."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in INTS:
        raise TypeError(f"{name}: expected an int32 or int64 tensor")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{name}: expected [n + 1]")
    cu = cu_seqlens.long()
    if by_rows and (cu[0] != 0 or (cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name}: expected non-decreasing values from 0")


def check_rows_in(rows, cos):
    """Every token's row within the tables (Megatron's kernel reads past them)."""
    if rows.numel() and int(rows.max()) >= cos.shape[0]:
        raise ValueError(f"cos: too short: rows reach {int(rows.max())}, cos has {cos.shape[0]}")


def _dual_chunk(j, length, cp_size, cp_rank, second=None):
    """Megatron's map of offset j in a local sequence of `length` tokens under context parallelism; `second`: the
    chunk the second half comes from (2 cp_size - 1 - cp_rank)."""
    second = 2 * cp_size - cp_rank - 1 if second is None else second
    half = length // 2
    return torch.where(j < half, j + cp_rank * length // 2, j - half + second * length // 2)


def packed_rows(cu_seqlens, n, cp_size, cp_rank, second=None, bounds=None):
    """The table row of each of n packed tokens; `bounds`: each sequence's local bounds (cu_seqlens // cp_size)."""
    cu = cu_seqlens.long()
    bounds = cu // cp_size if bounds is None else bounds
    tokens = torch.arange(n, device=cu.device)
    count = bounds.shape[0] - 1
    if count == 0:
        return torch.zeros_like(tokens)
    seq = torch.searchsorted(bounds, tokens, right=True) - 1
    inside = seq < count  # past the last sequence: padding, row 0
    seq = seq.clamp(0, count - 1)
    length = bounds[seq + 1] - bounds[seq]
    j = tokens - bounds[seq]
    if cp_size > 1:
        j = _dual_chunk(j, length, cp_size, cp_rank, second(cp_size, cp_rank) if second else None)
    return torch.where(inside, j, 0)


def token_rows(t, cu_seqlens_q, cp_rank, cp_size, position_ids, bug):
    """Each token's table row ([s] or [T])."""
    if cu_seqlens_q is None:
        j = torch.arange(t.shape[0], device=t.device)
        if bug == "cp_applied_to_sbhd" and cp_size > 1:
            j = _dual_chunk(j, t.shape[0], cp_size, cp_rank)
        return j
    if position_ids is not None and bug != "position_ids_ignored":
        rows = position_ids.long()
        if bug == "position_ids_mapped" and cp_size > 1:
            rows = _dual_chunk(rows, t.shape[0], cp_size, cp_rank)
        return rows
    second = (lambda size, rank: size + rank) if bug == "cp_second_chunk_wrong" else None
    bounds = None
    if bug == "local_bounds_from_lengths":
        cu = cu_seqlens_q.long()
        bounds = torch.cat([cu[:1], ((cu[1:] - cu[:-1]) // cp_size).cumsum(0)])
    rows = packed_rows(cu_seqlens_q, t.shape[0], cp_size, cp_rank, second, bounds)
    if bug == "padding_rows_continue" and cp_size == 1 and cu_seqlens_q.numel() > 1 \
            and t.shape[0] > int(cu_seqlens_q[-1]):
        cu = cu_seqlens_q.long()
        tokens = torch.arange(t.shape[0], device=rows.device)
        last = rows[:int(cu[-1])].max() if int(cu[-1]) else rows.new_zeros(())  # the rows the tables surely hold
        rows = torch.where(tokens >= cu[-1], (tokens - cu[-2]).clamp(max=last), rows)
    return rows


def rotation(c, s, remove_interleaving, bug, math=torch.float32, out_dtype=None):
    """The map of the rope slice x [..., emb] by per-token rows c, s (broadcast over heads): `math`, one rounding to
    `out_dtype` (x's where None)."""
    half = c.shape[-1] // 2

    def rotate(x):
        y = x.to(math)
        cm, sm = c.to(math), s.to(math)
        if bug == "tables_cast_to_t":
            cm, sm = (tab.to(out_dtype or x.dtype).to(math) for tab in (c, s))
        x1, x2 = (y[..., :half], y[..., half:]) if bug == "no_deinterleave" else (y[..., 0::2], y[..., 1::2])
        right_cols = slice(0, half) if bug == "table_halves_shared" else slice(half, None)
        left = x1 * cm[..., :half] - x2 * sm[..., :half]
        right = x2 * cm[..., right_cols] + x1 * sm[..., right_cols]
        interleaved = remove_interleaving != (bug == "remove_interleaving_inverted")
        out = torch.stack((left, right), -1).flatten(-2) if interleaved else torch.cat((left, right), -1)
        return out.to(out_dtype or x.dtype)
    return rotate


def tables_at(cos, sin, rows, sbhd: bool):
    """cos, sin at each token's row, [s, 1, 1, emb] (sbhd) or [T, 1, emb] (thd), broadcast over heads; a bug's rows
    may leave the tables: read within them, as a kernel that clamps its loads does."""
    rows = rows.clamp(0, max(cos.shape[0] - 1, 0))
    c, s = (tab.detach().reshape(tab.shape[0], tab.shape[-1])[rows] for tab in (cos, sin))
    return tuple(v[:, None, None] if sbhd else v[:, None] for v in (c, s))


def _sequences_only(c, s, remove_interleaving, bug, last):
    """The map on the rows of the sequences alone: rows from `last` on (padding) left as they are."""
    head = rotation(c[:last], s[:last], remove_interleaving, bug)
    return lambda x: torch.cat([head(x[:last]), x[last:]], 0)


def transpose(rotate):
    """The transpose of the linear map `rotate`: its vector-Jacobian product (at any point)."""
    def rotate_back(g):
        with torch.enable_grad():
            z = torch.zeros(g.shape, dtype=g.dtype, device=g.device, requires_grad=True)
            (back,) = torch.autograd.grad(rotate(z), z, g)
        return back
    return rotate_back


class _Written(torch.autograd.Function):
    """t's channels from `nope` on replaced in t's memory by forward(them), t returned unmarked: autograd hands back
    a tensor over t's memory carrying this node, as Megatron's Function does. Backward: the upstream gradient with
    those channels mapped by `backward`, a new tensor."""

    @staticmethod
    def forward(ctx, t, nope, forward, backward):
        t[..., nope:] = forward(t[..., nope:])
        ctx.nope, ctx.backward = nope, backward
        return t

    @staticmethod
    def backward(ctx, g):
        out = g.clone(memory_format=torch.contiguous_format)
        out[..., ctx.nope:] = ctx.backward(g[..., ctx.nope:])
        return out, None, None, None


def _apply(t, cos, sin, nope_dim, emb_dim, cu_seqlens_q, cp_rank, cp_size, rotary_interleaved, inverse,
           remove_interleaving, position_ids, bug=None):
    if bug != "unchecked_input":
        _check(t, cos, sin, nope_dim, emb_dim, cu_seqlens_q, cp_rank, cp_size, rotary_interleaved, inverse,
               remove_interleaving, position_ids)
    if bug != "unchecked_input":
        check_rows_in(token_rows(t, cu_seqlens_q, cp_rank, cp_size, position_ids, None), cos)
    c, s = tables_at(cos, sin, token_rows(t, cu_seqlens_q, cp_rank, cp_size, position_ids, bug), cu_seqlens_q is None)
    if inverse != (bug == "inverse_sign_wrong"):
        s = -s
    one_sequence = (t.dim() == 4 and t.shape[1] == 1) or (t.dim() == 3 and cu_seqlens_q.shape[0] == 2)
    math = torch.float64 if bug == "math_depends_on_batch" and one_sequence else torch.float32
    rotate = rotation(c, s, remove_interleaving, bug, math)
    if bug == "padding_rows_unwritten" and cu_seqlens_q is not None and position_ids is None:
        rotate = _sequences_only(c, s, remove_interleaving, bug, int(cu_seqlens_q[-1]) // cp_size)
    backward = transpose(rotate)
    if bug == "inverse_as_transpose" and inverse:
        # the kernel's backward direction: the transpose of the map by the tables as given (s is negated here)
        backward = rotation(c, -s, remove_interleaving, bug)
        rotate = transpose(backward)
    if bug == "backward_not_transposed":
        backward = rotate
    if bug == "leading_slice_rotated":  # Llama's [rope | nope]: the leading emb_dim channels
        return _Leading.apply(t, emb_dim, rotate, backward)
    if bug == "out_of_place":  # Megatron's fused_mla_rope_out_of_place: a rotated copy, t left as it is
        t = t.clone()
    return _Written.apply(t, nope_dim, rotate, backward)


class _Leading(torch.autograd.Function):
    """`_Written` on the leading channels [..., :emb]."""

    @staticmethod
    def forward(ctx, t, emb, forward, backward):
        t[..., :emb] = forward(t[..., :emb])
        ctx.emb, ctx.backward = emb, backward
        return t

    @staticmethod
    def backward(ctx, g):
        out = g.clone(memory_format=torch.contiguous_format)
        out[..., :ctx.emb] = ctx.backward(g[..., :ctx.emb])
        return out, None, None, None


def _ported(bug, doc):
    """An implementation of the convention's signature with `bug` planted (None: correct)."""
    def fused_mla_rope_inplace(t, cos, sin, nope_dim, emb_dim, cu_seqlens_q=None, cp_rank=0, cp_size=1,
                               rotary_interleaved=False, inverse=False, remove_interleaving=False, position_ids=None):
        return _apply(t, cos, sin, nope_dim, emb_dim, cu_seqlens_q, cp_rank, cp_size, rotary_interleaved, inverse,
                      remove_interleaving, position_ids, bug)
    fused_mla_rope_inplace.__name__ = fused_mla_rope_inplace.__qualname__ = bug or "correct"
    fused_mla_rope_inplace.__doc__ = doc
    return fused_mla_rope_inplace


correct = _ported(None, "Megatron's map, float32 math, t written in place and returned as its Function returns it.")
# the permutation
no_deinterleave = _ported("no_deinterleave", "Pairs read half-split (i, h + i), as TransformerEngine's or Llama's "
                                             "rotate_half reads them, not (2i, 2i + 1).")
remove_interleaving_inverted = _ported("remove_interleaving_inverted", "The flag read as its name reads: False writes "
                                       "the pairs back interleaved, True half-split.")
leading_slice_rotated = _ported("leading_slice_rotated", "Llama's partial-rotary layout [rope | nope]: the leading "
                                                         "emb_dim channels rotated, not the trailing ones.")
# the tables
table_halves_shared = _ported("table_halves_shared", "Column i read for both channels of pair i (flash-attention's and "
                                                     "GLM's one angle per pair): the second half of the tables unread.")
tables_cast_to_t = _ported("tables_cast_to_t", "The tables rounded to t's dtype before the math (float32 tables with "
                                               "16-bit t: one rounding more).")
# the direction
inverse_sign_wrong = _ported("inverse_sign_wrong", "sin negated where inverse is False and not where it is True: "
                                                   "every call rotates the other way (the call with inverse still "
                                                   "undoes it).")
inverse_as_transpose = _ported("inverse_as_transpose", "inverse=True as the kernel's backward direction (vLLM's "
                               "inverse on this back end): the transpose, whose pairs are read half-split and "
                               "written interleaved.")
backward_not_transposed = _ported("backward_not_transposed", "The backward applies the forward map to the upstream "
                                                             "gradient instead of its transpose.")
# the positions
cp_second_chunk_wrong = _ported("cp_second_chunk_wrong", "The second half of a local sequence taken from chunk "
                                "cp_size + cp_rank, not 2 cp_size - 1 - cp_rank.")
cp_applied_to_sbhd = _ported("cp_applied_to_sbhd", "The dual-chunk map applied to sbhd's rows too, as "
                                                   "TransformerEngine's sbhd reads them (Megatron's sbhd reads none).")
local_bounds_from_lengths = _ported("local_bounds_from_lengths", "Local bounds as the sum of each length // cp_size "
                                    "(TransformerEngine's local lengths), not each global bound // cp_size.")
position_ids_ignored = _ported("position_ids_ignored", "Rows from cu_seqlens_q whether or not position_ids are given.")
position_ids_mapped = _ported("position_ids_mapped", "position_ids taken through the dual-chunk map again under "
                                                     "cp_size > 1 (they replace it).")
padding_rows_unwritten = _ported("padding_rows_unwritten", "Rows past the last sequence left as they are (a kernel "
                                 "that skips them), not rotated at row 0.")
padding_rows_continue = _ported("padding_rows_continue", "Rows past the last sequence, without context "
                                "parallelism, continue the last sequence's positions (as far as the tables reach) "
                                "instead of reading row 0.")
# the contract
out_of_place = _ported("out_of_place", "A rotated copy returned and t left as it is (Megatron's "
                                       "fused_mla_rope_out_of_place).")
math_depends_on_batch = _ported("math_depends_on_batch", "A call of one token row computes in float64, others in "
                                "float32: each within the accuracy model, but a sequence's bits depend on the rest "
                                "of the call.")
unchecked_input = _ported("unchecked_input", "No checks: bad arguments fail inside, or read the tables out of range, "
                                             "without naming the argument.")

CORRECT = correct
# the bug the command-line test runs: every draw with a rotated pair exposes it, on both sets of draws
CLI_BUG = "no_deinterleave"
BUGS = {
    "no_deinterleave": (no_deinterleave, ("forward", "backward", "inverse_undoes")),
    "remove_interleaving_inverted": (remove_interleaving_inverted, ("forward", "backward",
                                                                    "remove_interleaving_permutes")),
    "leading_slice_rotated": (leading_slice_rotated, ("forward", "backward", "nope_untouched")),
    "table_halves_shared": (table_halves_shared, ("forward", "backward")),
    "tables_cast_to_t": (tables_cast_to_t, ("forward",)),
    # a rotation by -theta: the call with inverse still undoes it
    "inverse_sign_wrong": (inverse_sign_wrong, ("forward", "backward")),
    "inverse_as_transpose": (inverse_as_transpose, ("forward",)),
    "backward_not_transposed": (backward_not_transposed, ("backward",)),
    "cp_second_chunk_wrong": (cp_second_chunk_wrong, ("forward", "context_parallel")),
    "cp_applied_to_sbhd": (cp_applied_to_sbhd, ("forward", "context_parallel")),
    "local_bounds_from_lengths": (local_bounds_from_lengths, ("forward",)),
    "position_ids_ignored": (position_ids_ignored, ("forward", "position_ids_shards")),
    "position_ids_mapped": (position_ids_mapped, ("forward", "position_ids_shards")),
    "padding_rows_unwritten": (padding_rows_unwritten, ("forward",)),
    "padding_rows_continue": (padding_rows_continue, ("forward",)),
    "out_of_place": (out_of_place, ("forward",)),
    # within the accuracy model: only batch invariance sees it
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "unchecked_input": (unchecked_input, ("refuses_bad_input",)),
}
