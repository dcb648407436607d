"""Core contract (docs/contract.md sections 1-5): every format, mode and dtype against the float64 reference.

Runs on the GPU with realistic shapes, and on the CPU through Triton's interpreter with small ones.
"""
from __future__ import annotations

import itertools
import zlib

import pytest
import torch
import triton
import triton.language as tl

import rope
from rope import reference
from rope.kernels import _common

from .cases import (  # noqa: F401
    DEVICE,
    ON_GPU,
    angle_source,
    gpu_decomposition,
    gpu_only,
    make_freqs,
    make_t,
    many_sequences_case,
    needs_angle_source,
    poison_outputs,
    run_both,
)
from .numerics import assert_within_rounding

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (cp_size, cp_rank) or "start": the position modes, which are mutually exclusive
POSITION_MODES = [None, "start", (2, 0), (2, 1), (3, 2)]
# (s, b, h, d) per device: the interpreter runs one program at a time
SHAPE = (24, 3, 5, 48) if ON_GPU else (8, 2, 3, 16)
THD_LENGTHS = [12, 0, 24, 6, 36, 0, 18] if ON_GPU else [4, 0, 6, 2]


def _cu(lengths, device=DEVICE):
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=device)


def _case(tensor_format, dtype, interleaved, partial, mode, seed, max_angle=10.0, layout="contiguous"):
    gen = torch.Generator().manual_seed(seed)
    s, b, h, d = SHAPE
    d2 = d // 2 if partial else d
    kw = dict(tensor_format=tensor_format, interleaved=interleaved)
    cp_size = 1
    if isinstance(mode, tuple):
        cp_size, kw["cp_rank"] = mode
        kw["cp_size"] = cp_size
    if tensor_format == "thd":
        lengths = [n * cp_size * 2 for n in THD_LENGTHS]  # divisible by 2 * cp_size
        cu = _cu(lengths)
        s = sum(lengths) // cp_size
        kw["cu_seqlens"] = cu
        n_pos = len(lengths)
        longest = max(lengths)
    else:
        n_pos = b
        longest = s * cp_size
    s2 = longest + 16
    if mode == "start":
        kw["start_positions"] = torch.randint(0, 16, (n_pos,), generator=gen).to(DEVICE)
    t = make_t(tensor_format, s, b, h, d, dtype, gen, layout)
    freqs = make_freqs(s2, d2, gen, max_angle)
    g = torch.randn(t.shape, generator=gen).to(dtype).to(DEVICE)
    return t, freqs, g, kw, d2


def _stable_seed(*parts) -> int:
    """A seed from the case's parameters, the same in every process (`hash()` of a string is salted per
    process, so a failing case would not come back on the next run)."""
    return zlib.crc32(repr(tuple(map(str, parts))).encode()) % 2**31


def test_case_seeds_are_the_same_in_every_process():
    """The value below was computed in another process (with another PYTHONHASHSEED): a failing case's
    inputs come back on the next run."""
    assert _stable_seed("sbhd", torch.bfloat16, True, False, "start") == 519585882


def _core_cases():
    """Every format x interleaving x rotary width x position mode (with both angle sources: the fixture), the dtypes
    turned through them so that each dtype meets every format, interleaving, width and mode."""
    cases = []
    for f, tensor_format in enumerate(["sbhd", "bshd", "thd"]):
        for i, interleaved in enumerate([False, True]):
            for p, partial in enumerate([False, True]):
                for m, mode in enumerate(POSITION_MODES):
                    dtype = DTYPES[(f + i + p + m) % len(DTYPES)]
                    cases.append(pytest.param(tensor_format, dtype, interleaved, partial, mode, id="-".join(map(str, (
                        tensor_format, dtype, "interleaved" if interleaved else "halfsplit",
                        "partial" if partial else "full", mode)))))
    return cases


def test_core_cases_meet_every_dtype():
    cases = [p.values for p in _core_cases()]
    for column in (0, 2, 3, 4):  # format, interleaving, rotary width, position mode
        for value in {str(c[column]) for c in cases}:
            assert {c[1] for c in cases if str(c[column]) == value} == set(DTYPES), (column, value)


