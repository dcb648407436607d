"""The cos/sin table cached per `freqs` tensor (rope._table): reused exactly while it describes
`freqs`, never stale, never used where it could not follow `freqs`, and equal to the kernel's own
evaluation of sin/cos."""
from __future__ import annotations

import gc

import pytest
import torch

import rope
import rope._table as table_mod
from rope import reference

from .cases import DEVICE, ON_GPU, gpu_only, make_freqs, make_t, run_both
from .numerics import assert_within_rounding


@pytest.fixture
def builds(monkeypatch):
    """Count the tables built (each is a cos and a sin over all of `freqs`)."""
    made = []
    real = table_mod._build
    monkeypatch.setattr(table_mod, "_build", lambda *a: (made.append(a[0].shape), real(*a))[1])
    table_mod._TABLES.clear()
    yield made
    table_mod._TABLES.clear()


def _case(seed, s=6, b=2, h=3, d=16, d2=12, dtype=torch.float32, tensor_format="sbhd"):
    gen = torch.Generator().manual_seed(seed)
    t = make_t(tensor_format, s, b, h, d, dtype, gen)
    freqs = make_freqs(s + 2, d2, gen)
    g = torch.randn(t.shape, generator=gen).to(dtype).to(DEVICE)
    return t, freqs, g, gen


# thd cases of `_case` (s=6 tokens): three sequences, one of them empty.
_THD_CU = torch.tensor([0, 2, 2, 6], dtype=torch.int32, device=DEVICE)


def _check(t, freqs, g, **kw):
    out, grad, ref, ref_grad = run_both(t, freqs, g, **kw)
    d2 = freqs.shape[-1]
    assert_within_rounding(out, ref, t, d2, kw.get("interleaved", False), "forward")
    assert_within_rounding(grad, ref_grad, g, d2, kw.get("interleaved", False), "backward")
    return out


def test_one_table_per_freqs_tensor(builds):
    t, freqs, g, gen = _case(1)
    for _ in range(3):  # every layer of a step: forward and backward read the same table
        _check(t, freqs, g)
    rope.apply_rotary_pos_emb_qk(t, t.clone(), freqs)
    assert len(builds) == 1
    half = freqs.to(torch.bfloat16)  # keyed by the tensor passed, not by its float32 copy
    for _ in range(2):
        _check(t, half, g)
    assert len(builds) == 2


def test_in_place_write_to_freqs_rebuilds(builds):
    t, freqs, g, gen = _case(2)
    _check(t, freqs, g)
    freqs[1:4] += torch.rand(freqs[1:4].shape, generator=gen).to(DEVICE) + 0.5  # PyTorch bumps the version
    _check(t, freqs, g)  # a stale table would rotate rows 1-3 by the old angles
    assert len(builds) == 2
    freqs.data = make_freqs(freqs.shape[0], freqs.shape[-1], gen)  # new storage, same object
    _check(t, freqs, g)
    assert len(builds) == 3


def test_table_never_matches_another_tensor(builds):
    """Entries are keyed by id(freqs); a new tensor that reuses a freed one's id must not get its
    table, even at the same address and version (PyTorch's allocator reuses both)."""
    t, first, g, gen = _case(3)
    _check(t, first, g)
    twin = first.detach()  # another tensor object: same address, same version counter
    assert twin.data_ptr() == first.data_ptr() and twin._version == first._version
    table_mod._TABLES[id(twin)] = table_mod._TABLES.pop(id(first))  # as if `first` had died
    _check(t, twin, g)
    assert len(builds) == 2
    other = make_freqs(first.shape[0], first.shape[-1], gen)  # and new values at another address
    table_mod._TABLES[id(other)] = table_mod._TABLES.pop(id(twin))
    _check(t, other, g)
    assert len(builds) == 3


def test_table_is_freed_with_its_freqs(builds):
    t, freqs, g, gen = _case(4)
    _check(t, freqs, g)
    key = id(freqs)
    assert key in table_mod._TABLES
    del freqs
    gc.collect()
    assert key not in table_mod._TABLES


def test_no_table_for_inference_tensors_or_when_off(builds):
    t, freqs, g, gen = _case(5)
    with torch.inference_mode():  # no version counter: a table could not notice writes
        frozen = freqs.clone()
        out = rope.apply_rotary_pos_emb(t, frozen)
    assert_within_rounding(out, reference.apply_rotary_pos_emb(t.double(), frozen), t, 12, False, "forward")
    rope.set_angle_table(False)
    try:
        _check(t, freqs, g)
    finally:
        rope.set_angle_table(True)
    assert builds == [] and not table_mod._TABLES


