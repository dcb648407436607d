"""Invariants of rope's TransformerEngine-convention call, checked without the reference.

Each is a small named predicate `check_<name>(impl, spec)` that raises AssertionError when the property fails; the
tests below run it on `rope.apply_rotary_pos_emb` on drawn structure. These are the properties the native
conformance suite (tests/conformance) does not state for TE's call: the adjoint, linearity, zero angles and
position zero as the identity, the three formats and the context-parallel shards agreeing, determinism, interleaved
as permuted half-split, and sequences independent of each other. Tolerances are derived from the one-rounding rule
in tests/rope/numerics.py; copies (pass-through channels) and repeated runs are compared bitwise.

Rotation angles (pairs share an angle, as RotaryPositionEmbedding builds them) make position 0 the identity; the
rest holds for any angles, and is checked with independent random angles per element.
"""
from __future__ import annotations

import torch
from hypothesis import example, given, settings

import rope

from .cases import run_case, run_plain
from .numerics import assert_adjoint, assert_agree_within_rounding, assert_linear, assert_within_rounding
from .strategies import (
    build,
    cu_seqlens_of,
    layout_tensor,
    make_angles,
    make_spec,
    random_values,
    rope_specs,
    with_,
)

# ----------------------------------------------------------------------------------------------
# Helpers: the same data in every format. `x` is [B, L, h, d]: B sequences of L tokens.
# ----------------------------------------------------------------------------------------------


def to_format(x, fmt):
    if fmt == "bshd":
        return x.contiguous()
    if fmt == "sbhd":
        return x.transpose(0, 1).contiguous()
    return x.reshape(-1, *x.shape[2:]).contiguous()


def from_format(y, fmt, B, L):
    if fmt == "bshd":
        return y
    if fmt == "sbhd":
        return y.transpose(0, 1)
    return y.reshape(B, L, *y.shape[1:])


def format_kwargs(fmt, B, L, cp_size=1):
    """thd needs cu_seqlens: B sequences of L local tokens, i.e. L * cp_size tokens each globally."""
    return {"cu_seqlens": cu_seqlens_of([L * cp_size] * B)} if fmt == "thd" else {}


def channel_order(d, rot_dim, device):
    """Interleaved channel order as half-split: pairs (2k, 2k+1) become (k, k + d2/2)."""
    order = list(range(0, rot_dim, 2)) + list(range(1, rot_dim, 2)) + list(range(rot_dim, d))
    return torch.tensor(order, device=device)