@pytest.mark.parametrize("tensor_format,dtype,interleaved,partial,mode", _core_cases())
def test_matches_float64_reference(tensor_format, dtype, interleaved, partial, mode, angle_source,  # noqa: F811
                                   poison_outputs):  # noqa: F811
    needs_angle_source(angle_source, interleaved)
    t, freqs, g, kw, d2 = _case(tensor_format, dtype, interleaved, partial, mode, seed=_stable_seed(
        tensor_format, dtype, interleaved, partial, mode))
    t_before = t.clone()
    out, grad, ref, ref_grad = run_both(t, freqs, g, **kw)
    assert out.dtype == dtype and out.is_contiguous()
    assert_within_rounding(out, ref, t, d2, interleaved, "forward")
    assert_within_rounding(grad, ref_grad, g, d2, interleaved, "backward")
    assert torch.equal(t, t_before), "t was modified"


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_context_angles(tensor_format, dtype):
    """Angles up to 2e5 rad: approximate sin/cos instructions would be off by whole percents here."""
    t, freqs, g, kw, d2 = _case(tensor_format, dtype, False, False, None, seed=7, max_angle=2e5)
    out, grad, ref, ref_grad = run_both(t, freqs, g, **kw)
    assert_within_rounding(out, ref, t, d2, False, "forward")
    assert_within_rounding(grad, ref_grad, g, d2, False, "backward")


@pytest.mark.parametrize("layout", ["transposed", "strided_last", "sliced"])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halfsplit", "interleaved"])
def test_any_strides(tensor_format, layout, interleaved, poison_outputs, gpu_decomposition):  # noqa: F811
    t, freqs, g, kw, d2 = _case(tensor_format, torch.bfloat16, interleaved, True, None, seed=11, layout=layout)
    assert not t.is_contiguous()
    out, grad, ref, ref_grad = run_both(t, freqs, g, **kw)
    assert out.is_contiguous()
    assert_within_rounding(out, ref, t, d2, interleaved, "forward")
    assert_within_rounding(grad, ref_grad, g, d2, interleaved, "backward")


@pytest.mark.parametrize("shape,d2", [
    ((1, 1, 1, 2), 2), ((3, 2, 17, 80), 80), ((5, 2, 3, 80), 64), ((4, 1, 2, 96), 32), ((2, 3, 1, 6), 4),
])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halfsplit", "interleaved"])
def test_odd_sizes(shape, d2, interleaved, poison_outputs, gpu_decomposition):  # noqa: F811
    gen = torch.Generator().manual_seed(3)
    s, b, h, d = shape
    t = make_t("sbhd", s, b, h, d, torch.float32, gen)
    freqs = make_freqs(s + 3, d2, gen)
    g = torch.randn(t.shape, generator=gen).to(DEVICE)
    out, grad, ref, ref_grad = run_both(t, freqs, g, tensor_format="sbhd", interleaved=interleaved)
    assert_within_rounding(out, ref, t, d2, interleaved, "forward")
    assert_within_rounding(grad, ref_grad, g, d2, interleaved, "backward")


@pytest.mark.parametrize("tensor_format,shape,cu", [
    ("sbhd", (0, 2, 3, 8), None), ("sbhd", (4, 0, 3, 8), None), ("bshd", (2, 4, 0, 8), None),
    ("thd", (0, 3, 8), [0]), ("thd", (0, 3, 8), [0, 0, 0]),
])
def test_empty(tensor_format, shape, cu):
    t = torch.randn(shape, device=DEVICE, requires_grad=True)
    freqs = torch.rand(4, 1, 1, 8, device=DEVICE)
    kw = dict(tensor_format=tensor_format)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    out = rope.apply_rotary_pos_emb(t, freqs, **kw)
    assert out.shape == t.shape
    out.sum().backward()
    assert t.grad.shape == t.shape


def test_deterministic():
    t, freqs, g, kw, d2 = _case("thd", torch.bfloat16, True, True, None, seed=5)
    a = rope.apply_rotary_pos_emb(t, freqs, **kw)
    b = rope.apply_rotary_pos_emb(t, freqs, **kw)
    assert torch.equal(a, b)


def test_freqs_dtype_upcast():
    """Lower-precision angles are read as float32; the result equals passing them as float32."""
    gen = torch.Generator().manual_seed(9)
    t = make_t("sbhd", 4, 2, 3, 16, torch.float32, gen)
    freqs = make_freqs(4, 16, gen).to(torch.bfloat16)
    a = rope.apply_rotary_pos_emb(t, freqs)
    b = rope.apply_rotary_pos_emb(t, freqs.float())
    assert torch.equal(a, b)


