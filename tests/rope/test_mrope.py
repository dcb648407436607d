"""Multimodal RoPE (docs/contract.md section 7b): three position streams, each read by a section of the pairs.

rope's entry points beyond the native suite (tests/conformance: conventions mrope, hf-mrope, qwen3vl-mrope,
vllm-mrope certify each against its float64 definition, with equal streams and the inverse among the invariants):
- `test_mrope_*`: `rope.mrope.apply_multimodal_rotary_pos_emb` relabelled (streams permuted with their sections and
  the pairs they cover change nothing) and as a rotation (pair norms kept, the negated angles restore t).
- `test_entry_*`: rope's entry points against the definitions of transformers and vLLM, and their agreement with
  each other and with the plain conventions bitwise where they compute the same thing.
Outputs are poisoned with NaN (every element must be written) and inputs must come back unchanged.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rope

from .cases import DEVICE, head_dim, oracle, oracle_grad, poison_outputs, randn, rotary_width  # noqa: F401
from .numerics import assert_within_rounding
from .strategies import scaled_examples

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FORMATS = ("thd", "sbhd", "bshd")



# ---------------------------------------------------------------------------------------------- the definition

def stream_of_pair(sections, pairs, mrope_interleaved):
    """Stream of each pair as the models define it: consecutive sections (Qwen2-VL), or Qwen3-VL's
    `apply_interleaved_mrope`, which overwrites the temporal frequencies with the height ones at
    1::3 below 3 * sections[1] and with the width ones at 2::3 below 3 * sections[2]."""
    if not mrope_interleaved:
        out, k = [], 0
        for m, n in enumerate(sections):
            out += [m] * n
            k += n
        return torch.tensor(out, dtype=torch.int64)
    out = torch.zeros(pairs, dtype=torch.int64)
    for m, offset in ((1, 1), (2, 2)):
        out[slice(offset, sections[m] * 3, 3)] = m
    return out


@st.composite
def sections_for(draw, pairs, mrope_interleaved):
    """Three section sizes covering `pairs`; interleaved, each must fit its every-third-pair slots."""
    if mrope_interleaved:
        s1 = draw(st.integers(0, len(range(1, pairs, 3))), label="section 1")
        s2 = draw(st.integers(0, len(range(2, pairs, 3))), label="section 2")
        return [pairs - s1 - s2, s1, s2]
    s0 = draw(st.integers(0, pairs), label="section 0")
    s1 = draw(st.integers(0, pairs - s0), label="section 1")
    return [s0, s1, pairs - s0 - s1]


def lead_of(tensor_format, s, b):
    return {"thd": (s * b,), "sbhd": (s, b), "bshd": (b, s)}[tensor_format]


def draw_case(data, gen, dtypes=DTYPES, rotation=False):
    """(t, freqs, positions, sections, keywords). `rotation`: the two channels of a pair share their angle
    (as every model's angles do), so the map is a rotation; otherwise that is drawn too."""
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    fmt = data.draw(st.sampled_from(FORMATS), label="tensor_format")
    interleaved = data.draw(st.booleans(), label="interleaved")
    mrope_interleaved = data.draw(st.booleans(), label="mrope_interleaved")
    s, b = data.draw(st.integers(1, 6), label="s"), data.draw(st.integers(1, 3), label="b")
    h, d = data.draw(st.integers(1, 4), label="h"), head_dim(data)
    d2 = rotary_width(data, d)
    sections = data.draw(sections_for(d2 // 2, mrope_interleaved), label="mrope_section")
    rows = data.draw(st.integers(1, 40), label="freqs rows")
    lead = lead_of(fmt, s, b)
    t = randn((*lead, h, d + 6), dtype, gen)[..., 2:2 + d] if data.draw(st.booleans(), label="strided t") else \
        randn((*lead, h, d), dtype, gen)
    pos_dtype = data.draw(st.sampled_from((torch.int32, torch.int64)), label="positions dtype")
    positions = torch.randint(0, rows, (3, *lead), generator=gen).to(pos_dtype).to(DEVICE)
    if data.draw(st.booleans(), label="one stream"):
        positions = positions[0]
    rotation = rotation or data.draw(st.booleans(), label="equal pair angles")
    theta = torch.rand(rows, d2 // 2 if rotation else d2, generator=gen, dtype=torch.float64) * 20 - 10
    if rotation:
        theta = theta.repeat_interleave(2, -1) if interleaved else torch.cat([theta, theta], -1)
    freqs = theta.float().view(rows, 1, 1, d2).to(DEVICE)
    return t, freqs, positions, sections, dict(tensor_format=fmt, interleaved=interleaved,
                                                mrope_interleaved=mrope_interleaved)


def three(positions, lead_dims):
    return positions if positions.dim() == lead_dims + 1 else positions.expand(3, *positions.shape)


# ---------------------------------------------------------------------------------------------- rope.mrope

mrope = rope.mrope.apply_multimodal_rotary_pos_emb

@scaled_examples(0.3)
@given(data=st.data())
def test_mrope_permuting_streams_with_sections(data):
    """Relabelling: streams in another order, each keeping its section size, with the rotary pairs (and their
    angles) moved block by block to where their section now lies, give the same result moved the same way."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    t, freqs, positions, sections, kw = draw_case(data, gen, dtypes=(torch.float32,))
    if kw["mrope_interleaved"]:
        kw["mrope_interleaved"] = False  # consecutive sections: a permutation moves whole blocks
    positions = three(positions, t.dim() - 2)
    perm = data.draw(st.permutations([0, 1, 2]), label="stream order")
    d2, interleaved = freqs.shape[-1], kw["interleaved"]
    starts = [sum(sections[:m]) for m in range(3)]
    pair_order = torch.cat([torch.arange(starts[m], starts[m] + sections[m]) for m in perm])  # new pair -> old
    half = d2 // 2
    if interleaved:
        chan = torch.stack([2 * pair_order, 2 * pair_order + 1], -1).reshape(-1)
    else:
        chan = torch.cat([pair_order, pair_order + half])
    chan = torch.cat([chan, torch.arange(d2, t.shape[-1])]).to(DEVICE)
    moved = mrope(t[..., chan].contiguous(), freqs[..., chan[:d2]].contiguous(), positions[list(perm)].contiguous(),
                  [sections[m] for m in perm], **kw)
    want = mrope(t, freqs, positions, sections, **kw)
    torch.testing.assert_close(moved, want[..., chan], rtol=0, atol=0)  # the same products, element by element


@scaled_examples(0.3)
@given(data=st.data())
def test_mrope_keeps_norms_and_inverts(data):
    """A rotation keeps the norm of each pair; rotating back by the negated angles restores t."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    t, freqs, positions, sections, kw = draw_case(data, gen, dtypes=(torch.float32,), rotation=True)
    out = mrope(t, freqs, positions, sections, **kw)
    d2 = freqs.shape[-1]

    def pair_norms(x):
        x = x[..., :d2].double()
        a, b = (x[..., 0::2], x[..., 1::2]) if kw["interleaved"] else (x[..., :d2 // 2], x[..., d2 // 2:])
        return a * a + b * b

    # float32 evaluation: each output within 2^-20 (|x_i| + |x_pi(i)|) of exact (numerics.py)
    torch.testing.assert_close(pair_norms(out), pair_norms(t), rtol=2**-17, atol=2**-17)
    back = mrope(out, -freqs, positions, sections, **kw)
    torch.testing.assert_close(back, t, rtol=2**-18, atol=2**-18)


# ---------------------------------------------------------------------------------------------- rope's entry points

def qwen2_vl_definition(q, k, cos, sin, sections, unsqueeze_dim=1):
    """transformers' `apply_multimodal_rotary_pos_emb` (Qwen2-VL), in float64."""
    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)

    doubled = list(sections) * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.double().split(doubled, dim=-1))], dim=-1)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.double().split(doubled, dim=-1))], dim=-1)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return tuple(x.double() * cos + rotate_half(x.double()) * sin for x in (q, k))


