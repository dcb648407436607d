"""q and k in one launch, and the in-place mode (docs/contract.md section 7)."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

import rope
import rope._backend
import rope._launch
import rope.functional
from rope import reference

from .cases import DEVICE, angle_source, make_freqs, make_t, needs_angle_source, poison_outputs, reference_path  # noqa: F401
from .numerics import assert_within_rounding

S, B, D = 6, 2, 32
HEADS = [(4, 1), (4, 2), (2, 4), (3, 3)]  # MQA, GQA, more kv heads than q heads, MHA


def _kw(tensor_format, mode, gen, n_pos):
    kw = dict(tensor_format=tensor_format)
    if mode == "start":
        kw["start_positions"] = torch.randint(0, 5, (n_pos,), generator=gen).to(DEVICE)
    elif mode == "cp":
        kw.update(cp_size=2, cp_rank=1)
    return kw


def _pair(tensor_format, hq, hk, dtype, seed, mode=None, layout="contiguous"):
    gen = torch.Generator().manual_seed(seed)
    cp = 2 if mode == "cp" else 1
    if tensor_format == "thd":
        lengths = [4 * cp, 0, 8 * cp, 2 * cp]
        tokens = sum(lengths) // cp
        q = make_t("thd", tokens, 1, hq, D, dtype, gen, layout)
        k = make_t("thd", tokens, 1, hk, D, dtype, gen, layout)
        kw = _kw(tensor_format, mode, gen, len(lengths))
        kw["cu_seqlens"] = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32,
                                        device=DEVICE)
    else:
        q = make_t(tensor_format, S, B, hq, D, dtype, gen, layout)
        k = make_t(tensor_format, S, B, hk, D, dtype, gen, layout)
        kw = _kw(tensor_format, mode, gen, B)
    return q, k, gen, kw


def _qk_cases():
    """Every format x interleaving x position mode (with both angle sources: the fixture), the head pairs turned
    through them so that each head pair meets every format, every mode and both interleavings."""
    cases = []
    for f, tensor_format in enumerate(["sbhd", "bshd", "thd"]):
        for i, interleaved in enumerate([False, True]):
            for m, mode in enumerate([None, "start", "cp"]):
                hq, hk = HEADS[(f + i + 2 * m) % len(HEADS)]
                cases.append(pytest.param(tensor_format, interleaved, hq, hk, mode, id=(
                    f"{tensor_format}-{'interleaved' if interleaved else 'halfsplit'}-{hq}-{hk}-{mode}")))
    return cases


def test_qk_cases_meet_every_head_pair():
    cases = [p.values for p in _qk_cases()]
    for column in (0, 1, 4):  # format, interleaving, mode
        for value in {c[column] for c in cases}:
            assert {c[2:4] for c in cases if c[column] == value} == set(HEADS), (column, value)


@pytest.mark.parametrize("tensor_format,interleaved,hq,hk,mode", _qk_cases())
def test_qk_matches_two_calls_and_float64(tensor_format, interleaved, hq, hk, mode, angle_source,  # noqa: F811
                                          poison_outputs):  # noqa: F811
    needs_angle_source(angle_source, interleaved)
    q, k, gen, kw = _pair(tensor_format, hq, hk, torch.bfloat16, seed=hq * 10 + hk, mode=mode)
    d2 = 24  # partial rotary: the tail is copied for both tensors
    freqs = make_freqs(64, d2, gen)
    kw["interleaved"] = interleaved
    gq = torch.randn(q.shape, generator=gen).to(q.dtype).to(DEVICE)
    gk = torch.randn(k.shape, generator=gen).to(k.dtype).to(DEVICE)

    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    qo, ko = rope.apply_rotary_pos_emb_qk(q1, k1, freqs, **kw)
    torch.autograd.backward((qo, ko), (gq, gk))
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    qs, ks = rope.apply_rotary_pos_emb(q2, freqs, **kw), rope.apply_rotary_pos_emb(k2, freqs, **kw)
    torch.autograd.backward((qs, ks), (gq, gk))
    # the same arithmetic on the same angles: bitwise equal to two single calls
    assert torch.equal(qo, qs) and torch.equal(ko, ks)
    assert torch.equal(q1.grad, q2.grad) and torch.equal(k1.grad, k2.grad)
    for x, out, g, grad in ((q, qo, gq, q1.grad), (k, ko, gk, k1.grad)):
        x64 = x.double().requires_grad_()
        ref = reference.apply_rotary_pos_emb(x64, freqs, **kw)
        ref.backward(g.double())
        assert_within_rounding(out, ref, x, d2, interleaved, "forward")
        assert_within_rounding(grad, x64.grad, g, d2, interleaved, "backward")


def test_qk_is_one_launch_each_way(monkeypatch):
    launches = []
    real_run = rope._launch.run

    def counting_run(plan, pointers):
        launches.append(plan.kernel.__name__ if hasattr(plan.kernel, "__name__") else str(plan.kernel))
        return real_run(plan, pointers)

    monkeypatch.setattr(rope._launch, "run", counting_run)
    q, k, gen, kw = _pair("sbhd", 4, 2, torch.float32, seed=1)
    freqs = make_freqs(16, D, gen)
    q.requires_grad_()
    k.requires_grad_()
    qo, ko = rope.apply_rotary_pos_emb_qk(q, k, freqs, **kw)
    assert len(launches) == 1
    (qo.square().sum() + ko.sum()).backward()
    assert len(launches) == 2


def test_qk_gradient_of_one_output_only():
    """Only q's output used: k's gradient is zero, q's equals the single call's."""
    q, k, gen, kw = _pair("bshd", 2, 1, torch.float32, seed=2)
    freqs = make_freqs(16, D, gen)
    q.requires_grad_()
    k.requires_grad_()
    qo, _ = rope.apply_rotary_pos_emb_qk(q, k, freqs, **kw)
    g = torch.randn(qo.shape, generator=gen).to(DEVICE)
    qo.backward(g)
    q2 = q.detach().clone().requires_grad_()
    rope.apply_rotary_pos_emb(q2, freqs, **kw).backward(g)
    assert torch.equal(q.grad, q2.grad)
    assert k.grad is None or not k.grad.any()


@pytest.mark.parametrize("bad,match", [
    (lambda q, k: (q, k.double()), "k"),
    (lambda q, k: (q, k[:, :1]), "k"),
    (lambda q, k: (q, k[..., :16]), "k"),
    (lambda q, k: (q, k.tolist()), "k"),
])
def test_qk_bad_pairs(bad, match):
    q, k, gen, kw = _pair("sbhd", 2, 2, torch.float32, seed=3)
    freqs = make_freqs(16, 16, gen)
    q2, k2 = bad(q, k)
    with pytest.raises((ValueError, TypeError), match=match):
        rope.apply_rotary_pos_emb_qk(q2, k2, freqs, **kw)


# ---- in place -------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "strided_last"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halfsplit", "interleaved"])
@pytest.mark.parametrize("tensor_format", ["sbhd", "thd"])
@pytest.mark.parametrize("d2", [32, 12], ids=["full", "partial"])
def test_inplace_equals_out_of_place(tensor_format, interleaved, layout, d2, angle_source):  # noqa: F811
    """Same values bitwise, in t's own memory and strides. (On a GPU this is also the race test:
    a program whose layout is wider than its tile would, without the barrier, store some rotated
    values before other threads load them; rows < 8 and d2 = 12 make such tiles.)"""
    needs_angle_source(angle_source, interleaved)
    q, k, gen, kw = _pair(tensor_format, 3, 1, torch.bfloat16, seed=4, layout=layout)
    freqs = make_freqs(64, d2, gen)
    kw["interleaved"] = interleaved
    want = rope.apply_rotary_pos_emb(q, freqs, **kw)
    x = q.clone() if layout == "contiguous" else q  # `q` is a fresh view of its own storage
    storage_before = x.untyped_storage().data_ptr()
    strides_before = x.stride()
    out = rope.apply_rotary_pos_emb(x, freqs, **kw, inplace=True)
    assert out is x
    assert x.untyped_storage().data_ptr() == storage_before and x.stride() == strides_before
    assert torch.equal(x, want)


def test_inplace_autograd():
    gen = torch.Generator().manual_seed(5)
    leaf = make_t("sbhd", S, B, 3, D, torch.float32, gen).requires_grad_()
    freqs = make_freqs(16, D, gen)
    g = torch.randn(leaf.shape, generator=gen).to(DEVICE)
    y = leaf * 1.5  # a non-leaf may be rotated in place
    version = y._version
    out = rope.apply_rotary_pos_emb(y, freqs, inplace=True)
    assert out is y and y._version > version
    out.backward(g)
    leaf2 = leaf.detach().clone().requires_grad_()
    rope.apply_rotary_pos_emb(leaf2 * 1.5, freqs).backward(g)
    assert torch.equal(leaf.grad, leaf2.grad)


def test_inplace_qk():
    q, k, gen, kw = _pair("bshd", 4, 2, torch.float16, seed=6)
    freqs = make_freqs(16, D, gen)
    want_q, want_k = rope.apply_rotary_pos_emb_qk(q, k, freqs, **kw)
    qo, ko = rope.apply_rotary_pos_emb_qk(q, k, freqs, **kw, inplace=True)
    assert qo is q and ko is k
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_inplace_rejects_overlapping_and_leaf():
    gen = torch.Generator().manual_seed(7)
    freqs = make_freqs(16, 16, gen)
    expanded = torch.randn(1, 1, 2, 16, device=DEVICE).expand(S, B, 2, 16)
    with pytest.raises(ValueError, match=r"\bt\b.*overlap"):
        rope.apply_rotary_pos_emb(expanded, freqs, inplace=True)
    leaf = torch.randn(S, B, 2, 16, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match=r"\bt\b.*leaf"):
        rope.apply_rotary_pos_emb(leaf, freqs, inplace=True)
    before = expanded.clone()
    assert torch.equal(expanded, before)


def test_inplace_qk_disjoint_views_of_one_buffer_and_aliasing():
    """q and k sliced out of one fused buffer rotate in place correctly; the same tensor twice is refused."""
    gen = torch.Generator().manual_seed(8)
    qkv = make_t("sbhd", S, B, 6, D, torch.float32, gen)
    q, k = qkv[:, :, :4], qkv[:, :, 4:]  # 4 q heads, 2 k heads, interleaved in memory per token
    freqs = make_freqs(16, D, gen)
    want_q, want_k = rope.apply_rotary_pos_emb(q, freqs), rope.apply_rotary_pos_emb(k, freqs)
    rope.apply_rotary_pos_emb_qk(q, k, freqs, inplace=True)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    every_other = qkv.as_strided((S, B, 2, D), (qkv.stride(0), qkv.stride(1), 2 * D, 1), 2 * D)  # heads 2 and 4
    for other in (q, qkv[:, :, 3:5], every_other):  # the same heads; one head shared; other strides
        before = qkv.clone()
        with pytest.raises(ValueError, match=r"\bk\b.*share memory"):
            rope.apply_rotary_pos_emb_qk(q, other, freqs, inplace=True)
        assert torch.equal(qkv, before)  # refused before anything was written


@pytest.mark.parametrize("seed", range(40))
def test_same_stride_overlap_decision_is_exact(seed):
    """The in-place q/k disjointness search agrees with listing both views' elements."""
    from rope._checks import _same_stride_views_overlap

    rng = random.Random(seed)
    ndim = rng.randint(1, 4)
    shape_q = [rng.randint(1, 4) for _ in range(ndim)]
    shape_k = list(shape_q)
    shape_k[-1] = rng.randint(1, 4)  # head counts differ, in any position the strides put them
    strides = [rng.randint(1, 9) for _ in range(ndim)]
    delta = rng.randint(-40, 40)

    def elements(shape, offset):
        return {offset + sum(i * st for i, st in zip(idx, strides, strict=True))
                for idx in itertools.product(*(range(n) for n in shape))}

    truth = bool(elements(shape_q, 0) & elements(shape_k, delta))
    assert _same_stride_views_overlap(shape_q, shape_k, strides, delta) == truth


