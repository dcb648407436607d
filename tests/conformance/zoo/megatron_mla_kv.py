"""Megatron-LM's MLA key/value split (spec/megatron_mla_kv.py): a correct implementation and planted bugs, each a
mistake a port of `fused_mla_rope_kv_split` to a kernel or to another library's RoPE makes."""
from __future__ import annotations

import torch

from .megatron_mla import (
    check_flags,
    check_float,
    check_packing,
    check_rows_in,
    check_tables,
    check_widths,
    rotation,
    tables_at,
    token_rows,
)


def _check(kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens_kv, cp_rank, cp_size, rotary_interleaved,
           remove_interleaving, out_key, out_value):
    """Megatron's asserts and out-buffer checks, and what its kernel would read out of bounds, refused by the argument
    at fault."""
    check_float("kv", kv)
    check_float("k_pos_emb", k_pos_emb)
    check_widths(emb_dim=emb_dim, k_dim=k_dim, v_dim=v_dim)
    check_flags(emb_dim, cp_rank, cp_size, rotary_interleaved=rotary_interleaved,
                remove_interleaving=remove_interleaving)
    thd = cu_seqlens_kv is not None
    if kv.dim() != (3 if thd else 4) or kv.shape[-1] != k_dim + v_dim:
        raise ValueError(f"kv: expected {'[T, h, d]' if thd else '[s, b, h, d]'} with d = k_dim + v_dim, got "
                         f"{tuple(kv.shape)}")
    if k_pos_emb.device != kv.device or tuple(k_pos_emb.shape) != (*kv.shape[:-2], 1, emb_dim):
        raise ValueError(f"k_pos_emb: expected [..., 1, emb_dim] of kv's tokens on kv's device, got "
                         f"{tuple(k_pos_emb.shape)}")
    check_tables(cos, sin, kv, emb_dim)
    if thd:
        check_packing("cu_seqlens_kv", cu_seqlens_kv, True)
    if (out_key is None) != (out_value is None):
        raise ValueError(f"{'out_value' if out_value is None else 'out_key'}: expected both buffers or neither")
    for name, out, width in (("out_key", out_key, k_dim + emb_dim), ("out_value", out_value, v_dim)):
        if out is None:
            continue
        if not isinstance(out, torch.Tensor) or out.dtype != kv.dtype or out.device != kv.device or \
                tuple(out.shape) != (*kv.shape[:-1], width):
            raise ValueError(f"{name}: expected a tensor of the result's shape, kv's dtype and device")
        if out.requires_grad or torch._debug_has_internal_overlap(out) == 1:
            raise ValueError(f"{name}: expected a buffer outside autograd whose elements do not overlap")
        others = (kv, k_pos_emb) + ((out_key,) if name == "out_value" else ())
        if any(_shares_memory(out, other) for other in others):
            raise ValueError(f"{name}: shares memory with an input")


def _shares_memory(a, b) -> bool:
    """Whether the byte spans of a and b in one storage meet."""
    if not (a.numel() and b.numel()) or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(x):
        far = sum((n - 1) * abs(st) for n, st in zip(x.shape, x.stride(), strict=True))
        return x.storage_offset() * x.element_size(), (x.storage_offset() + far + 1) * x.element_size() - 1

    (lo, hi), (olo, ohi) = span(a), span(b)
    return lo <= ohi and olo <= hi


