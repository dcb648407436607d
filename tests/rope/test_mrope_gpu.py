"""Multimodal RoPE on the GPU: CUDA-graph replay with positions and tables changed in place, and tensors of
more than 2**31 elements (64-bit offsets)."""
from __future__ import annotations

import pytest
import torch

import rope

from .cases import DEVICE, gpu_only
from .test_conventions_graphs import _capture
from .test_mrope import vllm_definition

pytestmark = gpu_only


def _r(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)


def test_mrope_graphs_follow_positions_and_tables_changed_in_place():
    gen = torch.Generator().manual_seed(21)
    sections = [16, 24, 24]
    # packed training call: positions [3, T] and a RoPECache
    n, hq, hk, d = 53, 4, 2, 128
    q, k = _r(n, hq, d, gen=gen, dtype=torch.bfloat16), _r(n, hk, d, gen=gen, dtype=torch.bfloat16)
    positions = torch.zeros(3, n, dtype=torch.int64, device=DEVICE)
    freqs = (torch.rand(200, 1, 1, d, generator=gen) * 20).to(DEVICE)
    cache = rope.RoPECache.from_freqs(freqs)
    # transformers: per-stream cos/sin [3, b, s, d]
    b, s = 2, 9
    hq_in, hk_in = _r(b, hq, s, d, gen=gen), _r(b, 1, s, d, gen=gen)
    cos, sin = torch.empty(3, b, s, d, device=DEVICE), torch.empty(3, b, s, d, device=DEVICE)
    # vLLM: in place on copies made inside the graph
    vq, vk = _r(n, hq * 64, gen=gen, dtype=torch.float16), _r(n, hk * 64, gen=gen, dtype=torch.float16)
    vpos = torch.zeros(3, n, dtype=torch.int64, device=DEVICE)
    vcache = torch.empty(100, 48, device=DEVICE)

    def refill():
        positions.copy_(torch.randint(0, 200, (3, n), generator=gen))
        cache.update_((torch.rand(200, 1, 1, d, generator=gen) * 20).to(DEVICE))
        th = torch.rand(3, b, s, d // 2, generator=gen) * 20
        cos.copy_(torch.cat([th.cos(), th.cos()], -1))
        sin.copy_(torch.cat([th.sin(), th.sin()], -1))
        vpos.copy_(torch.randint(0, 100, (3, n), generator=gen))
        tv = torch.rand(100, 24, generator=gen) * 20
        vcache.copy_(torch.cat([tv.cos(), tv.sin()], -1))

    def step():
        packed = rope.mrope.apply_multimodal_rotary_pos_emb_qk(q, k, cache, positions, sections)
        hf = rope.hf.apply_multimodal_rotary_pos_emb(hq_in, hk_in, cos, sin, sections)
        xq, xk = vq.clone(), vk.clone()
        rope.vllm.mrotary_embedding(vpos, xq, xk, 64, vcache, [8, 8, 8], True)
        return (*packed, *hf, xq, xk)

    refill()
    graph, outs = _capture(step)
    for _ in range(3):
        refill()
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for got, want in zip(outs, eager, strict=True):
            assert torch.equal(got, want)
        want_q = vllm_definition(vpos, vq, hq, 64, vcache, [8, 8, 8], True, False)
        assert (outs[4].view(n, hq, 64).double() - want_q).abs().max() < 2**-9  # fp16: within a few roundings


@pytest.mark.parametrize("entry", ["packed", "vllm"])
def test_mrope_beyond_2_31_elements(entry):
    """q of 28 heads x 128 channels over enough tokens for more than 2**31 elements: the last tokens, the first
    and a sample between are rotated as the reference rotates them (offsets past 2**31 stay exact)."""
    heads, d, sections = 28, 128, [16, 24, 24]
    n = 2**31 // (heads * d) + 97
    free = torch.cuda.mem_get_info()[0]
    if free < 24 * 2**30:
        pytest.skip(f"needs 24 GiB of free GPU memory, has {free / 2**30:.1f}")
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q = torch.randn(n, heads, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    assert q.numel() > 2**31
    positions = torch.randint(0, 4096, (3, n), device=DEVICE, generator=gen)
    freqs = rope.RotaryPositionEmbedding(d, device=DEVICE)(4096)
    rows = torch.cat([torch.arange(64), torch.randint(0, n, (256,), generator=torch.Generator().manual_seed(0)),
                      torch.arange(n - 256, n)]).to(DEVICE)
    if entry == "packed":
        q.requires_grad_()
        out = rope.mrope.apply_multimodal_rotary_pos_emb(q, freqs, positions, sections)
        g = torch.randn(out.shape, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        out.backward(g)
        sample = q.detach()[rows].double().requires_grad_()
        want = rope.reference.apply_multimodal_rotary_pos_emb(sample, freqs.double(), positions[:, rows], sections)
        want.backward(g[rows].double())
        got, got_grad, want_grad = out[rows], q.grad[rows], sample.grad
        del out, g, q
    else:
        cos_sin = torch.cat([freqs[:, 0, 0, :d // 2].cos(), freqs[:, 0, 0, :d // 2].sin()], -1)
        before = q[rows].double()
        rope.vllm.mrotary_embedding(positions, q.view(n, heads * d), None, d, cos_sin, sections)
        got, got_grad = q[rows], None
        want = rope.reference.apply_multimodal_rotary_pos_emb(before, freqs.double(), positions[:, rows], sections)
    # bf16 output: one rounding (2^-8 relative) plus the float32 evaluation, on N(0, 1) values below 6
    torch.testing.assert_close(got.double(), want.detach(), rtol=2**-7, atol=2**-7)
    if got_grad is not None:
        torch.testing.assert_close(got_grad.double(), want_grad, rtol=2**-7, atol=2**-7)
