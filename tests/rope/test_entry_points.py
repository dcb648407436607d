"""rope's entry points in the conventions of transformers (`rope.hf`), flash-attention (`rope.flash`), vLLM
(`rope.vllm`), TE's packed QKV and `rope.RoPECache`, beyond what the native suite (tests/conformance) certifies of
each: where two of them meet (transformers' tables from `freqs`, a RoPECache in place of `freqs`), they agree; a
cache update is seen by the next call; cos and sin read through their own strides; the kernel is launched exactly
where it runs; the embedding's rotary width rules; flash-attention's in-place backward and empty varlen batch.
Outputs are poisoned with NaN first where the launcher allocates them, so every element must be written.
"""
from __future__ import annotations

import pytest
import torch

import rope

from .cases import DEVICE, angles_table, oracle, oracle_grad, per_pair, poison_outputs, randn  # noqa: F401
from .numerics import assert_within_rounding

# ---------------------------------------------------------------------------------------------- transformers

def test_hf_meets_the_freqs_path(poison_outputs):  # noqa: F811
    """transformers' tables made from `freqs` (equal halves) give the `freqs` path's result, and a `RoPECache`
    of the same tables gives it bitwise (the same table values, the same arithmetic)."""
    gen = torch.Generator().manual_seed(5)
    b, s, h, d = 2, 7, 3, 16
    theta = torch.rand(s, d // 2, generator=gen) * 8
    freqs = torch.cat([theta, theta], -1).view(s, 1, 1, d).to(DEVICE)
    q, k = randn((b, s, h, d), torch.float32, gen), randn((b, s, 2, d), torch.float32, gen)
    cos, sin = freqs[:, 0, 0].cos()[None], freqs[:, 0, 0].sin()[None]
    qo, ko = rope.hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    cache = rope.RoPECache(cos[0], sin[0])
    qc, kc = rope.apply_rotary_pos_emb_qk(q, k, cache, tensor_format="bshd")
    assert torch.equal(qo, qc) and torch.equal(ko, kc)
    qf = rope.apply_rotary_pos_emb(q, freqs, tensor_format="bshd")
    assert_within_rounding(qf, oracle(q, cos[0][:, None], sin[0][:, None], False), q, d, False, "freqs path")
    torch.testing.assert_close(qo, qf, rtol=2**-21, atol=2**-21)  # two float32 evaluations of one map


# ---------------------------------------------------------------------------------------------- flash-attention

def test_flash_inplace_backward(poison_outputs):  # noqa: F811
    """inplace=True records the rotation for autograd: the gradient reaches the leaf before it."""
    gen = torch.Generator().manual_seed(3)
    x = randn((2, 5, 3, 16), torch.float32, gen)
    cos, sin = angles_table(5, 6, torch.float32, gen)
    leaf = x.clone().requires_grad_()
    out = rope.flash.apply_rotary_emb(leaf * 1, cos, sin, inplace=True)
    g = randn(out.shape, torch.float32, gen)
    out.backward(g)
    cf, sf = per_pair(cos, False)[:, None], per_pair(sin, False)[:, None]
    assert_within_rounding(leaf.grad, oracle_grad(g, cf, sf, False), g, 12, False, "backward")


# ---------------------------------------------------------------------------------------------- TE packed QKV

@pytest.mark.parametrize("tensor_format,nq,interleaved", [("sbhd", 8, False), ("bshd", 16, True), ("sbhd", 4, True)])
def test_fused_qkv_matches_split_calls(tensor_format, nq, interleaved, poison_outputs):  # noqa: F811
    """TE's packed QKV: q's part of each head is nq / nk heads of width nk, rotated by q_freqs; k by k_freqs;
    v copied; the gradient of the three reaches qkv."""
    gen = torch.Generator().manual_seed(nq)
    s, b, h, nk, nv = 5, 2, 3, 4, 6
    shape = (s, b, h, nq + nk + nv) if tensor_format == "sbhd" else (b, s, h, nq + nk + nv)
    qkv = randn(shape, torch.float32, gen).requires_grad_()
    qf = (torch.rand(s + 1, 1, 1, nk, generator=gen) * 9).to(DEVICE)
    kf = (torch.rand(s + 2, 1, 1, nk, generator=gen) * 9).to(DEVICE)
    q, k, v = rope.apply_fused_qkv_rotary_pos_emb(qkv, qf, kf, [nq, nk, nv], tensor_format=tensor_format,
                                                  interleaved=interleaved)
    q_in = qkv.detach()[..., :nq].reshape(*shape[:2], h * nq // nk, nk)
    k_in = qkv.detach()[..., nq:nq + nk]
    for name, out, x, f in (("q", q, q_in, qf), ("k", k, k_in, kf)):
        want = rope.reference.apply_rotary_pos_emb(x.double(), f, tensor_format, interleaved=interleaved)
        assert_within_rounding(out, want, x, nk, interleaved, name)
    assert torch.equal(v, qkv.detach()[..., nq + nk:])
    gs = [randn(o.shape, torch.float32, gen) for o in (q, k, v)]
    torch.autograd.backward((q, k, v), gs)
    x64 = qkv.detach().double().requires_grad_()
    q64 = rope.reference.apply_rotary_pos_emb(x64[..., :nq].reshape(q_in.shape), qf, tensor_format,
                                              interleaved=interleaved)
    k64 = rope.reference.apply_rotary_pos_emb(x64[..., nq:nq + nk], kf, tensor_format, interleaved=interleaved)
    torch.autograd.backward((q64, k64, x64[..., nq + nk:]), [g.double() for g in gs])
    torch.testing.assert_close(qkv.grad.double(), x64.grad, rtol=2**-20, atol=2**-20)


# ---------------------------------------------------------------------------------------------- RoPECache

@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_cache_in_place_of_freqs(tensor_format, interleaved, cache_dtype, poison_outputs):  # noqa: F811
    """A RoPECache passed as `freqs` rotates by its rows, with start_positions and context parallelism."""
    gen = torch.Generator().manual_seed(len(tensor_format) + interleaved)
    d, d2, cp = 16, 12, 2
    freqs = (torch.rand(40, 1, 1, d2, generator=gen) * 9).to(DEVICE)
    cache = rope.RoPECache.from_freqs(freqs, cache_dtype)
    kw = dict(tensor_format=tensor_format, interleaved=interleaved, cp_size=cp, cp_rank=1)
    if tensor_format == "thd":
        t = randn((10, 3, d), torch.float32, gen)
        kw.update(cu_seqlens=torch.tensor([0, 8, 8, 20], dtype=torch.int32, device=DEVICE),
                  start_positions=torch.tensor([2, 0, 5], device=DEVICE))
    else:
        t = randn((4, 2, 3, d) if tensor_format == "sbhd" else (2, 4, 3, d), torch.float32, gen)
        kw.update(start_positions=torch.tensor([3, 0], device=DEVICE))
    t0 = t.clone()
    tg = t.clone().requires_grad_()
    out = rope.apply_rotary_pos_emb(tg, cache, **kw)
    # the oracle: the reference on the cache's own (rounded) values
    want = rope.reference.apply_rotary_pos_emb(t.double(), cache, **kw)
    assert_within_rounding(out, want, t, d2, interleaved, "forward")
    g = randn(t.shape, torch.float32, gen)
    out.backward(g)
    t64 = t.double().requires_grad_()
    rope.reference.apply_rotary_pos_emb(t64, cache, **kw).backward(g.double())
    assert_within_rounding(tg.grad, t64.grad, g, d2, interleaved, "backward")
    assert torch.equal(t, t0)
    if cache_dtype == torch.float32:  # the same angles as `freqs`: the freqs path agrees
        torch.testing.assert_close(out, rope.apply_rotary_pos_emb(t, freqs, **kw), rtol=2**-20, atol=2**-20)


def test_cache_update_follows_new_freqs():
    gen = torch.Generator().manual_seed(1)
    freqs = (torch.rand(6, 1, 1, 8, generator=gen) * 9).to(DEVICE)
    cache = rope.RoPECache.from_freqs(freqs)
    t = randn((6, 1, 2, 8), torch.float32, gen)
    other = freqs * 0.5
    cos_ptr = cache.cos.data_ptr()
    cache.update_(other)
    assert cache.cos.data_ptr() == cos_ptr  # in place: a captured graph reads the new values
    torch.testing.assert_close(rope.apply_rotary_pos_emb(t, cache), rope.apply_rotary_pos_emb(t, other),
                               rtol=2**-20, atol=2**-20)


def test_hf_sin_with_other_strides_than_cos(poison_outputs):  # noqa: F811
    """cos and sin are read through one set of strides: a sin laid out otherwise is still read right."""
    gen = torch.Generator().manual_seed(8)
    q, k = randn((2, 3, 5, 16), torch.float32, gen), randn((2, 1, 5, 16), torch.float32, gen)
    half_c, half_s = angles_table(10, 8, torch.float32, gen)
    cos = per_pair(half_c, False).view(2, 5, 16)
    sin = per_pair(half_s, False).view(2, 5, 16).transpose(0, 2).contiguous().transpose(0, 2)  # other strides
    assert cos.stride() != sin.stride()
    qo, ko = rope.hf.apply_rotary_pos_emb(q, k, cos, sin)
    for x, out in ((q, qo), (k, ko)):
        assert_within_rounding(out, oracle(x, cos[:, None], sin[:, None], False), x, 16, False, "forward")


@pytest.mark.parametrize("convention", ["hf", "flash", "vllm", "mrope", "hf-mrope", "vllm-mrope"])
def test_conventions_launch_the_kernel_only_where_it_runs(convention, monkeypatch):
    """On a GPU, or under Triton's interpreter, each convention launches the kernel (once: q and k
    together); on a CPU without the interpreter it computes the reference and launches nothing."""
    gen = torch.Generator().manual_seed(2)
    launches = []
    real = rope._launch.run
    monkeypatch.setattr(rope._launch, "run", lambda *a: (launches.append(1), real(*a))[1])

    def call():
        if convention == "hf":
            ang = torch.rand(1, 4, 8, generator=gen).to(DEVICE)
            return rope.hf.apply_rotary_pos_emb(randn((1, 2, 4, 8), torch.float32, gen),
                                                randn((1, 1, 4, 8), torch.float32, gen), ang.cos(), ang.sin())
        if convention == "flash":
            cos, sin = angles_table(4, 4, torch.float32, gen)
            return rope.flash.apply_rotary_emb(randn((1, 4, 2, 8), torch.float32, gen), cos, sin)
        positions = torch.randint(0, 4, (3, 4), generator=gen).to(DEVICE)
        if convention == "mrope":
            return rope.mrope.apply_multimodal_rotary_pos_emb_qk(
                randn((4, 2, 8), torch.float32, gen), randn((4, 1, 8), torch.float32, gen),
                torch.rand(4, 1, 1, 8, generator=gen).to(DEVICE), positions, [2, 1, 1])
        if convention == "hf-mrope":
            c = torch.rand(3, 1, 4, 8, generator=gen).to(DEVICE)
            return rope.hf.apply_multimodal_rotary_pos_emb(randn((1, 2, 4, 8), torch.float32, gen),
                                                           randn((1, 1, 4, 8), torch.float32, gen), c, c, [2, 1, 1])
        cos, sin = angles_table(4, 4, torch.float32, gen)
        if convention == "vllm-mrope":
            return rope.vllm.mrotary_embedding(positions, randn((4, 16), torch.float32, gen),
                                               randn((4, 8), torch.float32, gen), 8, torch.cat([cos, sin], -1),
                                               [2, 1, 1])
        return rope.vllm.rotary_embedding(torch.arange(3, device=DEVICE), randn((3, 16), torch.float32, gen),
                                          randn((3, 8), torch.float32, gen), 8, torch.cat([cos, sin], -1), True)

    call()
    assert len(launches) == 1
    if DEVICE == "cpu":
        monkeypatch.setattr(rope._backend, "INTERPRET", False)
        launches.clear()
        call()
        assert launches == []


def test_embedding_rotary_width_rules():
    theta = rope.RotaryPositionEmbedding(8)(3)[:, 0, 0]
    assert torch.equal(theta[:, :4], theta[:, 4:])  # half-split layout by default
    assert rope.RotaryPositionEmbedding(8, rotary_percent=1.5).dim == 8  # only a fraction below 1 narrows it
    assert rope.RotaryPositionEmbedding(8, rotary_percent=0.5).dim == 4
    for percent in (0.1, 0.3):  # widths 0 and 2 * 0.3 * 8 -> 2 (int(2.4)): 0 is refused
        if int(8 * percent) < 2:
            with pytest.raises(ValueError, match="dim"):
                rope.RotaryPositionEmbedding(8, rotary_percent=percent)


def test_flash_varlen_empty_batch():
    """cu_seqlens = [0]: no sequences, no tokens; a new empty tensor."""
    gen = torch.Generator().manual_seed(0)
    cos, sin = angles_table(4, 4, torch.float32, gen)
    x = randn((0, 2, 8), torch.float32, gen)
    out = rope.flash.apply_rotary_emb(x, cos, sin, cu_seqlens=torch.zeros(1, dtype=torch.int32, device=DEVICE))
    assert out.shape == x.shape and out is not x