class _Mapped(torch.autograd.Function):
    """x mapped by `forward`, with `backward` as the map of the upstream gradient."""

    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward = backward
        return forward(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.backward(g), None, None


class _Shared(torch.autograd.Function):
    """The one rope head [..., 1, emb] repeated over `heads`; backward: the heads' gradients reduced by `reduce`."""

    @staticmethod
    def forward(ctx, rope, heads, reduce):
        ctx.reduce = reduce
        return rope.expand(*rope.shape[:-2], heads, rope.shape[-1]).clone()

    @staticmethod
    def backward(ctx, g):
        return ctx.reduce(g), None, None


_REDUCE = {"pe_grad_from_head0": lambda g: g[..., :1, :], "pe_grad_averaged": lambda g: g.mean(-2, keepdim=True)}
# the planted bugs of megatron-mla's zoo that are the same mistake here, under their names there
_SAME_AS_MLA = {"tables_cast_to_kv": "tables_cast_to_t"}


def _apply(kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens_kv, cp_rank, cp_size, rotary_interleaved,
           remove_interleaving, out_key, out_value, bug=None):
    if bug != "unchecked_input":
        _check(kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens_kv, cp_rank, cp_size, rotary_interleaved,
               remove_interleaving, out_key, out_value)
        check_rows_in(token_rows(kv, cu_seqlens_kv, cp_rank, cp_size, None, None), cos)
    mla_bug = _SAME_AS_MLA.get(bug, bug)
    c, s = tables_at(cos, sin, token_rows(kv, cu_seqlens_kv, cp_rank, cp_size, None, mla_bug), cu_seqlens_kv is None)
    one_sequence = (kv.dim() == 4 and kv.shape[1] == 1) or (kv.dim() == 3 and cu_seqlens_kv.shape[0] == 2)
    math = torch.float64 if bug == "math_depends_on_batch" and one_sequence else torch.float32
    rotate = rotation(c, s, remove_interleaving, mla_bug, math, kv.dtype)  # one rounding, to kv's dtype
    rope = _Mapped.apply(k_pos_emb, rotate, rotate) if bug == "backward_not_transposed" else rotate(k_pos_emb)
    heads = kv.shape[-2]
    if bug in _REDUCE:
        rope = _Shared.apply(rope, heads, _REDUCE[bug])
    else:  # autograd of the broadcast sums the heads' gradients
        rope = rope.expand(*kv.shape[:-1], emb_dim)
    if bug == "k_v_swapped":  # kv read as [v | k]
        value, nope = kv[..., :v_dim], kv[..., v_dim:]
    else:
        nope, value = kv[..., :k_dim], kv[..., k_dim:]
    key = torch.cat((rope, nope) if bug == "rope_before_nope" else (nope, rope), -1)
    if bug != "value_a_view":
        value = value.clone()
    if bug == "padding_rows_unwritten" and cu_seqlens_kv is not None:
        # a grid over the sequences' tokens: the rows past them keep what new memory holds (zeros here)
        last = int(cu_seqlens_kv[-1]) // cp_size
        key, value = (torch.cat([x[:last], torch.zeros_like(x[last:])]) for x in (key, value))
    if out_key is None or bug == "out_buffers_ignored":
        return key, value
    out_key.copy_(key)
    out_value.copy_(value)
    return out_key, out_value


def _ported(bug, doc):
    """An implementation of the convention's signature with `bug` planted (None: correct)."""
    def fused_mla_rope_kv_split(kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens_kv=None, cp_rank=0,
                                cp_size=1, rotary_interleaved=False, remove_interleaving=False, out_key=None,
                                out_value=None):
        return _apply(kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens_kv, cp_rank, cp_size,
                      rotary_interleaved, remove_interleaving, out_key, out_value, bug)
    fused_mla_rope_kv_split.__name__ = fused_mla_rope_kv_split.__qualname__ = bug or "correct"
    fused_mla_rope_kv_split.__doc__ = doc
    return fused_mla_rope_kv_split


correct = _ported(None, "Megatron's split: k_pos_emb rotated once in float32 math, one rounding to kv's dtype, "
                        "broadcast over the heads; nope and v copied; new tensors or the out buffers.")
# the shared head
pe_grad_from_head0 = _ported("pe_grad_from_head0", "k_pos_emb's gradient from head 0's rope channels alone (a "
                                                   "backward that reads the one head it broadcast from).")
pe_grad_averaged = _ported("pe_grad_averaged", "k_pos_emb's gradient the mean of the heads' gradients, not their "
                                               "sum.")
# the split
k_v_swapped = _ported("k_v_swapped", "kv read as [v | k_nope]: value from the leading channels, k's from the "
                                     "trailing ones.")
rope_before_nope = _ported("rope_before_nope", "key assembled [rope | nope], Llama's partial-rotary order, not "
                                               "[nope | rope].")
value_a_view = _ported("value_a_view", "value returned as a view of kv (torch.split's), not a new tensor: a later "
                                       "write of kv changes it.")
out_buffers_ignored = _ported("out_buffers_ignored", "New tensors returned whether or not out_key and out_value are "
                                                     "given: the buffers stay unwritten.")
padding_rows_unwritten = _ported("padding_rows_unwritten", "Rows past the last sequence (CUDA-graph padding) not "
                                                           "written: a grid over the sequences' tokens.")
# the rotation
no_deinterleave = _ported("no_deinterleave", "k_pos_emb's pairs read half-split (i, h + i), as TE's or Llama's "
                                             "rotate_half reads them, not (2i, 2i + 1).")
remove_interleaving_inverted = _ported("remove_interleaving_inverted", "The flag read as its name reads: False "
                                       "writes the pairs interleaved, True half-split.")
tables_cast_to_kv = _ported("tables_cast_to_kv", "The tables rounded to kv's dtype before the math (float32 tables "
                                                 "with 16-bit kv: one rounding more).")
backward_not_transposed = _ported("backward_not_transposed", "k_pos_emb's backward applies the forward map to the "
                                                             "summed gradient instead of its transpose.")
# the positions
cp_second_chunk_wrong = _ported("cp_second_chunk_wrong", "The second half of a local sequence taken from chunk "
                                "cp_size + cp_rank, not 2 cp_size - 1 - cp_rank.")
cp_applied_to_sbhd = _ported("cp_applied_to_sbhd", "The dual-chunk map applied to sbhd's rows too (Megatron's sbhd "
                                                   "reads no rank).")
# the contract
math_depends_on_batch = _ported("math_depends_on_batch", "A call of one sequence rotates in float64, others in "
                                "float32: each within the accuracy model, but a sequence's bits depend on the rest "
                                "of the call.")
unchecked_input = _ported("unchecked_input", "No checks: bad arguments fail inside, or read the tables out of range, "
                                             "without naming the argument.")

CORRECT = correct
# the bug the command-line test runs: every draw with a token exposes it, on both sets of draws
CLI_BUG = "rope_before_nope"
BUGS = {
    "pe_grad_from_head0": (pe_grad_from_head0, ("backward", "rope_shared_by_heads")),
    "pe_grad_averaged": (pe_grad_averaged, ("backward", "rope_shared_by_heads")),
    "k_v_swapped": (k_v_swapped, ("forward", "nope_and_v_copied")),
    "rope_before_nope": (rope_before_nope, ("forward", "nope_and_v_copied")),
    "value_a_view": (value_a_view, ("forward",)),
    "out_buffers_ignored": (out_buffers_ignored, ("forward",)),
    "padding_rows_unwritten": (padding_rows_unwritten, ("forward",)),
    "no_deinterleave": (no_deinterleave, ("forward", "backward")),
    "remove_interleaving_inverted": (remove_interleaving_inverted, ("forward", "backward",
                                                                    "remove_interleaving_permutes")),
    "tables_cast_to_kv": (tables_cast_to_kv, ("forward",)),
    "backward_not_transposed": (backward_not_transposed, ("backward",)),
    "cp_second_chunk_wrong": (cp_second_chunk_wrong, ("forward", "context_parallel")),
    "cp_applied_to_sbhd": (cp_applied_to_sbhd, ("forward", "context_parallel")),
    # within the accuracy model: only batch invariance sees it
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "unchecked_input": (unchecked_input, ("refuses_bad_input",)),
}