def test_inplace_qk_backward_leaves_the_upstream_gradients():
    """In place applies to the forward only: the backward writes new gradients and never rotates the
    upstream gradients it is given."""
    gen = torch.Generator().manual_seed(4)
    leaf_q = torch.randn(3, 2, 4, 8, generator=gen).to(DEVICE).requires_grad_()
    leaf_k = torch.randn(3, 2, 2, 8, generator=gen).to(DEVICE).requires_grad_()
    freqs = (torch.rand(3, 1, 1, 8, generator=gen) * 6).to(DEVICE)
    qo, ko = rope.apply_rotary_pos_emb_qk(leaf_q * 1, leaf_k * 1, freqs, inplace=True)
    gq, gk = torch.randn(qo.shape, generator=gen).to(DEVICE), torch.randn(ko.shape, generator=gen).to(DEVICE)
    gq0, gk0 = gq.clone(), gk.clone()
    torch.autograd.backward((qo, ko), (gq, gk))
    assert torch.equal(gq, gq0) and torch.equal(gk, gk0), "an upstream gradient was overwritten"
    for leaf, g in ((leaf_q, gq0), (leaf_k, gk0)):
        x64 = leaf.detach().double().requires_grad_()
        rope.reference.apply_rotary_pos_emb(x64, freqs).backward(g.double())
        torch.testing.assert_close(leaf.grad.double(), x64.grad, rtol=2**-20, atol=2**-20)