@pytest.mark.parametrize("kw", [dict(tensor_format="sbhd"), dict(tensor_format="bshd", cp_size=2, cp_rank=1),
                                dict(tensor_format="thd", cp_size=2, cp_rank=0)], ids=["sbhd", "bshd-cp", "thd-cp"])
@pytest.mark.parametrize("d2", [32, 12], ids=["full", "partial"])
def test_table_equals_evaluated(kw, d2, builds):
    """Both paths rotate by float32 cos/sin of the same angles. On a GPU both are CUDA's cosf/sinf
    and the rotation is the same code, so the results are bitwise equal. The interpreter evaluates
    with numpy, the table with PyTorch's CPU functions: each within 1-2 float32 ulp of the exact
    value, so the outputs agree to that relative error times the rotated values (float32 default
    tolerances cover it)."""
    t, freqs, g, gen = _case(6, s=8, h=5, d=40, d2=d2, tensor_format=kw["tensor_format"])
    freqs = make_freqs(16, d2, gen)  # cp_size 2: positions up to 2 * s
    if kw["tensor_format"] == "thd":  # 8 local tokens of 16: lengths divisible by 2 * cp_size
        kw = dict(kw, cu_seqlens=torch.tensor([0, 4, 4, 16], dtype=torch.int32, device=DEVICE))
    results = []
    for enabled in (True, False):
        rope.set_angle_table(enabled)
        try:
            x = t.clone().requires_grad_()
            out = rope.apply_rotary_pos_emb(x, freqs, **kw)
            out.backward(g)
            results.append((out, x.grad))
        finally:
            rope.set_angle_table(True)
    assert len(builds) == 1  # the first pass did read a table
    (out_t, grad_t), (out_e, grad_e) = results
    if ON_GPU:
        assert torch.equal(out_t, out_e) and torch.equal(grad_t, grad_e)
    else:
        torch.testing.assert_close(out_t, out_e)
        torch.testing.assert_close(grad_t, grad_e)


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
def test_start_positions_read_the_table(tensor_format, builds):
    """Per-sequence positions read the table too: each (s, b) pair's row of it, or each packed
    token's (thd: the row of its position in its sequence plus the sequence's start)."""
    t, freqs, g, gen = _case(10, tensor_format=tensor_format)
    kw = dict(tensor_format=tensor_format)
    if tensor_format == "thd":
        kw["cu_seqlens"] = _THD_CU
    start = torch.tensor([0, 2, 1][:2 if tensor_format != "thd" else 3], device=DEVICE)
    _check(t, freqs, g, start_positions=start, **kw)
    assert len(builds) == 1


@pytest.mark.parametrize("tensor_format", ["sbhd", "thd"])
def test_no_table_for_interleaved(tensor_format, builds):
    """Interleaved evaluates sin/cos in the kernel: its tile splits even and odd channels in
    registers, and a table tile for it measured no faster (docs/design.md)."""
    t, freqs, g, gen = _case(9, tensor_format=tensor_format)
    kw = dict(tensor_format=tensor_format, interleaved=True)
    if tensor_format == "thd":
        kw["cu_seqlens"] = _THD_CU
    _check(t, freqs, g, **kw)
    assert builds == []


@gpu_only
def test_graph_capture_follows_freqs(builds):
    """A captured graph must read `freqs` as it is at each replay: a table built before the capture
    would freeze the angles, so capture evaluates sin/cos in the kernel."""
    t, freqs, g, gen = _case(7, s=32, b=2, h=4, d=64, d2=64)
    stream = torch.cuda.Stream()  # warm-up (compiles the evaluating kernel) on a side stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        rope.set_angle_table(False)
        try:
            rope.apply_rotary_pos_emb(t, freqs)
        finally:
            rope.set_angle_table(True)
    torch.cuda.current_stream().wait_stream(stream)
    rope.apply_rotary_pos_emb(t, freqs)  # eager: builds the table for `freqs`
    assert len(builds) == 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope.apply_rotary_pos_emb(t, freqs)
    new = make_freqs(freqs.shape[0], freqs.shape[-1], gen)
    freqs.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert_within_rounding(out, reference.apply_rotary_pos_emb(t.double(), new), t, 64, False, "forward")
    assert len(builds) == 1