def shard_index(lengths, cp_size, rank, device):
    """Global token indices rank `rank` holds: chunks rank and 2*cp_size-1-rank of every sequence."""
    idx, offset = [], 0
    for n in lengths:
        c = n // (2 * cp_size)
        for chunk in (rank, 2 * cp_size - 1 - rank):
            idx.extend(range(offset + chunk * c, offset + (chunk + 1) * c))
        offset += n
    return torch.tensor(idx, dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------------------------
# Rotation angles
# ----------------------------------------------------------------------------------------------


def check_position_zero_is_identity(impl, spec):
    """Rotation angles theta_p = p * omega are zero at position 0: the first token of every sequence
    (with no start position and, under context parallelism, on rank 0) comes out unchanged."""
    case = build(with_(spec, max_start=None, cp_size=1, cp_rank=0,
                       seqlens=spec.seqlens if spec.cp_size == 1 else tuple(n // spec.cp_size for n in spec.seqlens)))
    out, _ = run_case(impl, case, backward=False)
    if spec.tensor_format == "thd":
        cu = case.cu_seqlens.tolist()
        firsts = [a for a, b in zip(cu[:-1], cu[1:], strict=True) if b > a]
        got, x = out[firsts], case.t[firsts]
    else:
        dim = 0 if spec.tensor_format == "sbhd" else 1
        got, x = out.narrow(dim, 0, min(1, spec.s)), case.t.narrow(dim, 0, min(1, spec.s))
    assert_within_rounding(got, x.detach().double(), x, case.rot_dim, spec.interleaved, "first token of each sequence")


# ----------------------------------------------------------------------------------------------
# Any angles
# ----------------------------------------------------------------------------------------------


def check_adjoint(impl, spec):
    """The backward is the adjoint of the forward: <rope(x), g> = <x, grad>."""
    case = build(spec)
    out, grad = run_case(impl, case)
    assert_adjoint(out, case.g, case.t, grad, case.rot_dim, spec.interleaved)


def check_zero_angles_identity(impl, spec):
    """Zero angles: cos = 1, sin = 0, so forward and backward are the identity."""
    case = build(with_(spec, angles="zero"))
    out, grad = run_case(impl, case)
    assert_within_rounding(out, case.t.detach().double(), case.t, case.rot_dim, spec.interleaved,
                           "forward with zero angles")
    assert_within_rounding(grad, case.g.detach().double(), case.g, case.rot_dim, spec.interleaved,
                           "backward with zero angles")


# |alpha| + |beta| <= 1 keeps alpha x + beta y within the range of near-max values
COEFFICIENTS = [(0.5, 0.5), (0.75, -0.25), (-0.5, 0.25), (0.25, -0.75)]


def check_linearity(impl, spec):
    """rope(alpha x + beta y) = alpha rope(x) + beta rope(y), and the same for the backward in g."""
    case = build(spec)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    alpha, beta = COEFFICIENTS[spec.seed % len(COEFFICIENTS)]
    dev = case.t.device
    y = random_values(case.t.shape, spec.dtype, spec.values, gen).to(dev)
    g2 = random_values(case.t.shape, spec.dtype, spec.values, gen).to(dev)
    z = (alpha * case.t.double() + beta * y.double()).to(spec.dtype)
    g3 = (alpha * case.g.double() + beta * g2.double()).to(spec.dtype)
    kw = case.kwargs()
    out_x, grad_1 = run_case(impl, case)
    out_y, grad_2 = run_plain(impl, y, case.freqs, g2, **kw)
    out_z, grad_3 = run_plain(impl, z, case.freqs, g3, **kw)
    rd, il = case.rot_dim, spec.interleaved
    assert_linear(out_z, out_x, out_y, alpha, beta, z, case.t, y, rd, il, "forward linearity")
    assert_linear(grad_3, grad_1, grad_2, alpha, beta, g3, case.g, g2, rd, il, "backward linearity")


def check_formats_agree(impl, spec):
    """The same tokens as sbhd, bshd and thd (one packed sequence per batch entry) give the same result."""
    case = build(spec)  # spec is sbhd: [s, b, h, d]
    x = case.t.transpose(0, 1).contiguous()  # [b, s, h, d]
    g = case.g.transpose(0, 1).contiguous()
    B, L = x.shape[0], x.shape[1]
    results = {}
    for fmt in ("sbhd", "bshd", "thd"):
        kw = case.kwargs(tensor_format=fmt, **format_kwargs(fmt, B, L, spec.cp_size))
        out, grad = run_plain(impl, to_format(x, fmt), case.freqs, to_format(g, fmt), **kw)
        results[fmt] = (from_format(out, fmt, B, L), from_format(grad, fmt, B, L))
    for fmt in ("bshd", "thd"):
        assert_agree_within_rounding(results[fmt][0], results["sbhd"][0], x, case.rot_dim, spec.interleaved,
                                     f"forward: {fmt} against sbhd")
        assert_agree_within_rounding(results[fmt][1], results["sbhd"][1], g, case.rot_dim, spec.interleaved,
                                     f"backward: {fmt} against sbhd")


def check_cp_shards_reassemble(impl, spec):
    """Context parallelism: every rank's result on its two chunks equals the unsharded result there,
    and the ranks together cover every token once; with start_positions too, which shift every
    position of a sequence after the context-parallel mapping."""
    cp, fmt = spec.cp_size, spec.tensor_format
    gen = torch.Generator().manual_seed(spec.seed)
    if fmt == "thd":
        lengths = list(spec.seqlens)
        shape, seq_dim = (sum(lengths), spec.h, spec.d), 0
    else:
        lengths = [spec.s * cp]
        shape = (lengths[0], spec.b, spec.h, spec.d) if fmt == "sbhd" else (spec.b, lengths[0], spec.h, spec.d)
        seq_dim = 0 if fmt == "sbhd" else 1
    x, _, _ = layout_tensor(shape, spec.dtype, spec.layout, spec.values, gen)
    g, _, _ = layout_tensor(shape, spec.dtype, spec.grad_layout, spec.values, gen)
    max_start = spec.max_start or 0
    freqs = make_angles(spec, max(lengths, default=0) + max_start + spec.extra_freqs, gen)
    kw = dict(tensor_format=fmt)
    if spec.interleaved:
        kw["interleaved"] = True
    if fmt == "thd":
        kw["cu_seqlens"] = cu_seqlens_of(lengths)
    if spec.max_start is not None:
        kw["start_positions"] = torch.randint(0, max_start + 1, (spec.n_seqs,), generator=gen).to(x.device)
    full, full_grad = run_plain(impl, x, freqs, g, **kw)
    seen = []
    for rank in range(cp):
        idx = shard_index(lengths, cp, rank, x.device)
        seen.append(idx)
        xs, gs = x.index_select(seq_dim, idx), g.index_select(seq_dim, idx)
        out, grad = run_plain(impl, xs, freqs, gs, cp_size=cp, cp_rank=rank, **kw)
        assert_agree_within_rounding(out, full.index_select(seq_dim, idx), xs, spec.rot_dim, spec.interleaved,
                                     f"forward: cp rank {rank} of {cp} against the unsharded result")
        assert_agree_within_rounding(grad, full_grad.index_select(seq_dim, idx), gs, spec.rot_dim,
                                     spec.interleaved, f"backward: cp rank {rank} of {cp} against unsharded")
    covered = torch.cat(seen).sort().values
    assert torch.equal(covered.cpu(), torch.arange(shape[seq_dim])), "shards must cover every token once"


def check_deterministic(impl, spec):
    """The same inputs give bitwise the same output and gradient."""
    case = build(spec)
    out1, grad1 = run_case(impl, case)
    out2, grad2 = run_case(impl, case)
    assert torch.equal(out1, out2), "forward: two runs differ"
    assert torch.equal(grad1, grad2), "backward: two runs differ"


def check_interleaved_is_permuted_half_split(impl, spec):
    """Interleaved on channels (2k, 2k+1) is half-split on the channels reordered to (k, k + d2/2),
    with the angles reordered the same way."""
    case = build(spec)
    order = channel_order(spec.d, case.rot_dim, case.t.device)
    x_h, g_h = case.t[..., order], case.g[..., order]
    f_h = case.freqs[..., order[: case.rot_dim]].contiguous()
    out_i, grad_i = run_case(impl, case, interleaved=True)
    out_h, grad_h = run_plain(impl, x_h, f_h, g_h, **case.kwargs(interleaved=False))
    assert_agree_within_rounding(out_i[..., order], out_h, x_h, case.rot_dim, False,
                                 "forward: interleaved against reordered half-split")
    assert_agree_within_rounding(grad_i[..., order], grad_h, g_h, case.rot_dim, False,
                                 "backward: interleaved against reordered half-split")


def check_sequences_independent(impl, spec):
    """Each sequence (batch entry, or packed thd sequence) gives the same result alone; a start
    position k alone is the same as angles starting at row k (freqs[k:])."""
    case = build(spec)
    out, grad = run_case(impl, case)
    fmt, rd, il = spec.tensor_format, case.rot_dim, spec.interleaved
    kw = dict(tensor_format=fmt)
    if il:
        kw["interleaved"] = True
    if spec.cp_size > 1:
        kw.update(cp_size=spec.cp_size, cp_rank=spec.cp_rank)
    if fmt == "thd":
        local = [n // spec.cp_size for n in spec.seqlens]
        bounds = [(sum(local[:q]), sum(local[:q + 1])) for q in range(len(local))]
    for q in range(spec.n_seqs):
        start = 0 if case.start_positions is None else int(case.start_positions[q])
        extra = {}
        if fmt == "thd":
            lo, hi = bounds[q]
            if lo == hi:
                continue
            index = (slice(lo, hi),)
            extra["cu_seqlens"] = cu_seqlens_of([spec.seqlens[q]])
        else:
            index = (slice(None), slice(q, q + 1)) if fmt == "sbhd" else (slice(q, q + 1),)
        o, gr = run_plain(impl, case.t[index], case.freqs[start:], case.g[index], **kw, **extra)
        assert_agree_within_rounding(o, out[index], case.t[index], rd, il, f"forward: sequence {q} alone")
        assert_agree_within_rounding(gr, grad[index], case.g[index], rd, il, f"backward: sequence {q} alone")


# name -> (predicate, strategy, explicit examples)
CHECKS = {
    "position_zero_is_identity": (check_position_zero_is_identity, rope_specs(rotation=True), []),
    "adjoint": (check_adjoint, rope_specs(), [
        make_spec("bshd", torch.float16, s=4, b=2, h=3, d=16, rot_dim=8, grad_layout="expanded", seed=11),
        make_spec("sbhd", torch.float32, s=3, b=2, h=2, d=8, max_start=2, seed=5)]),
    "zero_angles_identity": (check_zero_angles_identity, rope_specs(), []),
    "linearity": (check_linearity, rope_specs(), []),
    "formats_agree": (check_formats_agree, rope_specs(formats=("sbhd",)), []),
    "cp_shards_reassemble": (check_cp_shards_reassemble, rope_specs(cp=True), [
        make_spec("thd", torch.bfloat16, h=2, d=12, seqlens=(0, 4, 8, 0), cp_size=2, cp_rank=1, seed=7),
        make_spec("sbhd", torch.float32, s=4, b=3, h=2, d=16, cp_size=3, cp_rank=1, max_start=6, seed=17),
        make_spec("thd", torch.float16, h=2, d=8, seqlens=(4, 0, 12), cp_size=2, cp_rank=0, max_start=5, seed=18)]),
    "deterministic": (check_deterministic, rope_specs(), []),
    "interleaved_is_permuted_half_split": (check_interleaved_is_permuted_half_split, rope_specs(), []),
    "sequences_independent": (check_sequences_independent, rope_specs(min_seqs=2, min_b=2), [
        make_spec("thd", torch.float32, h=2, d=16, rot_dim=8, seqlens=(3, 0, 1, 4), max_start=3, seed=6)]),
}


CPU_EXAMPLES = 20  # the cpu-interp profile's examples per property (conftest.py)
# Properties whose every example makes several calls (the unsharded call and one per rank; three formats; a sum
# and its two terms): on the CPU profile a share of the examples gives them the interpreter time of
# the others. Their certification is the GPU profile's 100 examples each.
CPU_SHARE = {"cp_shards_reassemble": 0.5, "formats_agree": 0.5, "linearity": 0.5}


def _property_test(name):
    check, strategy, pins = CHECKS[name]

    def test(spec):
        check(rope.apply_rotary_pos_emb, spec)

    # derandomized runs seed from the test's source, which these share: tell them apart by name
    test._hypothesis_internal_add_digest = name.encode()
    test = given(spec=strategy)(test)
    if name in CPU_SHARE and settings.default.max_examples <= CPU_EXAMPLES:
        test = settings(max_examples=int(CPU_EXAMPLES * CPU_SHARE[name]))(test)
    for pin in reversed(pins):
        test = example(spec=pin)(test)
    test.__name__ = test.__qualname__ = f"test_{name}"
    test.__doc__ = check.__doc__
    return test


test_position_zero_is_identity = _property_test("position_zero_is_identity")
test_adjoint = _property_test("adjoint")
test_zero_angles_identity = _property_test("zero_angles_identity")
test_linearity = _property_test("linearity")
test_formats_agree = _property_test("formats_agree")
test_cp_shards_reassemble = _property_test("cp_shards_reassemble")
test_deterministic = _property_test("deterministic")
test_interleaved_is_permuted_half_split = _property_test("interleaved_is_permuted_half_split")
test_sequences_independent = _property_test("sequences_independent")
