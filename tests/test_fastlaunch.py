"""The lean C launch (`rope._fastlaunch`): its build, its parameter block, and on a GPU its use.

The parameter block must describe the compiled kernel exactly (a wrong size or order would pass
garbage to the kernel), so `slots` refuses anything it cannot match, and the GPU tests check
that repeated calls take the lean path and give the same bits as Triton's launcher.
"""
import struct

import pytest
import torch

import rope
from rope import _fastlaunch

from .cases import gpu_only, make_freqs, make_t

pytestmark = pytest.mark.ours_only


def test_module_builds_and_loads(tmp_path, monkeypatch):
    """The C source compiles with this machine's compiler and Python headers, and loads without a
    GPU (the driver is opened by init(), not at import)."""
    if _fastlaunch._compiler() is None:
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("ROPE_CACHE_DIR", str(tmp_path))
    path = _fastlaunch.build()
    assert path.startswith(str(tmp_path)) and _fastlaunch.build() == path  # cached: built once
    mod = _fastlaunch.load(path)  # a fresh copy of the module: its driver entry points are unset
    with pytest.raises(RuntimeError, match="init"):  # before init() it refuses, never crashes
        mod.launch(0, 1, 32, 0, 0, bytes(8))
    with pytest.raises(RuntimeError, match="init"):
        mod.param_sizes(0)


def test_slots_pack_each_parameter_at_its_size():
    types = ["*bf16", "*fp32", "i32", "i32", "i64"]
    sizes = [8, 8, 4, 4, 8, 8, 8]  # two trailing scratch pointers, as Triton 3.6 adds
    block = _fastlaunch.slots(types, sizes, 2, [0, 0, 5, -1, -(2**40)])
    values = struct.unpack("<7Q", block)
    assert values == (0, 0, 5, 0xFFFFFFFF, (-(2**40)) & (2**64 - 1), 0, 0)


@pytest.mark.parametrize("types, sizes, n_pointers, values", [
    (["*bf16", "i32"], [8, 8], 1, [0, 3]),  # the driver says 8 bytes where Triton compiled an i32
    (["*bf16", "i32"], [8], 1, [0, 3]),  # fewer parameters than arguments
    (["*bf16", "i32"], [8, 4, 8, 8, 8], 1, [0, 3]),  # more than two trailing extras
    (["*bf16", "i32"], [8, 4, 4], 1, [0, 3]),  # a trailing extra that is not a pointer
    (["i32", "*bf16"], [4, 8], 1, [3, 0]),  # pointers are not the leading arguments
    (["*bf16", "fp32"], [8, 4], 1, [0, 1.5]),  # a float argument (none of ours has one)
    (["*bf16", "i16"], [8, 2], 1, [0, 3]),  # a type the block has no rule for
    (["*bf16", "i32"], [8, 4], 1, [0]),  # a value missing
])
def test_slots_refuse_what_they_cannot_describe(types, sizes, n_pointers, values):
    assert _fastlaunch.slots(types, sizes, n_pointers, values) is None


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setattr(_fastlaunch, "_STATE", {})
    monkeypatch.setenv("ROPE_FAST_LAUNCH", "0")
    assert _fastlaunch.module() is None
    assert "ROPE_FAST_LAUNCH=0" in _fastlaunch.reason()


def _plans():
    from rope import functional
    return [p for call in functional._CALLS.values() for p in call.plans.values()]


@gpu_only
def test_repeated_calls_take_the_lean_launch(monkeypatch):
    """On a GPU the plan gets a parameter block after its first launch, and later calls (forward
    and backward, the latter on autograd's own thread) go through it, never through Triton's
    launcher, with the same bits."""
    from rope import functional

    assert _fastlaunch.module() is not None, _fastlaunch.reason()
    monkeypatch.setattr(functional, "_CALLS", {})
    gen = torch.Generator().manual_seed(5)
    t = make_t("bshd", 7, 3, 5, 80, torch.bfloat16, gen).requires_grad_()
    freqs = make_freqs(7, 48, gen)
    g = torch.randn(t.shape, generator=gen).to(t)
    first = rope_call(t, freqs, g)
    assert _plans() and all(p.fast is not None for p in _plans())

    def refuse(*args, **kwargs):
        raise AssertionError("went through Triton's launcher")

    for plan in _plans():
        monkeypatch.setattr(plan, "compiled", _Refusing(plan.compiled, refuse))
    again = rope_call(t, freqs, g)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    # The same calls through Triton's launcher give the same bits.
    for plan in _plans():
        monkeypatch.setattr(plan, "fast", None)
        monkeypatch.setattr(plan, "compiled", plan.compiled.inner)
    third = rope_call(t, freqs, g)
    assert all(torch.equal(a, b) for a, b in zip(first, third, strict=True))


def rope_call(t, freqs, g):
    out = rope.apply_rotary_pos_emb(t, freqs, tensor_format="bshd")
    (grad,) = torch.autograd.grad(out, t, g)
    return out.detach().clone(), grad


class _Refusing:
    """A compiled kernel whose launcher refuses to run (the lean path must not need it)."""

    def __init__(self, inner, refuse):
        self.inner = inner
        self.run = refuse
        self.function = inner.function
        self.packed_metadata = inner.packed_metadata

    def __getitem__(self, grid):
        raise AssertionError("went through Triton's runner")


@gpu_only
def test_without_the_module_triton_launches(monkeypatch):
    """Where the C module is unavailable, plans get no parameter block and calls stay correct."""
    from rope import functional

    monkeypatch.setattr(_fastlaunch, "_STATE", {"module": None, "reason": "test"})
    monkeypatch.setattr(functional, "_CALLS", {})
    gen = torch.Generator().manual_seed(6)
    t = make_t("sbhd", 9, 2, 3, 64, torch.float32, gen)
    freqs = make_freqs(9, 64, gen)
    a = rope.apply_rotary_pos_emb(t, freqs)
    b = rope.apply_rotary_pos_emb(t, freqs)
    assert all(p.fast is None for p in _plans())
    assert torch.equal(a, b)
