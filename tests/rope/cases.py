"""Building blocks of rope's own tests: devices, random inputs, the float64 reference run, and the plain conventions'
float64 definitions."""
from __future__ import annotations

import contextlib
import itertools
from unittest import mock

import pytest
import torch
from hypothesis import strategies as st

import rope
import rope._backend
import rope._launch
from tests.conformance import te_oracle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


@contextlib.contextmanager
def reference_path(on: bool):
    """Within it (on), every entry point takes its CPU reference path, as without Triton's interpreter. On a GPU
    there is one path, the kernel's: both runs take it."""
    if not on or DEVICE != "cpu":
        yield
        return
    with mock.patch.object(rope._backend, "INTERPRET", False):
        yield
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


def make_t(tensor_format, s, b, h, d, dtype, gen, layout="contiguous", device=DEVICE):
    """Random t of the format's shape, in the requested memory layout (values N(0, 1))."""
    shape = {"sbhd": (s, b, h, d), "bshd": (b, s, h, d), "thd": (s, h, d)}[tensor_format]

    def rand(size):
        return torch.randn(size, generator=gen, dtype=torch.float32).to(dtype).to(device)

    if layout == "contiguous":
        return rand(shape)
    if layout == "transposed":  # memory of the other format: (0, 1) swapped
        return rand((shape[1], shape[0]) + shape[2:]).transpose(0, 1)
    if layout == "strided_last":  # last-dim stride 2
        return rand(shape[:-1] + (2 * d,))[..., ::2]
    if layout == "sliced":  # a slice of a wider last dim, e.g. q out of a fused qkv projection
        return rand(shape[:-1] + (d + 24,))[..., 8:8 + d]
    raise ValueError(layout)


def cu_seqlens_of(lengths, device=DEVICE):
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=device)


def many_sequence_lengths(n_seqs, cp_size, gen):
    """Global lengths of a packed batch of many sequences, divisible by 2 * cp_size under context
    parallelism; about 60 % empty, including runs of empty sequences at both ends (entries of
    cu_seqlens that repeat, which the search for a token's sequence must skip)."""
    unit = 2 * cp_size if cp_size > 1 else 1
    units = torch.randint(1, 3, (n_seqs,), generator=gen) * (torch.rand(n_seqs, generator=gen) < 0.4)
    units[:2] = 0
    units[-2:] = 0
    return (units * unit).tolist()


