"""TransformerEngine's call (spec/te.py): a correct implementation, written from docs/contract.md, and planted bugs.

`rope_call(...)` is the implementation with switches; each switch is one bug. Every function here has TE's
signature, so any of them runs as `pytest --rope-impl te:tests.conformance.zoo.te:NAME`.
"""
from __future__ import annotations

import torch

from . import rotate_half

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INDEX = (torch.int32, torch.int64)


def _require(cond, exc, message):
    if not cond:
        raise exc(message)


def _index_tensor(name, x, device):
    _require(isinstance(x, torch.Tensor), TypeError, f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    _require(x.dtype in INDEX, TypeError, f"{name}: expected dtype int32 or int64, got {x.dtype}")
    _require(x.dim() == 1, ValueError, f"{name}: expected a 1-D tensor, got shape {tuple(x.shape)}")
    _require(x.device == device, ValueError, f"{name}: expected the device of t ({device}), got {x.device}")


def check(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank, exc=ValueError):
    """docs/contract.md section 5, in the order of its table; `exc` is what a bad tensor_format raises (a planted
    bug's assert raises another). Returns (the number of sequences, the local length of each)."""
    _require(isinstance(t, torch.Tensor), TypeError, f"t: expected a torch.Tensor, got {type(t).__name__}")
    _require(isinstance(freqs, torch.Tensor), TypeError, f"freqs: expected a torch.Tensor, got {type(freqs).__name__}")
    _require(t.dtype in FLOATS, TypeError, f"t: expected float32, float16 or bfloat16, got {t.dtype}")
    _require(freqs.is_floating_point(), TypeError, f"freqs: expected floating-point angles, got {freqs.dtype}")
    if exc is AssertionError:
        assert tensor_format in ("sbhd", "bshd", "thd"), "unsupported tensor_format"
    _require(tensor_format in ("sbhd", "bshd", "thd"), exc, f"tensor_format: expected sbhd, bshd or thd, got "
                                                           f"{tensor_format!r}")
    _require(isinstance(interleaved, bool), TypeError, f"interleaved: expected a bool, got {type(interleaved)}")
    _require(isinstance(cp_size, int) and not isinstance(cp_size, bool) and cp_size >= 1, ValueError,
             f"cp_size: expected an int >= 1, got {cp_size!r}")
    _require(isinstance(cp_rank, int) and not isinstance(cp_rank, bool) and 0 <= cp_rank < cp_size, ValueError,
             f"cp_rank: expected an int in [0, {cp_size}), got {cp_rank!r}")
    thd = tensor_format == "thd"
    _require(t.dim() == (3 if thd else 4), ValueError, f"t: expected {3 if thd else 4} dims for {tensor_format}, got "
                                                       f"shape {tuple(t.shape)}")
    _require(freqs.dim() == 4 and freqs.shape[1] == 1 and freqs.shape[2] == 1, ValueError,
             f"freqs: expected shape [s2, 1, 1, d2], got {tuple(freqs.shape)}")
    d2 = freqs.shape[-1]
    _require(d2 % 2 == 0 and 2 <= d2 <= t.shape[-1], ValueError, f"freqs: d2 = {d2} must be even, 2 <= d2 <= d")
    _require(freqs.device == t.device, ValueError, f"freqs: expected the device of t ({t.device}), got {freqs.device}")
    if thd:
        _require(cu_seqlens is not None, ValueError, "cu_seqlens: required with tensor_format 'thd'")
        _index_tensor("cu_seqlens", cu_seqlens, t.device)
        _require(cu_seqlens.numel() > 0, ValueError, "cu_seqlens: expected [n + 1] values, got none")
        cu = cu_seqlens.long()
        _require(int(cu[0]) == 0 and bool((cu[1:] >= cu[:-1]).all()), ValueError,
                 "cu_seqlens: expected to start at 0 and never decrease")
        _require(int(cu[-1]) == t.shape[0] * cp_size, ValueError, "cu_seqlens: expected to end at T * cp_size")
        lengths = cu[1:] - cu[:-1]
        _require(cp_size == 1 or bool((lengths % (2 * cp_size) == 0).all()), ValueError,
                 "cu_seqlens: with cp_size > 1 every length must be a multiple of 2 * cp_size")
        local = (lengths // cp_size).tolist()
    else:
        _require(cu_seqlens is None, ValueError, f"cu_seqlens: only valid with tensor_format 'thd', got "
                                                 f"{tensor_format!r}")
        s, b = (t.shape[0], t.shape[1]) if tensor_format == "sbhd" else (t.shape[1], t.shape[0])
        _require(cp_size == 1 or s % 2 == 0, ValueError, "t: with cp_size > 1 the sequence length must be even")
        local = [s] * b
    if start_positions is not None:
        _index_tensor("start_positions", start_positions, t.device)
        _require(start_positions.numel() == len(local), ValueError,
                 f"start_positions: expected [{len(local)}], got {tuple(start_positions.shape)}")
        used = torch.tensor(local, dtype=torch.int64, device=t.device) > 0
        _require(not bool((start_positions.long()[used] < 0).any()), ValueError, "start_positions: must be >= 0")
    return local


def _cp(j, length, cp_size, cp_rank, second=None):
    """The dual-chunk position of local index j; `second`: the index of the rank's second chunk."""
    if cp_size == 1:
        return j
    c = length // 2
    second = 2 * cp_size - 1 - cp_rank if second is None else second
    return torch.where(j < c, j + cp_rank * c, j - c + second * c)


def positions(t_shape, tensor_format, local, start, cp_size, cp_rank, restart=True, second=None, nonempty_starts=False,
              use_start=True, use_cp_rank=True):
    """int64 positions over t's token dims ([s, b], [b, s] or [T]); the switches are planted bugs'."""
    rank = cp_rank if use_cp_rank else 0
    starts = None if start is None or not use_start else start.long().cpu()
    if starts is not None and nonempty_starts:  # a start per non-empty sequence, in order
        order = [i for i, n in enumerate(local) if n > 0]
        remapped = starts.clone()
        for k, i in enumerate(order):
            remapped[i] = starts[k]
        starts = remapped
    if tensor_format == "thd":
        parts, offset = [], 0
        for i, n in enumerate(local):
            j = _cp(torch.arange(n), n, cp_size, rank, second) + (0 if restart else offset)
            parts.append(j + (int(starts[i]) if starts is not None else 0))
            offset += n
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    b, s = len(local), t_shape[0] if tensor_format == "sbhd" else t_shape[1]
    pos = _cp(torch.arange(s), s, cp_size, rank, second)[None, :].expand(b, s)
    if starts is not None:
        pos = pos + starts[:, None]
    return pos.t() if tensor_format == "sbhd" else pos


def as_int32_words(x):
    """An int64 tensor's memory read as int32 values, as a kernel that takes int32 pointers reads it."""
    return x.contiguous().view(torch.int32)[: x.numel()] if x.dtype == torch.int64 else x


def contiguous_memory(x):
    """x's memory read from its first element with contiguous strides (zeros past its storage)."""
    avail = x.untyped_storage().nbytes() // x.element_size() - x.storage_offset()
    n = min(x.numel(), max(avail, 0))
    flat = x.as_strided((n,), (1,), x.storage_offset())
    if n < x.numel():
        flat = torch.cat([flat, flat.new_zeros(x.numel() - n)])
    return flat.reshape(x.shape)


def rope_call(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=True, cu_seqlens=None,
              cp_size=1, cp_rank=0, *, exc=ValueError, check_range=True, sign=1.0, angle_dtype=None, trig_dtype=None,
              math=torch.float32, one_angle_per_pair=False, whole_head_partner=False, tail="copy",
              last_pair_copied=False, round_down=False, keep_float32=False, read_contiguous=False,
              freqs_contiguous=False, keep_strides=False, writes_input=False, int32_starts=False, shift=0, **where):
    """The forward of TE's call in PyTorch, float32 math and one rounding; differentiable in t (autograd's backward is
    the exact adjoint). The keywords after `*` are the planted bugs' switches (all off: correct); `where` goes to
    positions()."""
    local = check(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank, exc)
    rows = freqs.shape[0]
    pos = positions(tuple(t.shape), tensor_format, local, start_positions, cp_size, cp_rank)
    if pos.numel() and check_range:
        _require(int(pos.max()) < rows, ValueError, f"freqs: too short: positions reach {int(pos.max())}, s2 = {rows}")
    if int32_starts and start_positions is not None:  # int64 read as int32 words, as a kernel's int pointer does
        start_positions = as_int32_words(start_positions)
    if where or shift or int32_starts:
        pos = positions(tuple(t.shape), tensor_format, local, start_positions, cp_size, cp_rank, **where) + shift
    pos = pos.clamp(0, max(rows - 1, 0))  # a bug's wrong rows are still rows of freqs
    f = (contiguous_memory(freqs) if freqs_contiguous else freqs)[:, 0, 0, :].float()
    if angle_dtype is not None:
        f = f.to(angle_dtype).float()
    f = f.to(t.device)[pos.to(t.device)].unsqueeze(-2) if rows else \
        torch.zeros((*pos.shape, 1, freqs.shape[-1]), device=t.device)
    d2 = f.shape[-1]
    if one_angle_per_pair:  # the first angle of each pair for both members (assumes cat(theta, theta))
        first = torch.arange(d2, device=t.device)
        first = first - first % 2 if interleaved else first % (d2 // 2)
        f = f[..., first]
    x_all = contiguous_memory(t) if read_contiguous else t
    x = x_all[..., :d2].to(math)
    cos, sin = f.cos(), f.sin()
    if trig_dtype is not None:
        cos, sin = cos.to(trig_dtype), sin.to(trig_dtype)
    cos, sin = cos.to(math), sin.to(math)
    partner = rotate_half(x_all.to(math), False)[..., :d2] if whole_head_partner and not interleaved else \
        rotate_half(x, interleaved)
    rotated = x * cos + sign * partner * sin
    if last_pair_copied:  # the last pair left as it was (a loop one pair short)
        last = [d2 - 2, d2 - 1] if interleaved else [d2 // 2 - 1, d2 - 1]
        keep = torch.zeros(d2, dtype=torch.bool, device=t.device)
        keep[last] = True
        rotated = torch.where(keep, x, rotated)
    if keep_float32:
        out_rot = rotated
    elif round_down:
        out_rot = _toward_zero(rotated, t.dtype)
    else:
        out_rot = rotated.to(t.dtype)
    rest = x_all[..., d2:]
    rest = torch.zeros_like(rest) if tail == "zero" else rest
    out = torch.cat([out_rot, rest.to(out_rot.dtype)], dim=-1)
    if keep_strides:  # the output allocated like t: t's strides where t is a permutation of dense memory
        out = torch.empty_like(t, dtype=out.dtype).copy_(out)
    if writes_input:
        with torch.no_grad():
            t.detach().copy_(out.detach())
    return out


def _toward_zero(v, dtype):
    """v rounded to dtype toward zero (a step back one unit where round-to-nearest went away from zero)."""
    r = v.to(dtype)
    if dtype == v.dtype:
        return r
    over = r.detach().double().abs() > v.detach().double().abs()
    bits = {2: torch.int16, 4: torch.int32}[r.element_size()]
    stepped = (r.detach().view(bits) - 1).view(dtype)
    return torch.where(over, stepped, r)


def correct(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=True, cu_seqlens=None,
            cp_size=1, cp_rank=0):
    return rope_call(t, freqs, tensor_format, start_positions, interleaved, fused, cu_seqlens, cp_size, cp_rank)


class _Split(torch.autograd.Function):
    """forward(t) = fwd(t), backward(g) = bwd(g): a kernel pair whose halves are written apart."""

    @staticmethod
    def forward(ctx, t, fwd, bwd):
        ctx.bwd = bwd
        return fwd(t)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g), None, None


def _adjoint(g, freqs, args, **switches):
    """The exact backward for upstream g: the vector-Jacobian product of the (linear) forward, taken at zero."""
    x = torch.zeros(g.shape, dtype=g.dtype, device=g.device, requires_grad=True)
    with torch.enable_grad():
        y = rope_call(x, freqs, **args, **switches)
        return torch.autograd.grad(y, x, g)[0]


def _te(forward=None, backward=None):
    """A TE-signature function: its forward is rope_call with the switches `forward`; its backward autograd's, or
    backward(g, freqs, args) where given."""
    def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=True,
                             cu_seqlens=None, cp_size=1, cp_rank=0):
        args = dict(tensor_format=tensor_format, start_positions=start_positions, interleaved=interleaved,
                    cu_seqlens=cu_seqlens, cp_size=cp_size, cp_rank=cp_rank)
        if backward is None:
            return rope_call(t, freqs, **args, **(forward or {}))
        check(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
        return _Split.apply(t, lambda x: rope_call(x.detach(), freqs, **args, **(forward or {})),
                            lambda g: backward(g, freqs, args))

    return apply_rotary_pos_emb


def _backward_tail_zeroed(g, freqs, args):
    grad = _adjoint(g, freqs, args)
    d2 = freqs.shape[-1]
    return torch.cat([grad[..., :d2], torch.zeros_like(grad[..., d2:])], dim=-1)


def _backward_writes_upstream(g, freqs, args):
    grad = _adjoint(g, freqs, args)
    if g.numel() and 0 not in g.stride():  # the rotated gradient written over the caller's (a buffer reused)
        g.copy_(grad)
    return grad


def _backward_negates_freqs(g, freqs, args):
    """The backward as the forward at -freqs (the inverse rotation where pair halves agree), negated in place and
    never restored."""
    with torch.no_grad():
        freqs.neg_()
    return rope_call(g, freqs, **args)


def _nondeterministic():
    """A kernel whose launch alternates between two variants (an autotuner's choice per call): the second computes
    in float64 and rounds once, within the accuracy model but not the first's bits."""
    calls = [0]

    def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=True,
                             cu_seqlens=None, cp_size=1, cp_rank=0):
        calls[0] += 1
        return rope_call(t, freqs, tensor_format, start_positions, interleaved, fused, cu_seqlens, cp_size, cp_rank,
                         math=torch.float64 if calls[0] % 2 else torch.float32)

    return apply_rotary_pos_emb


def _math_depends_on_batch():
    """A kernel picking its path by the batch (by the number of tokens): a single sequence, or a call of few tokens,
    computes in float64, a larger one in float32; each result within one rounding, but a sequence's result depends on
    what else is in the call."""
    def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=True,
                             cu_seqlens=None, cp_size=1, cp_rank=0):
        alone = (cu_seqlens is not None and cu_seqlens.shape[0] <= 2) if tensor_format == "thd" else \
            t.shape[1 if tensor_format == "sbhd" else 0] <= 1
        return rope_call(t, freqs, tensor_format, start_positions, interleaved, fused, cu_seqlens, cp_size, cp_rank,
                         math=torch.float64 if alone else torch.float32)

    return apply_rotary_pos_emb


math_depends_on_batch = _math_depends_on_batch()
sign_flipped = _te({"sign": -1.0})
whole_head_partner = _te({"whole_head_partner": True})
reads_one_angle_per_pair = _te({"one_angle_per_pair": True})
ignores_start_positions = _te({"use_start": False})
backward_ignores_start_positions = _te(backward=lambda g, f, a: _adjoint(g, f, {**a, "start_positions": None}))
ignores_cp_rank = _te({"use_cp_rank": False})
thd_positions_not_restarting = _te({"restart": False})
thd_start_positions_skip_empty = _te({"nonempty_starts": True})
positions_off_by_one = _te({"shift": 1})
last_pair_copied = _te({"last_pair_copied": True})
forward_zeroes_tail = _te({"tail": "zero"})
backward_zeroes_tail = _te(backward=_backward_tail_zeroed)
backward_own_sine = _te(backward=lambda g, f, a: rope_call(g, f, **a, sign=-1.0))
backward_writes_upstream = _te(backward=_backward_writes_upstream)
backward_negates_freqs = _te(backward=_backward_negates_freqs)
grad_read_as_contiguous = _te(backward=lambda g, f, a: _adjoint(contiguous_memory(g), f, a))
writes_input = _te({"writes_input": True})
float16_angles = _te({"angle_dtype": torch.float16})
rounds_toward_zero = _te({"round_down": True})
returns_float32 = _te({"keep_float32": True})
reads_input_as_contiguous = _te({"read_contiguous": True})
reads_freqs_as_contiguous = _te({"freqs_contiguous": True})
start_positions_read_as_int32 = _te({"int32_starts": True})
clamps_positions_past_freqs = _te({"check_range": False})
asserts_instead_of_raising = _te({"exc": AssertionError})
output_keeps_input_strides = _te({"keep_strides": True})
nondeterministic = _nondeterministic()


def interleaved_ignored(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=True,
                        cu_seqlens=None, cp_size=1, cp_rank=0):
    """Half-split pairs whatever `interleaved` says."""
    check(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
    return rope_call(t, freqs, tensor_format, start_positions, False, fused, cu_seqlens, cp_size, cp_rank)


def interleaved_sign_flipped(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=True,
                             cu_seqlens=None, cp_size=1, cp_rank=0):
    """Interleaved pairs rotated the other way (the sign on the pair's other member)."""
    return rope_call(t, freqs, tensor_format, start_positions, interleaved, fused, cu_seqlens, cp_size, cp_rank,
                     sign=-1.0 if interleaved else 1.0)


def cp_chunks_swapped_order(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                            fused=True, cu_seqlens=None, cp_size=1, cp_rank=0):
    """The rank's second chunk taken as chunk cp_size + cp_rank (a plain split) instead of 2 cp_size - 1 - cp_rank."""
    return rope_call(t, freqs, tensor_format, start_positions, interleaved, fused, cu_seqlens, cp_size, cp_rank,
                     second=cp_size + cp_rank)


def cos_sin_in_t_dtype(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                       fused=True, cu_seqlens=None, cp_size=1, cp_rank=0):
    """cos and sin rounded to t's dtype before the products (TE's unfused path)."""
    return rope_call(t, freqs, tensor_format, start_positions, interleaved, fused, cu_seqlens, cp_size, cp_rank,
                     trig_dtype=t.dtype if isinstance(t, torch.Tensor) else None)


def math_in_t_dtype(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=True,
                    cu_seqlens=None, cp_size=1, cp_rank=0):
    """Products and sum in t's dtype (each rounded), not float32."""
    return rope_call(t, freqs, tensor_format, start_positions, interleaved, fused, cu_seqlens, cp_size, cp_rank,
                     math=t.dtype if isinstance(t, torch.Tensor) and t.dtype in FLOATS else torch.float32)


CORRECT = correct
BUGS = {
    "sign_flipped": (sign_flipped, ("forward", "backward")),
    "interleaved_ignored": (interleaved_ignored, ("forward", "pair_norms_preserved", "inverse", "relative_position",
                                                  "interleaved_is_permuted_half_split")),
    "interleaved_sign_flipped": (interleaved_sign_flipped, ("forward", "interleaved_is_permuted_half_split")),
    "whole_head_partner": (whole_head_partner, ("forward", "pair_norms_preserved", "pass_through_bitwise")),
    "reads_one_angle_per_pair": (reads_one_angle_per_pair, ("forward", "backward")),
    "ignores_start_positions": (ignores_start_positions, ("forward", "sequences_independent")),
    "backward_ignores_start_positions": (backward_ignores_start_positions, ("backward", "inverse",
                                                                            "sequences_independent", "adjoint")),
    "ignores_cp_rank": (ignores_cp_rank, ("forward", "cp_shards")),
    "cp_chunks_swapped_order": (cp_chunks_swapped_order, ("forward", "cp_shards")),
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "thd_positions_not_restarting": (thd_positions_not_restarting, ("forward", "formats_agree", "cp_shards",
                                                                    "sequences_independent", "zero_angles_identity")),
    "thd_start_positions_skip_empty": (thd_start_positions_skip_empty, ("forward", "sequences_independent")),
    "positions_off_by_one": (positions_off_by_one, ("forward", "relative_position", "zero_angles_identity")),
    "last_pair_copied": (last_pair_copied, ("forward", "backward")),
    "forward_zeroes_tail": (forward_zeroes_tail, ("forward", "inverse", "pass_through_bitwise",
                                                  "zero_angles_identity")),
    "backward_zeroes_tail": (backward_zeroes_tail, ("backward", "inverse", "pass_through_bitwise", "adjoint",
                                                    "zero_angles_identity")),
    "backward_own_sine": (backward_own_sine, ("backward", "adjoint")),
    "backward_writes_upstream": (backward_writes_upstream, ("backward",)),
    "backward_negates_freqs": (backward_negates_freqs, ("backward", "deterministic")),
    "grad_read_as_contiguous": (grad_read_as_contiguous, ("backward", "layouts_agree", "adjoint", "linearity")),
    "writes_input": (writes_input, ("forward",)),
    "float16_angles": (float16_angles, ("forward", "relative_position")),
    "cos_sin_in_t_dtype": (cos_sin_in_t_dtype, ("forward",)),
    "math_in_t_dtype": (math_in_t_dtype, ("forward", "pair_norms_preserved")),
    "rounds_toward_zero": (rounds_toward_zero, ("forward", "pair_norms_preserved")),
    "returns_float32": (returns_float32, ("forward", "layouts_agree")),
    "reads_input_as_contiguous": (reads_input_as_contiguous, ("forward", "layouts_agree", "linearity")),
    "reads_freqs_as_contiguous": (reads_freqs_as_contiguous, ("forward",)),
    "start_positions_read_as_int32": (start_positions_read_as_int32, ("forward", "sequences_independent")),
    "clamps_positions_past_freqs": (clamps_positions_past_freqs, ("refuses_bad_input",)),
    "asserts_instead_of_raising": (asserts_instead_of_raising, ("refuses_bad_input",)),
    "output_keeps_input_strides": (output_keeps_input_strides, ("layouts_agree",)),
    "nondeterministic": (nondeterministic, ("deterministic",)),
}