def test_fused_false_is_reference():
    gen = torch.Generator().manual_seed(2)
    t = make_t("bshd", 4, 2, 3, 16, torch.float32, gen)
    freqs = make_freqs(6, 12, gen)
    out = rope.apply_rotary_pos_emb(t, freqs, "bshd", None, True, False)
    assert torch.equal(out, reference.apply_rotary_pos_emb(t, freqs, "bshd", interleaved=True))


def test_signature_matches_transformer_engine():
    import inspect

    # TE's parameters, in TE's order, then only keyword-only extensions (inplace)
    params = [(n, p) for n, p in inspect.signature(rope.apply_rotary_pos_emb).parameters.items()
              if p.kind != inspect.Parameter.KEYWORD_ONLY]
    want = [("t", inspect.Parameter.empty), ("freqs", inspect.Parameter.empty), ("tensor_format", "sbhd"),
            ("start_positions", None), ("interleaved", False), ("fused", True), ("cu_seqlens", None),
            ("cp_size", 1), ("cp_rank", 0)]
    assert [(n, p.default) for n, p in params] == want
    ref_params = list(inspect.signature(reference.apply_rotary_pos_emb).parameters)
    assert ref_params == [n for n, _ in want]


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_position_embedding(interleaved):
    emb = rope.RotaryPositionEmbedding(64, rotary_percent=0.5, interleaved=interleaved, device=DEVICE)
    with torch.autocast(device_type="cuda" if ON_GPU else "cpu", dtype=torch.bfloat16):
        f = emb(10, offset=3)
    assert f.dtype == torch.float32 and f.shape == (10, 1, 1, 32)
    pos = torch.arange(3, 13, dtype=torch.float64)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    theta = torch.outer(pos, inv)
    want = torch.stack((theta, theta), -1).reshape(10, 32) if interleaved else torch.cat((theta, theta), -1)
    torch.testing.assert_close(f[:, 0, 0, :].double().cpu(), want, rtol=2e-6, atol=1e-6)


def test_rotary_position_embedding_interpolation():
    emb = rope.RotaryPositionEmbedding(8, seq_len_interpolation_factor=2.0, pretrained_max_position_embeddings=4)
    fixed = emb(6)  # 6 <= 4 * 2: fixed scaling by 1/2
    torch.testing.assert_close(fixed, rope.RotaryPositionEmbedding(8)(6) / 2.0)
    dynamic = emb(16)  # 16 > 8: dynamic scaling by 4/16
    torch.testing.assert_close(dynamic, rope.RotaryPositionEmbedding(8)(16) / 4.0)


@gpu_only
@pytest.mark.slow
@pytest.mark.parametrize("tensor_format", ["sbhd", "thd"])
def test_more_than_2_pow_31_elements(tensor_format):
    """Offsets are 64-bit: the last tokens of a 2^31+ element tensor land where they should."""
    h, d = 16, 128
    per_token = h * d
    s = 2**31 // per_token + 3
    t = torch.empty((s, 1, h, d) if tensor_format == "sbhd" else (s, h, d), dtype=torch.bfloat16, device="cuda")
    t.normal_()
    assert t.numel() > 2**31
    gen = torch.Generator().manual_seed(1)
    freqs = make_freqs(s, d, gen, max_angle=1e4)
    kw = dict(tensor_format=tensor_format)
    if tensor_format == "thd":
        kw["cu_seqlens"] = torch.tensor([0, 5, s], dtype=torch.int64, device="cuda")
    t.requires_grad_()
    out = rope.apply_rotary_pos_emb(t, freqs, **kw)
    g = torch.randn_like(out)
    out.backward(g)
    tail = 4  # the last tokens: reference on the slice, with its positions' rows of freqs
    first = s - tail - (5 if tensor_format == "thd" else 0)  # thd: the second sequence starts at token 5
    kw_tail = dict(tensor_format=tensor_format)
    if tensor_format == "thd":
        kw_tail["cu_seqlens"] = torch.tensor([0, tail], dtype=torch.int64, device="cuda")
    x_tail = t.detach()[-tail:].double().requires_grad_()
    ref = reference.apply_rotary_pos_emb(x_tail, freqs[first:first + tail], **kw_tail)
    ref.backward(g[-tail:].double())
    assert_within_rounding(out[-tail:], ref, t.detach()[-tail:], d, False, "forward")
    assert_within_rounding(t.grad[-tail:], x_tail.grad, g[-tail:], d, False, "backward")