# ---- in place on views of a tensor that requires grad ------------------------------------------

H, HD, T = 2, 8, 5  # heads, head dim, tokens


def _projected(gen, width, lead=(S, B)):
    """A fused projection x @ w that requires grad (a non-leaf): q, k and v are views of it."""
    w = torch.randn(16, width, generator=gen).to(DEVICE).requires_grad_()
    x = torch.randn(*lead, 16, generator=gen).to(DEVICE)
    return w, x @ w


def _views_call(convention, gen):
    """(w, the fused projection, a function rotating views of it in place) for one convention."""
    freqs = make_freqs(16, HD, gen)
    half = (torch.rand(16, HD // 2, generator=gen) * 6).to(DEVICE)
    cache = torch.cat([half.cos(), half.sin()], dim=-1)
    if convention in ("qk", "te"):
        w, y = _projected(gen, 3 * H * HD)
        qkv = y.view(S, B, 3 * H, HD)
        q, k = qkv[:, :, :H], qkv[:, :, H:2 * H]
        if convention == "te":
            return w, y, lambda: rope.apply_rotary_pos_emb(k, freqs, inplace=True)
        return w, y, lambda: rope.apply_rotary_pos_emb_qk(q, k, freqs, inplace=True)
    if convention == "flash":
        w, y = _projected(gen, 3 * H * HD, (B, S))
        x = y.view(B, S, 3 * H, HD)[:, :, H:2 * H]
        return w, y, lambda: rope.flash.apply_rotary_emb(x, half.cos(), half.sin(), inplace=True)
    w, y = _projected(gen, 3 * H * HD, (T,))
    query, key = y[:, :H * HD], y[:, H * HD:2 * H * HD]
    if convention == "vllm":
        positions = torch.randint(0, 16, (T,), generator=gen).to(DEVICE)
        return w, y, lambda: rope.vllm.rotary_embedding(positions, query, key, HD, cache, True)
    positions = torch.randint(0, 16, (3, T), generator=gen).to(DEVICE)
    return w, y, lambda: rope.vllm.mrotary_embedding(positions, query, key, HD, cache, [2, 1, 1])


VIEW_CONVENTIONS = ["qk", "te", "flash", "vllm", "vllm-mrope"]


@pytest.mark.parametrize("convention", VIEW_CONVENTIONS)
def test_inplace_on_views_of_a_grad_tensor(convention):
    """The fused-QKV training pattern: q and k are views of one projection that requires grad, rotated in
    place. The kernel path gives the reference path's values and gradients (autograd rebases a view's
    history only for a Function of one output: q and k then take one launch each)."""
    results = []
    for on in (False, True):
        gen = torch.Generator().manual_seed(11)
        w, y, call = _views_call(convention, gen)
        g = torch.randn(y.shape, generator=gen).to(DEVICE)
        with reference_path(on):
            call()
        (y * g).sum().backward()
        results.append((y.detach(), w.grad))
    (y_kernel, grad_kernel), (y_ref, grad_ref) = results
    torch.testing.assert_close(y_kernel, y_ref)
    torch.testing.assert_close(grad_kernel, grad_ref)


def _refused_view(kind, gen):
    """(the tensor whose memory the views share, the views' call, the argument named) of an in-place call
    that autograd does not allow: on a view of a leaf that requires grad, or on an output of split."""
    if kind.endswith("leaf"):
        base = torch.randn(S, B, 3 * H, HD, generator=gen).to(DEVICE).requires_grad_()
        parts = base[:, :, :H], base[:, :, H:2 * H]
    else:
        base = torch.randn(S, B, 3 * H, HD, generator=gen).to(DEVICE).requires_grad_() * 1
        parts = base.split(H, dim=2)[:2]
    freqs = make_freqs(16, HD, gen)
    half = (torch.rand(16, HD // 2, generator=gen) * 6).to(DEVICE)
    if kind.startswith("qk"):
        # only k is refused: q must not be written either
        q = torch.randn(S, B, H, HD, generator=gen).to(DEVICE).requires_grad_() * 1
        return base, lambda: rope.apply_rotary_pos_emb_qk(q, parts[1], freqs, inplace=True), "k"
    if kind.startswith("flash"):
        return base, lambda: rope.flash.apply_rotary_emb(parts[0].transpose(0, 1), half.cos(), half.sin(),
                                                         inplace=True), "x"
    if kind.startswith("vllm"):
        flat = base.flatten(2)  # [S, B, 3 * H * HD]: tokens S * B
        positions = torch.zeros(S, B, dtype=torch.int64, device=DEVICE)
        cache = torch.cat([half.cos(), half.sin()], dim=-1)
        query = flat[..., :H * HD]
        return base, lambda: rope.vllm.rotary_embedding(positions, query, None, HD, cache, True), "query"
    return base, lambda: rope.apply_rotary_pos_emb(parts[0], freqs, inplace=True), "t"


@pytest.mark.parametrize("on", [False, True], ids=["kernel", "reference"])
@pytest.mark.parametrize("kind", ["te-leaf", "te-split", "qk-leaf", "qk-split", "flash-leaf", "flash-split",
                                  "vllm-leaf"])
def test_inplace_on_views_autograd_refuses_writes_nothing(kind, on):
    """Where autograd refuses to rebase a view written in place, every path refuses before writing, with
    a ValueError naming the argument (autograd itself would refuse only after the kernel ran)."""
    gen = torch.Generator().manual_seed(12)
    base, call, name = _refused_view(kind, gen)
    before = base.detach().clone()
    with reference_path(on), pytest.raises(ValueError, match=rf"^{name}: in-place rotation of a .*(leaf|view)"):
        call()
    assert torch.equal(base.detach(), before), "written before the error"


def test_packed_head_slices_with_one_key_head_are_disjoint():
    """vLLM's query and key as head slices of one packed buffer, key with one head (GQA/MQA): a view gives a dim of
    size 1 any stride, so the two strides differ there though only the other view's stride matters. Accepted, and
    rotated as separate tensors are."""
    gen = torch.Generator().manual_seed(5)
    packed = torch.randn(3, 4, 3, generator=gen).to(DEVICE)  # [T, heads, head stride 3], channels 0..1 used
    query, key = packed[:, :2, :2], packed[:, 2:3, :2].reshape(3, 1, 2)
    assert query.stride()[1] != key.stride()[1]
    cache = torch.randn(8, 2, generator=gen).to(DEVICE)
    positions = torch.tensor([0, 5, 7], device=DEVICE)
    want_q, want_k = query.clone(), key.clone()
    rope.vllm.rotary_embedding(positions, want_q, want_k, 2, cache, True)
    rope.vllm.rotary_embedding(positions, query, key, 2, cache, True)
    assert torch.equal(query, want_q) and torch.equal(key, want_k)