def many_sequences_case(n_seqs, cp, start, dtype, gen, h=2, d=8):
    """(t, freqs, upstream gradient, keyword arguments) of a thd call over `many_sequence_lengths`;
    cp: None or (cp_size, cp_rank); start: whether to pass start_positions."""
    cp_size = cp[0] if cp else 1
    lengths = many_sequence_lengths(n_seqs, cp_size, gen)
    kw = dict(tensor_format="thd", cu_seqlens=cu_seqlens_of(lengths))
    if cp:
        kw.update(cp_size=cp_size, cp_rank=cp[1])
    if start:
        kw["start_positions"] = torch.randint(0, 16, (n_seqs,), generator=gen).to(DEVICE)
    t = make_t("thd", sum(lengths) // cp_size, 1, h, d, dtype, gen)
    freqs = make_freqs(max(lengths) + 16, d, gen)
    g = torch.randn(t.shape, generator=gen).to(dtype).to(DEVICE)
    return t, freqs, g, kw


def make_freqs(s2, d2, gen, max_angle=10.0, device=DEVICE):
    """Random float32 angles whose two halves differ: the contract is elementwise."""
    f = torch.rand((s2, 1, 1, d2), generator=gen, dtype=torch.float64) * max_angle
    return f.float().to(device)


def run_both(t, freqs, g, **kw):
    """(out, grad) from rope and (ref, ref_grad) from the float64 reference, for upstream grad g."""
    x = t.detach().clone().requires_grad_()
    out = rope.apply_rotary_pos_emb(x, freqs, **kw)
    out.backward(g)
    x64 = t.detach().double().requires_grad_()
    ref = te_oracle.apply_rotary_pos_emb(x64, freqs, **kw)
    ref.backward(g.double())
    return out, x.grad, ref, x64.grad


@pytest.fixture
def poison_outputs():
    """Every tensor the launcher allocates starts as NaN: an unwritten element cannot pass."""
    with rope._launch.nan_outputs():
        yield


@pytest.fixture
def gpu_decomposition(monkeypatch):
    """The launcher splits work as on a GPU, also under the interpreter (which otherwise takes a
    group's rows in one tile: rope._launch._INTERPRETER_TILE_ROWS), with the table kernel's tiles
    for large tensors (8 rows) also for the small ones of tests, so that groups span programs."""
    monkeypatch.setattr(rope._launch, "_INTERPRETER_TILE_ROWS", 0)
    monkeypatch.setattr(rope._launch, "_TABLE_ROWS_SMALL", rope._launch._TABLE_ROWS)
    # no plan made with the interpreter's tiles
    monkeypatch.setattr(rope._backend, "_CALLS", rope._memo.Memo("plans of this test", 4096))


@pytest.fixture(params=["table", "evaluated"])
def angle_source(request):
    """Both ways the kernel gets cos/sin: read from the table cached per `freqs` (the default), and
    evaluated by the kernel itself (CUDA graph capture, inference tensors, tables switched off)."""
    rope.set_angle_table(request.param == "table")
    try:
        yield request.param
    finally:
        rope.set_angle_table(True)


def needs_angle_source(angle_source, interleaved: bool):
    """Skip the table run of a case that never reads a table (rope._launch.angles_for: half-split only): it
    would repeat the evaluated run exactly."""
    if angle_source == "table" and interleaved:
        pytest.skip("no cos/sin table for this case: the evaluated run covers it")


def run_case(impl, case, t_base=None, freqs=None, g=None, backward=True, **kw):
    """(out, grad_t) of `impl` on a case; the input keeps the case's memory layout.

    A fresh leaf is cloned from `t_base` (default: the case's) and viewed like the case's input,
    so the callable sees the same strides; the gradient is taken with respect to that view.
    """
    base = (case.t_base if t_base is None else t_base).detach().clone().requires_grad_(backward)
    x = case.view(base)
    out = impl(x, case.freqs if freqs is None else freqs, **case.kwargs(**kw))
    if not backward:
        return out, None
    (grad,) = torch.autograd.grad(out, x, case.g if g is None else g)
    return out, grad


def run_plain(impl, t, freqs, g=None, **kw):
    """(out, grad_t) of `impl` on a copy of `t` (dense layouts are kept by clone)."""
    x = t.detach().clone().requires_grad_(g is not None)
    out = impl(x, freqs, **kw)
    if g is None:
        return out, None
    (grad,) = torch.autograd.grad(out, x, g)
    return out, grad


def reference64(t, freqs, g, **kw):
    """(out, grad_t) of the float64 oracle (tests/conformance/te_oracle.py) on t.double() with the same angles."""
    x = t.detach().double().requires_grad_()
    ref = te_oracle.apply_rotary_pos_emb(x, freqs, **kw)
    (grad,) = torch.autograd.grad(ref, x, g.detach().double())
    return ref.detach(), grad


# ---- the plain conventions' definitions, in float64, and their inputs ----------------------------------------

def head_dim(data, label="head dim"):
    """Any even width under the interpreter; on a GPU, where every width is a new compilation, those of models."""
    if DEVICE == "cuda":
        return data.draw(st.sampled_from((64, 80, 128)), label=label)
    return 2 * data.draw(st.integers(1, 12), label=label + "/2")


def rotary_width(data, d, label="rotary width"):
    if DEVICE == "cuda":
        return data.draw(st.sampled_from((d, d // 2)), label=label)
    return 2 * data.draw(st.integers(1, d // 2), label=label + "/2")


def oracle(x, cos, sin, interleaved):
    """Float64 rotation of x[..., :d2] by per-channel cos/sin (broadcast to it; d2 = their last size), from the
    pair definitions: half-split pairs (i, i + d2/2), interleaved pairs (2i, 2i + 1)."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    d2 = cos.shape[-1]
    out = x.clone()
    if interleaved:
        a, b = x[..., 0:d2:2], x[..., 1:d2:2]
        out[..., 0:d2:2] = a * cos[..., 0::2] - b * sin[..., 0::2]
        out[..., 1:d2:2] = b * cos[..., 1::2] + a * sin[..., 1::2]
    else:
        h = d2 // 2
        a, b = x[..., :h], x[..., h:d2]
        out[..., :h] = a * cos[..., :h] - b * sin[..., :h]
        out[..., h:d2] = b * cos[..., h:] + a * sin[..., h:]
    return out


def oracle_grad(g, cos, sin, interleaved):
    """The adjoint of `oracle` applied to g (autograd through it, float64)."""
    x = torch.zeros(g.shape, dtype=torch.float64, device=g.device, requires_grad=True)
    oracle(x, cos, sin, interleaved).backward(g.double())
    return x.grad


def per_pair(half, interleaved):
    """One column per pair -> one per channel."""
    return half.repeat_interleave(2, -1) if interleaved else torch.cat([half, half], -1)


def randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def angles_table(rows, cols, dtype, gen):
    theta = torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 20 - 10
    return theta.cos().to(dtype).to(DEVICE), theta.sin().to(dtype).to(DEVICE)