def test_value_checks_off_never_reads_past_freqs():
    """With value checks off, an out-of-range start position gives NaN in its rotated channels
    (the kernel does not read past `freqs`), the other tokens stay exact and the tail is copied."""
    gen = torch.Generator().manual_seed(4)
    t = make_t("sbhd", 3, 2, 2, 8, torch.float32, gen)
    freqs = make_freqs(4, 4, gen)
    start = torch.tensor([0, 5], device=DEVICE)  # batch 1 reaches positions 5..7 >= s2 = 4
    with pytest.raises(ValueError, match="freqs"):
        rope.apply_rotary_pos_emb(t, freqs, start_positions=start)
    rope.set_value_checks(False)
    try:
        out = rope.apply_rotary_pos_emb(t, freqs, start_positions=start)
    finally:
        rope.set_value_checks(True)
    assert torch.isnan(out[:, 1, :, :4]).all()
    assert torch.equal(out[:, 1, :, 4:], t[:, 1, :, 4:])
    ok = reference.apply_rotary_pos_emb(t[:, :1], freqs)
    torch.testing.assert_close(out[:, :1], ok)


@pytest.mark.parametrize("start,many", [(False, False), (True, False), (False, True)])
def test_value_checks_off_tokens_past_the_last_sequence(start, many):
    """With value checks off, thd tokens past the end of cu_seqlens (a total short of the tokens)
    belong to no sequence: their rotated channels are NaN, start_positions is never read past its
    end, and the tokens inside sequences stay exact. With few sequences programs search cu_seqlens;
    with many (and no start_positions) they read the position table."""
    gen = torch.Generator().manual_seed(6)
    t = make_t("thd", 7, 1, 2, 8, torch.float32, gen)
    freqs = make_freqs(8, 8, gen)
    bounds = [0, 2, 5] + ([5] * 40 if many else [])  # 5 of 7 tokens; many: 40 more, empty, sequences
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    # a view whose next element (start_positions[2], past its end) is a valid start of 0
    sp = torch.tensor([1, 2, 0], device=DEVICE)[:2] if start else None
    with pytest.raises(ValueError, match="cu_seqlens"):
        rope.apply_rotary_pos_emb(t, freqs, "thd", start_positions=sp, cu_seqlens=cu)
    rope.set_value_checks(False)
    try:
        out = rope.apply_rotary_pos_emb(t, freqs, "thd", start_positions=sp, cu_seqlens=cu)
    finally:
        rope.set_value_checks(True)
    assert torch.isnan(out[5:]).all()
    ok = reference.apply_rotary_pos_emb(t[:5], freqs, "thd", start_positions=sp, cu_seqlens=cu)
    torch.testing.assert_close(out[:5], ok)


def test_value_checks_run_once_per_unmodified_index_tensor(monkeypatch):
    """The device-to-host check runs again exactly when the values may have changed."""
    import rope._checks as validate

    calls = []
    real = validate._check_position_values
    monkeypatch.setattr(validate, "_check_position_values", lambda *a: (calls.append(1), real(*a)))
    gen = torch.Generator().manual_seed(5)
    t = make_t("sbhd", 3, 2, 2, 8, torch.float32, gen)
    freqs = make_freqs(8, 8, gen)
    start = torch.tensor([0, 4], device=DEVICE)
    for _ in range(3):  # every layer of a step passes the same tensor
        rope.apply_rotary_pos_emb(t, freqs, start_positions=start)
    assert len(calls) == 1
    start[1] = 6  # PyTorch sees the write (version bump): checked again, and now too far
    with pytest.raises(ValueError, match="freqs"):
        rope.apply_rotary_pos_emb(t, freqs, start_positions=start)
    assert len(calls) == 2
    start[1] = 5
    rope.apply_rotary_pos_emb(t, freqs, start_positions=start.clone())  # another tensor: checked
    assert len(calls) == 3
    with torch.inference_mode():  # no version counter: checked on every call
        frozen = start.clone()
        for _ in range(2):
            rope.apply_rotary_pos_emb(t, freqs, start_positions=frozen)
    assert len(calls) == 5
    # A memo entry is keyed by id(): a new tensor that reuses a freed one's id (and version 0) must
    # not match its stamp.
    first, other = torch.tensor([0, 4], device=DEVICE), torch.tensor([0, 4], device=DEVICE)
    assert first._version == other._version
    assert validate._still(validate._stamp(first), first)
    assert not validate._still(validate._stamp(first), other)


