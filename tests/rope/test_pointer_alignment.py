"""Index tensors of any dtype and 16-byte alignment (GPU): Triton compiles a kernel for each pointer's dtype and
whether it is 16-byte aligned, and the launcher reuses a compiled kernel per call signature. The same call with
aligned positions, then positions sliced one element in (8 bytes for int64, 4 for int32), in int32 and int64 one
after the other in one process, must each give the reference path's result."""
from __future__ import annotations

import pytest
import torch

import rope
import rope.flash
import rope.mrope
import rope.vllm

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

DEV = "cuda"


def shifted(x: torch.Tensor) -> torch.Tensor:
    """x's values in a view one element into a larger buffer (its data pointer 16-byte misaligned)."""
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    view = buf[1:].view(x.shape)
    view.copy_(x)
    assert view.data_ptr() % 16 != 0
    return view


def on(x, cpu):
    return x.cpu() if cpu else x


def both(call):
    """call(aligned) then call(shifted) (cached kernel first), synchronized: equal to each other and to the
    reference path's result on CPU copies (within bfloat16's rounding: the reference rounds differently)."""
    aligned = call(lambda v: v)
    got = call(shifted)
    torch.cuda.synchronize()
    ref = call(lambda v: v.cpu(), cpu=True).to(DEV)
    for what, x in (("aligned", aligned), ("shifted", got)):
        bad = ~torch.isclose(x.float(), ref.float(), rtol=2**-7, atol=2**-7)
        assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} elements off the reference"
    assert torch.equal(got, aligned)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_start_positions(dtype):
    t = torch.randn(64, 4, 8, 128, device=DEV, dtype=torch.bfloat16)
    freqs = torch.rand(256, 1, 1, 128, device=DEV)
    start = torch.randint(0, 100, (4,), device=DEV, dtype=dtype)
    both(lambda f, cpu=False: rope.apply_rotary_pos_emb(on(t, cpu), on(freqs, cpu), "sbhd", start_positions=f(start)))


def test_cu_seqlens():
    t = torch.randn(300, 8, 128, device=DEV, dtype=torch.bfloat16)
    freqs = torch.rand(256, 1, 1, 128, device=DEV)
    cu = torch.tensor([0, 7, 100, 250, 300], device=DEV, dtype=torch.int32)
    both(lambda f, cpu=False: rope.apply_rotary_pos_emb(on(t, cpu), on(freqs, cpu), "thd", cu_seqlens=f(cu)))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_mrope_positions(dtype):
    t = torch.randn(512, 8, 128, device=DEV, dtype=torch.bfloat16)
    freqs = torch.rand(600, 1, 1, 128, device=DEV)
    positions = torch.randint(0, 600, (3, 512), device=DEV, dtype=dtype)
    both(lambda f, cpu=False: rope.mrope.apply_multimodal_rotary_pos_emb(on(t, cpu), on(freqs, cpu), f(positions),
                                                                         [22, 21, 21]))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_vllm_positions(dtype):
    q = torch.randn(512, 8 * 128, device=DEV, dtype=torch.bfloat16)
    cache = torch.randn(600, 128, device=DEV, dtype=torch.bfloat16)
    positions = torch.randint(0, 600, (512,), device=DEV, dtype=dtype)

    def call(f, cpu=False):
        out = on(q, cpu).clone()
        rope.vllm.rotary_embedding(f(positions), out, None, 128, on(cache, cpu), True)
        return out

    both(call)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_flash_offsets(dtype):
    x = torch.randn(4, 64, 8, 128, device=DEV, dtype=torch.bfloat16)
    cos, sin = torch.randn(200, 64, device=DEV, dtype=torch.bfloat16), torch.randn(200, 64, device=DEV,
                                                                                    dtype=torch.bfloat16)
    offsets = torch.randint(0, 100, (4,), device=DEV, dtype=dtype)
    both(lambda f, cpu=False: rope.flash.apply_rotary_emb(on(x, cpu), on(cos, cpu), on(sin, cpu),
                                                          seqlen_offsets=f(offsets)))
