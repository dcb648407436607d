"""The conventions of transformers (`rope.hf`), flash-attention (`rope.flash`), vLLM (`rope.vllm`), TE's packed
QKV and `rope.RoPECache`, against a float64 oracle written here from each convention's own definition.

Each property draws shapes, dtypes (of the tensors and, separately, of the cos/sin tables), pairings,
offsets or positions and memory layouts; checks the forward (outputs poisoned with NaN first, so every
element must be written) and, where the convention has one, the backward with a random upstream gradient,
each within one rounding of float64; and checks that nothing the convention does not write changed.
Where a convention meets TransformerEngine's `freqs` path (equal halves), the two agree.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rope

from .cases import DEVICE, poison_outputs  # noqa: F401
from .numerics import assert_within_rounding
from .strategies import scaled_examples

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


def table_dtype(data, x_dtype):
    return data.draw(st.sampled_from((torch.float32, x_dtype)), label="table dtype")


# ---------------------------------------------------------------------------------------------- transformers

@scaled_examples(0.5)
@given(data=st.data())
def test_hf_matches_oracle(data):
    with rope._launch.nan_outputs():
        _hf_matches_oracle(data)


def _hf_matches_oracle(data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    b, s = data.draw(st.integers(1, 3), label="b"), data.draw(st.integers(1, 6), label="s")
    hq, hk = data.draw(st.integers(1, 4), label="q heads"), data.draw(st.integers(1, 3), label="k heads")
    d = head_dim(data)
    unsqueeze_dim = data.draw(st.sampled_from((1, 2)), label="unsqueeze_dim")
    cos_b = data.draw(st.sampled_from((1, b)), label="cos batch")
    cdt = data.draw(st.sampled_from((dtype, torch.float32)), label="cos dtype")
    from_projection = data.draw(st.booleans(), label="q a transposed view")  # [b, s, h, d] memory, as models make it
    qk = []
    for h in (hq, hk):
        if unsqueeze_dim == 1 and from_projection:
            qk.append(randn((b, s, h, d), dtype, gen).transpose(1, 2))
        else:
            qk.append(randn((b, h, s, d) if unsqueeze_dim == 1 else (b, s, h, d), dtype, gen))
    q, k = qk
    half_c, half_s = angles_table(cos_b * s, d // 2, cdt, gen)
    cos, sin = per_pair(half_c, False).view(cos_b, s, d), per_pair(half_s, False).view(cos_b, s, d)
    q0, k0, cos0, sin0 = q.clone(), k.clone(), cos.clone(), sin.clone()
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    qo, ko = rope.hf.apply_rotary_pos_emb(qg, kg, cos, sin, unsqueeze_dim=unsqueeze_dim)
    out_dtype = torch.promote_types(dtype, cdt)
    assert qo.dtype == ko.dtype == out_dtype and qo.shape == q.shape and ko.shape == k.shape
    c, sn = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    gq, gk = randn(qo.shape, out_dtype, gen), randn(ko.shape, out_dtype, gen)
    torch.autograd.backward((qo, ko), (gq, gk))
    for name, x, out, g, grad in (("q", q, qo, gq, qg.grad), ("k", k, ko, gk, kg.grad)):
        assert_within_rounding(out, oracle(x, c, sn, False), x.to(out_dtype), d, False, f"{name} forward")
        assert_within_rounding(grad, oracle_grad(g, c, sn, False), g, d, False, f"{name} backward")
    for x, x0 in ((q, q0), (k, k0), (cos, cos0), (sin, sin0)):
        assert torch.equal(x, x0), "an input changed"


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

@scaled_examples(0.5)
@given(data=st.data())
def test_flash_matches_oracle(data):
    with rope._launch.nan_outputs():
        _flash_matches_oracle(data)


def _flash_matches_oracle(data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    interleaved = data.draw(st.booleans(), label="interleaved")
    inplace = data.draw(st.booleans(), label="inplace")
    h, d = data.draw(st.integers(1, 4), label="h"), head_dim(data)
    rot = rotary_width(data, d)
    varlen = data.draw(st.booleans(), label="varlen")
    if varlen:
        lengths = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=4), label="lengths")
        b, s = len(lengths), max(lengths)
        cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(
            data.draw(st.sampled_from((torch.int32, torch.int64)), label="cu dtype"))
        x = randn((sum(lengths), h, d), dtype, gen)
    else:
        b, s = data.draw(st.integers(1, 3), label="b"), data.draw(st.integers(1, 6), label="s")
        lengths, cu = [s] * b, None
        x = randn((b, s, h, d), dtype, gen)
        if data.draw(st.booleans(), label="strided x"):
            x = randn((b, s, h, d + 6), dtype, gen)[..., 3:3 + d]
    offsets_kind = data.draw(st.sampled_from(("zero", "int", "tensor")), label="seqlen_offsets")
    extra = data.draw(st.integers(0, 4), label="extra rows")
    if offsets_kind == "tensor":
        offs = torch.randint(0, extra + 1, (b,), generator=gen).to(DEVICE)
        seqlen_offsets = offs.to(data.draw(st.sampled_from((torch.int32, torch.int64)), label="offsets dtype"))
    else:
        off = extra if offsets_kind == "int" else 0
        offs, seqlen_offsets = torch.full((b,), off, device=DEVICE), off
    cos, sin = angles_table(s + extra, rot // 2, table_dtype(data, dtype), gen)
    pos = torch.cat([torch.arange(n, device=DEVICE) + offs[i] for i, n in enumerate(lengths)]) if varlen else \
        torch.arange(s, device=DEVICE)[None, :] + offs[:, None]  # [tokens] or [b, s]
    cf, sf = per_pair(cos, interleaved)[pos].unsqueeze(-2), per_pair(sin, interleaved)[pos].unsqueeze(-2)
    want = oracle(x, cf, sf, interleaved)
    x0 = x.clone()
    g = randn(x.shape, dtype, gen)
    xg = x.clone().requires_grad_() if not inplace else x.clone().requires_grad_().clone()
    out = rope.flash.apply_rotary_emb(xg, cos, sin, interleaved=interleaved, inplace=inplace,
                                      seqlen_offsets=seqlen_offsets, cu_seqlens=cu, max_seqlen=s if varlen else None)
    assert (out is xg) == inplace
    assert_within_rounding(out, want, x, rot, interleaved, "forward")
    out.backward(g)
    leaf = xg if not inplace else None
    if leaf is not None:
        assert_within_rounding(leaf.grad, oracle_grad(g, cf, sf, interleaved), g, rot, interleaved, "backward")
    assert torch.equal(x, x0), "x changed"


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


# ---------------------------------------------------------------------------------------------- vLLM

@scaled_examples(0.5)
@given(data=st.data())
def test_vllm_matches_oracle(data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    is_neox = data.draw(st.booleans(), label="is_neox")
    n_tokens = data.draw(st.integers(0, 9), label="tokens")
    hq, hk = data.draw(st.integers(1, 4), label="q heads"), data.draw(st.integers(1, 3), label="k heads")
    head_size = head_dim(data, "head_size")
    rot = rotary_width(data, head_size)
    rows = data.draw(st.integers(1, 24), label="max_position")
    with_key = data.draw(st.booleans(), label="key")
    batched = data.draw(st.booleans(), label="positions [b, s]")
    positions = torch.randint(0, rows, (n_tokens, 2), generator=gen).to(DEVICE)
    positions = positions.to(data.draw(st.sampled_from((torch.int32, torch.int64)), label="positions dtype"))
    positions = positions[:, 0] if data.draw(st.booleans(), label="strided positions") else positions[:, 0].clone()
    lead = (1, n_tokens) if batched else (n_tokens,)
    positions = positions.view(lead)
    # q and k as slices of one fused projection, as vLLM passes them
    qkv = randn((*lead, (hq + 2 * hk) * head_size), dtype, gen)
    query, key = qkv[..., :hq * head_size], qkv[..., hq * head_size:(hq + hk) * head_size]
    if data.draw(st.booleans(), label="3-D query"):
        query = query.unflatten(-1, (hq, head_size))
    cos, sin = angles_table(rows, rot // 2, table_dtype(data, dtype), gen)
    cache = torch.cat([cos, sin], -1)
    before = qkv.clone()
    flat = positions.reshape(-1).long()
    want = [oracle(x.reshape(n_tokens, h, head_size), per_pair(cos, not is_neox)[flat][:, None],
                   per_pair(sin, not is_neox)[flat][:, None], not is_neox) for x, h in ((query, hq), (key, hk))]
    ret = rope.vllm.rotary_embedding(positions, query, key if with_key else None, head_size, cache, is_neox)
    assert ret is None
    got_q = query.reshape(n_tokens, hq, head_size)
    assert_within_rounding(got_q, want[0], before[..., :hq * head_size].reshape(n_tokens, hq, head_size), rot,
                           not is_neox, "query")
    k_before = before[..., hq * head_size:(hq + hk) * head_size].reshape(n_tokens, hk, head_size)
    if with_key:
        assert_within_rounding(key.reshape(n_tokens, hk, head_size), want[1], k_before, rot, not is_neox, "key")
    else:
        assert torch.equal(key.reshape(n_tokens, hk, head_size), k_before), "key changed without being passed"
    assert torch.equal(qkv[..., (hq + hk) * head_size:], before[..., (hq + hk) * head_size:]), "v changed"


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