@pytest.mark.parametrize("shape", [(6,), (2, 3)], ids=["tokens", "batch-seq"])
def test_per_token_positions_checked_once_per_unmodified_tensor(monkeypatch, shape):
    """vLLM's positions, passed unmodified to every layer, cost one device-to-host check, not one per call."""
    import rope.vllm

    calls = []
    real = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    gen = torch.Generator().manual_seed(11)
    positions = torch.randint(0, 8, shape, generator=gen).to(DEVICE)
    cache = torch.randn(8, 8, generator=gen).to(DEVICE)
    query = torch.randn(*shape, 2 * 8, generator=gen).to(DEVICE)
    for _ in range(3):
        rope.vllm.rotary_embedding(positions, query, None, 8, cache, True)
    assert len(calls) == 1
    positions[0] = 7  # a write PyTorch counts: checked again
    rope.vllm.rotary_embedding(positions, query, None, 8, cache, True)
    assert len(calls) == 2


# The launcher's 1-D program order (docs/design.md, "Work decomposition"): `inner`, the number of a
# group's row chunks that are adjacent in memory, for layouts with several chunks per group.
# "chunks": all of a group's chunks (its rows are contiguous). Every output element must be
# written exactly right whatever the order, so each case also runs against the reference.
@pytest.mark.parametrize("tensor_format,b,h,dtype,source,inner", [
    ("sbhd", 3, 5, torch.float32, "table", "chunks"),  # 15 rows in chunks of 8
    ("bshd", 3, 16, torch.float32, "table", 2),  # two 8-row chunks per batch entry
    ("bshd", 3, 12, torch.float32, "table", 1),  # 8 does not divide 12: no runs
    ("bshd", 2, 32, torch.bfloat16, "evaluated", 2),  # 16-bit, evaluated: 16 rows per program
    ("bshd", 1, 20, torch.float32, "table", "chunks"),  # one batch entry: contiguous rows
])
def test_program_order_covers_every_row(tensor_format, b, h, dtype, source, inner, poison_outputs,  # noqa: F811
                                        gpu_decomposition):  # noqa: F811
    from rope import _launch, _table
    from rope._checks import check_static

    gen = torch.Generator().manual_seed(b * h)
    s, d = 3, 8
    t = make_t(tensor_format, s, b, h, d, dtype, gen)
    freqs = make_freqs(s, d, gen)
    g = torch.randn(t.shape, generator=gen).to(dtype).to(DEVICE)
    layout = check_static(t, freqs, tensor_format, None, False, None, 1, 0, allow_float64=False)
    angles = (_table._build(freqs, s, d, lambda c, s_: _launch.table_angles(c, s_, half=False))[1] if source == "table"
              else _launch.freqs_angles(freqs, s))
    plan = _launch.make_plan(t, layout, tensor_format, False, False, 1, 0, angles, backward=False)
    n_groups, got_inner = plan.arg("n_groups"), plan.arg("inner")
    chunks = plan.grid[0] // n_groups
    assert chunks > 1 and chunks % got_inner == 0
    assert got_inner == (chunks if inner == "chunks" else inner)
    rope.set_angle_table(source == "table")
    try:
        out, grad, ref, ref_grad = run_both(t, freqs, g, tensor_format=tensor_format)
    finally:
        rope.set_angle_table(True)
    assert_within_rounding(out, ref, t, d, False, "forward")
    assert_within_rounding(grad, ref_grad, g, d, False, "backward")