def qwen3_vl_tables(freqs3, sections):
    """Qwen3-VL's rotary module: `apply_interleaved_mrope` on the frequencies [3, ..., d/2], then
    cat(freqs, freqs) and cos/sin."""
    out = freqs3[0].clone()
    for m, offset in ((1, 1), (2, 2)):
        idx = slice(offset, sections[m] * 3, 3)
        out[..., idx] = freqs3[m, ..., idx]
    emb = torch.cat([out, out], -1)
    return emb.cos(), emb.sin()


@scaled_examples(0.5)
@given(data=st.data())
def test_entry_hf_matches_transformers(data):
    with rope._launch.nan_outputs():
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
        dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        cdt = data.draw(st.sampled_from((dtype, torch.float32)), label="cos dtype")
        b, s = data.draw(st.integers(1, 3), label="b"), data.draw(st.integers(1, 6), label="s")
        hq, hk = data.draw(st.integers(1, 4), label="q heads"), data.draw(st.integers(1, 3), label="k heads")
        d = head_dim(data)
        mrope_interleaved = data.draw(st.booleans(), label="mrope_interleaved")
        sections = data.draw(sections_for(d // 2, mrope_interleaved), label="mrope_section")
        unsqueeze_dim = data.draw(st.sampled_from((1, 2)), label="unsqueeze_dim")
        cos_b = data.draw(st.sampled_from((1, b)), label="cos batch")
        shape = (lambda h: (b, h, s, d)) if unsqueeze_dim == 1 else (lambda h: (b, s, h, d))
        q, k = randn(shape(hq), dtype, gen), randn(shape(hk), dtype, gen)
        freqs3 = torch.rand(3, cos_b, s, d // 2, generator=gen, dtype=torch.float64) * 20 - 10
        emb = torch.cat([freqs3, freqs3], -1)
        cos, sin = emb.cos().to(cdt).to(DEVICE), emb.sin().to(cdt).to(DEVICE)
        q0, k0, c0, s0 = q.clone(), k.clone(), cos.clone(), sin.clone()
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        qo, ko = rope.hf.apply_multimodal_rotary_pos_emb(qg, kg, cos, sin, sections, unsqueeze_dim,
                                                         mrope_interleaved=mrope_interleaved)
        out_dtype = torch.promote_types(dtype, cdt)
        assert qo.dtype == ko.dtype == out_dtype
        if mrope_interleaved:  # the tables Qwen3-VL builds, read by transformers' plain rotation
            c3, s3 = (x.to(cdt).to(DEVICE).unsqueeze(unsqueeze_dim) for x in qwen3_vl_tables(freqs3, sections))
            want = [oracle(x, c3, s3, False) for x in (q, k)]
        else:
            want = qwen2_vl_definition(q, k, cos, sin, sections, unsqueeze_dim)
        gq, gk = randn(qo.shape, out_dtype, gen), randn(ko.shape, out_dtype, gen)
        torch.autograd.backward((qo, ko), (gq, gk))
        for name, x, out, w in (("q", q, qo, want[0]), ("k", k, ko, want[1])):
            assert_within_rounding(out, w, x.to(out_dtype), d, False, f"{name} forward")
        # the backward: autograd through the float64 definition
        q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
        if mrope_interleaved:
            w64 = [oracle(x, c3, s3, False) for x in (q64, k64)]
        else:
            w64 = qwen2_vl_definition(q64, k64, cos, sin, sections, unsqueeze_dim)
        torch.autograd.backward(w64, (gq.double(), gk.double()))
        assert_within_rounding(qg.grad, q64.grad, gq, d, False, "q backward")
        assert_within_rounding(kg.grad, k64.grad, gk, d, False, "k backward")
        for x, x0 in ((q, q0), (k, k0), (cos, c0), (sin, s0)):
            assert torch.equal(x, x0), "an input changed"


def vllm_definition(positions, x, heads, head_size, cache, sections, is_neox, mrope_interleaved):
    """vLLM's `MRotaryEmbedding.forward_native` for one of query/key, in float64: [T, h, head_size]."""
    rot = cache.shape[-1]
    cos, sin = cache.double()[positions.long()].chunk(2, dim=-1)  # [3, T, rot/2]
    if positions.dim() == 2:
        if mrope_interleaved:
            pick = stream_of_pair(sections, rot // 2, True).to(cos.device)
            cos = torch.gather(cos, 0, pick.expand(1, *cos.shape[1:]))[0]
            sin = torch.gather(sin, 0, pick.expand(1, *sin.shape[1:]))[0]
        else:
            cos = torch.cat([m[i] for i, m in enumerate(cos.split(sections, dim=-1))], dim=-1)
            sin = torch.cat([m[i] for i, m in enumerate(sin.split(sections, dim=-1))], dim=-1)
    x = x.double().reshape(x.shape[0], heads, head_size)
    xr, cos, sin = x[..., :rot], cos[:, None], sin[:, None]
    if is_neox:
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, x[..., rot:]), dim=-1)


@scaled_examples(0.5)
@given(data=st.data())
def test_entry_vllm_matches_vllm(data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    is_neox = data.draw(st.booleans(), label="is_neox")
    mrope_interleaved = data.draw(st.booleans(), label="mrope_interleaved")
    n_tokens = data.draw(st.integers(0, 9), label="tokens")
    hq, hk = data.draw(st.integers(1, 4), label="q heads"), data.draw(st.integers(1, 3), label="k heads")
    head_size = head_dim(data, "head_size")
    rot = rotary_width(data, head_size)
    sections = data.draw(sections_for(rot // 2, mrope_interleaved), label="mrope_section")
    rows = data.draw(st.integers(1, 24), label="max_position")
    with_key = data.draw(st.booleans(), label="key")
    positions = torch.randint(0, rows, (3, n_tokens), generator=gen).to(DEVICE)
    positions = positions.to(data.draw(st.sampled_from((torch.int32, torch.int64)), label="positions dtype"))
    if data.draw(st.booleans(), label="text only"):
        positions = positions[0]
    qkv = randn((n_tokens, (hq + 2 * hk) * head_size), dtype, gen)  # q and k sliced out of one projection
    query, key = qkv[:, :hq * head_size], qkv[:, hq * head_size:(hq + hk) * head_size]
    theta = torch.rand(rows, rot // 2, generator=gen, dtype=torch.float64) * 20 - 10
    cache = torch.cat([theta.cos(), theta.sin()], -1).to(data.draw(st.sampled_from((torch.float32, dtype)),
                                                                   label="cache dtype")).to(DEVICE)
    before = qkv.clone()
    want = [vllm_definition(positions, x, h, head_size, cache, sections, is_neox, mrope_interleaved)
            for x, h in ((query, hq), (key, hk))]
    ret = rope.vllm.mrotary_embedding(positions, query, key if with_key else None, head_size, cache, sections,
                                      is_neox, mrope_interleaved)
    assert ret[0] is query and ret[1] is (key if with_key else None)
    q_before = before[:, :hq * head_size].reshape(n_tokens, hq, head_size)
    k_before = before[:, hq * head_size:(hq + hk) * head_size].reshape(n_tokens, hk, head_size)
    assert_within_rounding(query.reshape(n_tokens, hq, head_size), want[0], q_before, rot, not is_neox, "query")
    if with_key:
        assert_within_rounding(key.reshape(n_tokens, hk, head_size), want[1], k_before, rot, not is_neox, "key")
    else:
        assert torch.equal(key.reshape(n_tokens, hk, head_size), k_before), "key changed without being passed"
    assert torch.equal(qkv[:, (hq + hk) * head_size:], before[:, (hq + hk) * head_size:]), "v changed"


@pytest.mark.parametrize("tensor_format", FORMATS)
def test_entry_qk_and_cache_agree_bitwise(tensor_format, poison_outputs):  # noqa: F811
    """q and k in one launch give the two single calls' results bitwise, with `freqs` and with a RoPECache of
    its cos/sin (the same table values, the same arithmetic); the gradients reach both."""
    gen = torch.Generator().manual_seed(len(tensor_format))
    d, d2, sections = 24, 16, [2, 3, 3]
    lead = lead_of(tensor_format, 4, 2)
    q, k = randn((*lead, 3, d), torch.bfloat16, gen), randn((*lead, 1, d), torch.bfloat16, gen)
    freqs = (torch.rand(30, 1, 1, d2, generator=gen) * 9).to(DEVICE)
    positions = torch.randint(0, 30, (3, *lead), generator=gen).to(DEVICE)
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    for angles in (freqs, rope.RoPECache.from_freqs(freqs)):
        qo, ko = rope.mrope.apply_multimodal_rotary_pos_emb_qk(qg, kg, angles, positions, sections, tensor_format)
        assert torch.equal(qo, rope.mrope.apply_multimodal_rotary_pos_emb(q, angles, positions, sections,
                                                                          tensor_format))
        assert torch.equal(ko, rope.mrope.apply_multimodal_rotary_pos_emb(k, angles, positions, sections,
                                                                          tensor_format))
        gq, gk = randn(qo.shape, torch.bfloat16, gen), randn(ko.shape, torch.bfloat16, gen)
        qg.grad = kg.grad = None
        torch.autograd.backward((qo, ko), (gq, gk))
        for g, x, grad in ((gq, q, qg.grad), (gk, k, kg.grad)):
            t64 = x.double().requires_grad_()
            rope.reference.apply_multimodal_rotary_pos_emb(t64, freqs.double(), positions, sections,
                                                           tensor_format).backward(g.double())
            assert_within_rounding(grad, t64.grad, g, d2, False, "backward")


def test_entry_equal_streams_match_plain_conventions_bitwise(poison_outputs):  # noqa: F811
    """Three equal streams through each entry point give the plain convention's result bitwise."""
    gen = torch.Generator().manual_seed(4)
    b, s, d, sections = 2, 5, 16, [3, 3, 2]
    q, k = randn((b, 3, s, d), torch.float16, gen), randn((b, 1, s, d), torch.float16, gen)
    ang = torch.rand(b, s, d // 2, generator=gen) * 9
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(DEVICE) for f in (torch.cos, torch.sin))
    multi = rope.hf.apply_multimodal_rotary_pos_emb(q, k, cos.expand(3, b, s, d), sin.expand(3, b, s, d), sections)
    plain = rope.hf.apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(x, y) for x, y in zip(multi, plain, strict=True))
    # vLLM: positions [3, T] with equal rows, against `rotary_embedding`
    n, hs, rot = 7, 16, 12
    positions = torch.randint(0, 9, (n,), generator=gen).to(DEVICE)
    theta = torch.rand(9, rot // 2, generator=gen)
    cache = torch.cat([theta.cos(), theta.sin()], -1).to(DEVICE)
    for is_neox in (True, False):
        x = randn((n, 2 * hs), torch.bfloat16, gen)
        y = x.clone()
        rope.vllm.mrotary_embedding(positions.expand(3, n), x, None, hs, cache, [2, 2, 2], is_neox)
        rope.vllm.rotary_embedding(positions, y, None, hs, cache, is_neox)
        assert torch.equal(x, y)
    # packed: against TransformerEngine's call on the angles gathered by position
    t = randn((n, 2, hs), torch.float32, gen)
    freqs = (torch.rand(9, 1, 1, rot, generator=gen) * 9).to(DEVICE)
    got = rope.mrope.apply_multimodal_rotary_pos_emb(t, freqs, positions.expand(3, n), [1, 2, 3])
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    assert torch.equal(got, rope.apply_rotary_pos_emb(t, freqs[positions], "thd", cu_seqlens=cu))