# thd reading the table: where the search of cu_seqlens takes several rounds, a program covers a
# few KB of its token's rows (the launcher's _TABLE_THD_BYTES, or _POS_TABLE_THD_BYTES where the
# positions are read from their table instead), several tiles (8 rows, 16 for decode-size tensors: the
# plan's BLOCK_R), and a token with more rows is split over programs; with one round, a program is one
# tile. Each shape is checked to take its path, then against the reference (which the eager call runs
# with the position table where many).
@pytest.mark.parametrize("h,d,dtype,many,split", [
    (20, 8, torch.float32, True, False),  # 32-byte rows: every token in one program of 3 tiles
    (40, 64, torch.bfloat16, True, True),  # 128-byte rows: 40 rows do not fit one program
    (40, 64, torch.bfloat16, False, True),  # one round: 8-row programs
])
def test_thd_table_programs(h, d, dtype, many, split, poison_outputs, gpu_decomposition):  # noqa: F811
    from rope import _launch, _table
    from rope._checks import check_static

    gen = torch.Generator().manual_seed(h)
    lengths = [2, 0, 3] + [0] * (_launch._SEARCH_FANOUT if many else 0)
    cu = _cu(lengths)
    t = make_t("thd", 5, 1, h, d, dtype, gen)
    freqs = make_freqs(6, d, gen)
    g = torch.randn(t.shape, generator=gen).to(dtype).to(DEVICE)
    layout = check_static(t, freqs, "thd", None, False, cu, 1, 0, allow_float64=False)
    table = _table._build(freqs, 6, d, lambda c, s_: _launch.table_angles(c, s_, half=False))[1]
    plan = _launch.make_plan(t, layout, "thd", False, False, 1, 0, table, backward=False)
    rows_per_program, block_r = plan.arg("rows_per_program"), plan.arg("BLOCK_R")
    assert (rows_per_program > block_r) == many and (rows_per_program < h) == split
    assert plan.grid[0] == 5 * -(-h // rows_per_program)
    positions = _launch.make_plan(t, layout, "thd", False, False, 1, 0, table, backward=False, pos_table=True)
    row_bytes = d * t.element_size()
    expected = block_r * max(1, _launch._POS_TABLE_THD_BYTES // (block_r * row_bytes)) if many else block_r
    assert positions.arg("rows_per_program") == min(expected, -(-h // block_r) * block_r)
    assert positions.arg("POS_TABLE") and positions.arg("FANOUT") == 1
    out, grad, ref, ref_grad = run_both(t, freqs, g, tensor_format="thd", cu_seqlens=cu)
    assert_within_rounding(out, ref, t, d, False, "forward")
    assert_within_rounding(grad, ref_grad, g, d, False, "backward")


# thd: each program finds its token's sequence by a FANOUT-way search of cu_seqlens over several
# rounds once there are more sequences than lanes (rope.kernels._common._sequence_of). Many sequences,
# most of them empty (a run of equal entries that "largest q" must skip), with the launcher's
# fanout and with narrow ones that take many rounds; start_positions make a wrong sequence index
# visible even where two sequences would give a token the same position.
@pytest.mark.parametrize("fanout,cp,start", [
    (None, None, False), (None, None, True), (None, (2, 1), False), (2, None, True), (4, (3, 2), False),
], ids=str)
def test_thd_many_sequences(fanout, cp, start, angle_source, monkeypatch, poison_outputs):  # noqa: F811
    # angle_source: with tables on, calls without start_positions read each token's position from
    # its table (tests/rope/test_position_table.py); with them off every call searches cu_seqlens.
    from rope import _backend, _launch, _memo

    if fanout is not None:
        monkeypatch.setattr(_launch, "_SEARCH_FANOUT", fanout)
        # plans made with the launcher's fanout
        monkeypatch.setattr(_backend, "_CALLS", _memo.Memo("plans of this test", 4096))
    n_seqs = 3 * _launch._SEARCH_FANOUT + 5
    gen = torch.Generator().manual_seed(n_seqs + (cp or (1, 0))[0])
    t, freqs, g, kw = many_sequences_case(n_seqs, cp, start, torch.float32, gen)
    d = t.shape[-1]
    out, grad, ref, ref_grad = run_both(t, freqs, g, **kw)
    assert_within_rounding(out, ref, t, d, False, "forward")
    assert_within_rounding(grad, ref_grad, g, d, False, "backward")


def test_table_tile_rule(monkeypatch):
    """Tensors small enough to be in flight at once (32 bytes per resident thread) get 16-byte
    accesses, and up to 16 KB per SM (decode) tiles of up to 16 rows; larger ones 32-byte accesses and
    8-row tiles (docs/design.md)."""
    from rope import _launch

    gpu = torch.device("cuda", 0)
    limit = 132 * _launch._THREADS_PER_SM * _launch._TABLE_BYTES_PER_THREAD
    saved = dict(_launch._SM_COUNT)
    _launch._SM_COUNT[0] = 132
    try:
        tiny = 132 * _launch._TABLE_ROWS_SMALL_BYTES_PER_SM
        assert _launch._table_tile(tiny, gpu, True) == (16, 16)
        assert _launch._table_tile(tiny, gpu, False) == (16, 16)  # a token's heads (decode, thd)
        assert _launch._table_tile(tiny + 1, gpu, False) == (8, 16)
        assert _launch._table_tile(tiny + 1, gpu, True) == (8, 16)
        assert _launch._table_tile(limit, gpu, True) == (8, 16)
        assert _launch._table_tile(limit + 1, gpu, True) == (8, 32)
        # a table row per token of each sequence (transformers' [b, s, d]): 16-byte accesses, and a program takes a
        # token's q and k heads, up to 8 tiles (a row of 40: one program; of 72: 64 rows, then 8)
        assert _launch._table_tile(limit + 1, gpu, False, per_sequence=True) == (8, 16)
        assert _launch._rows_per_program(1, 40, 8, False, 2, True, True, gpu, sequence_rows=True) == 40
        assert _launch._rows_per_program(1, 72, 8, False, 2, True, True, gpu, sequence_rows=True) == 64
        assert _launch._rows_per_program(1, 40, 8, False, 2, True, True, gpu) == 8
    finally:
        _launch._SM_COUNT.clear()
        _launch._SM_COUNT.update(saved)
    # The tile that results (as on a GPU): bf16, d = 128 (row-halves of 64), 32 heads per group.
    monkeypatch.setattr(_launch, "_INTERPRETER_TILE_ROWS", 0)
    assert _launch._tile(128, 128, False, 2, 32, (16, 16))[::3] == (16, 4)  # 16 x 64 x 2 B / 16 B: 128 threads
    assert _launch._tile(128, 128, False, 2, 32, (8, 32))[::3] == (8, 1)  # 8 x 64 x 2 B / 32 B: 32 threads


def test_index_range_is_checked():
    """The kernel's program and row indices are int32: the launcher refuses what would overflow them
    (tensors that large cannot be allocated in a test, so the check is called directly)."""
    from rope import _launch

    _launch._check_index_range(2**31 - 1, 2**31 - 1)
    for programs, rows in [(2**31, 1), (1, 2**31)]:
        with pytest.raises(ValueError, match="at most 2147483647"):
            _launch._check_index_range(programs, rows)


def _divisors():
    big = [2**k + e for k in range(1, 31) for e in (-1, 0, 1) if 2**k + e < 2**31]
    gen = torch.Generator().manual_seed(31)
    return list(range(1, 300)) + big + torch.randint(1, 2**31 - 1, (200,), generator=gen).tolist()


def test_program_index_division_constants():
    """`_launch.magic`'s constants divide every int32 program index exactly (the kernel's `_divmod`, in Python):
    the dividends at each end, at multiples of d and either side of them, and at random."""
    from rope._launch import magic

    gen = torch.Generator().manual_seed(32)
    for d in _divisors():
        packed = magic(d)
        assert 2**31 <= packed < 2**63  # Triton passes it as int64 whatever d is
        m, shift = packed % 2**32, (packed >> 32) % 32
        top = (2**31 - 1) // d * d
        for n in [0, 1, d - 1, d, d + 1, 2 * d - 1, top - 1, top, 2**31 - 1,
                  *torch.randint(0, 2**31, (8,), generator=gen).tolist()]:
            if 0 <= n < 2**31:
                assert ((n * m >> 32) + n) >> shift == n // d, (n, d)
    for d in (0, 2**31):
        with pytest.raises(ValueError, match="divisor"):
            magic(d)


@triton.jit
def _divide(n_ptr, q_ptr, r_ptr, d, m, N: tl.constexpr):
    i = tl.arange(0, N)
    q, r = _common._divmod(n=tl.load(n_ptr + i), d=d, magic=m)
    tl.store(q_ptr + i, q)
    tl.store(r_ptr + i, r)


def test_program_index_division_kernel():
    """The kernel's `_divmod` on the device (or the interpreter) against Python's // and %: the unsigned
    multiply-high, the shift taken from the packed constant and the remainder."""
    from rope._launch import magic

    gen = torch.Generator().manual_seed(33)
    for d in [1, 2, 3, 7, 40, 64, 1000, 2**16 + 1, 2**30 + 3, 2**31 - 1]:
        top = (2**31 - 1) // d * d
        n = torch.tensor([0, 1, d - 1, d, top - 1, top, 2**31 - 1, *torch.randint(0, 2**31, (9,), generator=gen)],
                         dtype=torch.int32).clamp(min=0)
        q, r = torch.full_like(n, -7), torch.full_like(n, -7)
        n, q, r = (t.to(DEVICE) for t in (n, q, r))
        _divide[(1,)](n, q, r, d, magic(d), N=16)
        ref = n.long().cpu()
        assert torch.equal(q.long().cpu(), ref // d) and torch.equal(r.long().cpu(), ref % d), d


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
def test_output_strides_are_contiguous(tensor_format):
    """The output keeps x's layout (`empty_like` without a memory format, the cheaper call) only
    where x's strides are exactly a contiguous tensor's (`Plan.dense`). A size-1 dim with another
    stride (x still `is_contiguous()`) or a transposed view gets a contiguous output all the same."""
    from rope import _launch

    gen = torch.Generator().manual_seed(12)
    shape = (4, 2, 8) if tensor_format == "thd" else (4, 2, 2, 8)
    cu = _cu([1, 3]) if tensor_format == "thd" else None
    freqs = make_freqs(4, 8, gen)
    base = torch.randn(shape, generator=gen).to(DEVICE)
    swapped = torch.randn((shape[1], shape[0], *shape[2:]), generator=gen).to(DEVICE).transpose(0, 1)
    one_head = shape[:-2] + (1, 8)
    odd = torch.randn(one_head, generator=gen).to(DEVICE)
    odd = odd.as_strided(one_head, odd.stride()[:-2] + (5, 1))  # the size-1 head dim's stride is 5
    assert odd.is_contiguous()
    for x, dense in ((base, True), (swapped, False), (odd, False)):
        assert _launch._dense(x, tensor_format) is dense
        out = rope.apply_rotary_pos_emb(x, freqs, tensor_format, cu_seqlens=cu)
        assert out.stride() == torch.empty(x.shape).stride()
        torch.testing.assert_close(out, reference.apply_rotary_pos_emb(x, freqs, tensor_format, cu_seqlens=cu))


def test_functorch_transforms_refuse_cleanly():
    """Under a functorch transform autograd's Function refuses (no `setup_context`), instead of
    handing the kernel a wrapped tensor."""
    gen = torch.Generator().manual_seed(13)
    t = make_t("sbhd", 3, 2, 2, 8, torch.float32, gen)
    freqs = make_freqs(3, 8, gen)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda x: rope.apply_rotary_pos_emb(x, freqs).sum())(t)


def test_launch_hooks_are_detected(monkeypatch):
    """The direct launch skips Triton's launch hooks, so it is taken only while none is registered
    (Triton >= 3.5 keeps an always-present, usually empty, chain of them)."""
    import triton

    import rope._launch as launch

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        from triton.compiler import CompiledKernel as runtime
    assert not launch._hooks_set()
    hook = lambda *args, **kwargs: None  # noqa: E731
    chain = runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert launch._hooks_set()
        finally:
            chain.remove(hook)
        assert not launch._hooks_set()
    # A plain callable in place of either hook (older Triton's form, or code that assigns one).
    for name in ("launch_enter_hook", "launch_exit_hook"):
        with monkeypatch.context() as patched:
            patched.setattr(runtime, name, hook)
            assert launch._hooks_set()
        assert not launch._hooks_set()


@gpu_only
def test_repeated_calls_launch_directly(monkeypatch):
    """After the first call of a signature, the compiled kernel's C launcher is called directly,
    not through Triton's per-call runner (which costs several microseconds of host time)."""
    from triton.compiler import CompiledKernel

    gen = torch.Generator().manual_seed(11)
    t = make_t("sbhd", 5, 2, 3, 16, torch.float32, gen)
    freqs = make_freqs(5, 16, gen)
    first = rope.apply_rotary_pos_emb(t, freqs)

    def refuse(*args, **kwargs):
        raise AssertionError("went through Triton's runner")

    monkeypatch.setattr(CompiledKernel, "__getitem__", refuse)
    assert torch.equal(rope.apply_rotary_pos_emb(t, freqs), first)
