"""rope.qknorm beyond the native suite (tests/conformance, conventions qknorm and vllm-qknorm): bad input refused
before anything is written, the three entry points agreeing with each other, the weight gradient deterministic,
q and k given as transformers has them before and after the transpose, and torch.compile."""
from __future__ import annotations

import pytest
import torch

import rope
import rope.qknorm as qn

from .cases import DEVICE, gpu_decomposition, poison_outputs  # noqa: F401 - fixtures


def _qkv(t=5, hq=3, hk=2, hv=2, d=10, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)

    rot = 8
    theta = torch.rand(16, rot // 2, generator=gen) * 20
    cache = torch.cat([theta.cos(), theta.sin()], -1).to(DEVICE)
    pos = torch.randint(0, 16, (t,), generator=gen).to(DEVICE)
    return r(t, (hq + hk + hv) * d), r(d), r(d), cache, pos


def _vllm_args(**over):
    qkv, wq, wk, cache, pos = _qkv()
    args = dict(qkv=qkv, num_heads_q=3, num_heads_k=2, num_heads_v=2, head_dim=10, eps=1e-6, q_weight=wq,
                k_weight=wk, cos_sin_cache=cache, is_neox=True, position_ids=pos)
    args.update(over)
    return args


BAD = [
    ("q_weight", TypeError, dict(q_weight=torch.randn(10).double())),
    ("k_weight", ValueError, dict(k_weight=torch.randn(12))),
    ("k_weight", TypeError, dict(k_weight=[1.0] * 10)),
    ("eps", ValueError, dict(eps=0.0)),
    ("eps", ValueError, dict(eps=-1e-6)),
    ("eps", ValueError, dict(eps=float("nan"))),
    ("qkv", ValueError, dict(num_heads_v=3)),
    ("num_heads_q", ValueError, dict(num_heads_q=0)),
    ("qkv", TypeError, dict(qkv=torch.randn(5, 70, dtype=torch.float64))),
    ("position_ids", ValueError, dict(position_ids=torch.tensor([0, 1, 2, 3, 99]))),
    ("cos_sin_cache", ValueError, dict(cos_sin_cache=torch.randn(16, 12))),
    ("is_neox", TypeError, dict(is_neox=1)),
]


@pytest.mark.parametrize("name,exc,over", BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_vllm_bad_input_refused_before_writing(name, exc, over):
    args = _vllm_args(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in over.items()})
    before = args["qkv"].clone()
    with pytest.raises(exc) as err:
        qn.fused_qk_norm_rope(**args)
    assert str(err.value).startswith(name), str(err.value)
    assert torch.equal(args["qkv"], before), "qkv was written before the error"


def test_apply_bad_input():
    q, k = torch.randn(1, 3, 2, 8, device=DEVICE), torch.randn(1, 3, 1, 8, device=DEVICE)
    cos = torch.randn(1, 3, 8, device=DEVICE)
    w = torch.randn(8, device=DEVICE)
    for over, name in ((dict(q_weight=w[:4]), "q_weight"), (dict(eps=0), "eps"), (dict(gemma="yes"), "gemma"),
                       (dict(cos=cos[..., :7], sin=cos[..., :7]), "cos"), (dict(unsqueeze_dim=3), "unsqueeze_dim")):
        args = {**dict(q=q, k=k, q_weight=w, k_weight=w, cos=cos, sin=cos, eps=1e-6, unsqueeze_dim=2), **over}
        with pytest.raises((TypeError, ValueError)) as err:
            qn.apply(**args)
        assert str(err.value).startswith(name), str(err.value)


def test_entry_points_agree_and_v_untouched():
    """vLLM's in-place op, apply_cache and apply (the cache's rows gathered as transformers' tables) give the same
    bits; v's heads stay as they were."""
    qkv, wq, wk, cache, pos = _qkv(dtype=torch.bfloat16)
    d, hq, hk = 10, 3, 2
    heads = qkv.unflatten(1, (7, d))
    q, k = heads[:, :hq].clone(), heads[:, hq:hq + hk].clone()
    v = heads[:, hq + hk:].clone()
    qa, ka = qn.apply_cache(q, k, wq, wk, pos, cache, eps=0.1)
    rows = cache[pos]
    cos, sin = (torch.cat([t, t], -1)[None] for t in (rows[:, :4], rows[:, 4:]))
    qb, kb = qn.apply(q[None], k[None], wq, wk, cos, sin, eps=0.1, unsqueeze_dim=2)
    qn.fused_qk_norm_rope(qkv, hq, hk, 2, d, 0.1, wq, wk, cache, True, pos)
    heads = qkv.unflatten(1, (7, d))
    assert torch.equal(heads[:, :hq], qa) and torch.equal(heads[:, hq:hq + hk], ka)
    assert torch.equal(qb[0], qa) and torch.equal(kb[0], ka)
    assert torch.equal(heads[:, hq + hk:], v)


def test_transformers_layouts_and_deterministic_weight_grad():
    """[b, s, h, d] (before the transpose, unsqueeze_dim=2) and [b, h, s, d] (after, 1) give the same bits, forward
    and backward; two backward passes give bitwise equal weight gradients."""
    gen = torch.Generator().manual_seed(1)
    b, s, hq, hk, d = 2, 3, 4, 2, 16
    q = torch.randn(b, s, hq, d, generator=gen).to(DEVICE)
    k = torch.randn(b, s, hk, d, generator=gen).to(DEVICE)
    th = torch.rand(1, s, d // 2, generator=gen).to(DEVICE) * 9
    cos, sin = torch.cat([th.cos()] * 2, -1), torch.cat([th.sin()] * 2, -1)
    w = torch.randn(2, d, generator=gen).to(DEVICE)
    grads = []
    for ud in (2, 1, 1):
        leaves = [q.clone().requires_grad_(), k.clone().requires_grad_(), w[0].clone().requires_grad_(),
                  w[1].clone().requires_grad_()]
        qi, ki = (leaves[0], leaves[1]) if ud == 2 else (leaves[0].transpose(1, 2), leaves[1].transpose(1, 2))
        qo, ko = qn.apply(qi, ki, leaves[2], leaves[3], cos, sin, eps=1e-5, unsqueeze_dim=ud)
        if ud == 1:
            qo, ko = qo.transpose(1, 2), ko.transpose(1, 2)
        (qo * torch.arange(d, device=DEVICE)).sum().add((ko * 0.5).sum()).backward()
        grads.append([qo.detach(), ko.detach()] + [t.grad for t in leaves])
    for g0, g1, g2 in zip(*grads, strict=True):
        assert torch.equal(g0, g1) and torch.equal(g1, g2)


def test_compile_traces_and_matches_eager():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 3, 8, generator=gen).to(DEVICE)
    k = torch.randn(1, 4, 1, 8, generator=gen).to(DEVICE)
    th = torch.rand(1, 4, 4, generator=gen).to(DEVICE)
    cos, sin = torch.cat([th.cos()] * 2, -1), torch.cat([th.sin()] * 2, -1)
    w = torch.randn(8, generator=gen).to(DEVICE)

    def layer(q, k):
        qo, ko = qn.apply(q * 2.0, k, w, w, cos, sin, eps=1e-6, unsqueeze_dim=2, gemma=True)
        return qo.sum() + ko.sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k), layer(q, k), rtol=1e-5, atol=1e-5)


def _mrope_case(interleaved, is_neox, t=6, hq=3, hk=2, d=20, rot=16, seed=3):
    """q, k [T, h, d] (partial rotary: rot < d), weights, a cache [64, rot] of random angles, positions [3, T] whose
    three streams differ at every token, and a section valid in the mode (4 + 2 + 2 = rot / 2 pairs)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hq, d, generator=gen), torch.randn(t, hk, d, generator=gen)
    wq, wk = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    theta = torch.rand(64, rot // 2, generator=gen) * 20
    cache = torch.cat([theta.cos(), theta.sin()], -1)
    pos = torch.stack([torch.randperm(64, generator=gen)[:t] for _ in range(3)])
    return [x.to(DEVICE) for x in (q, k, wq, wk, cache, pos)]


@pytest.mark.parametrize("interleaved", [False, True], ids=["sections", "interleaved"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_apply_cache_mrope_is_norm_then_mrotary_embedding(interleaved, is_neox):
    """Fused = RMSNorm (float64, rounded to float32 once) then rope.vllm.mrotary_embedding at the same [3, T]
    positions and section; backward as the PyTorch path's. Tolerance: both sides are float32 rotations of the same
    normalised values, which differ by the fused kernel's float32 norm (mean of d squares and rsqrt: a few float32
    ulps, ~1e-6 relative) against the float64 one; |cos| + |sin| <= sqrt 2 and |x r w| < ~10 keep it below 1e-5."""
    from rope.vllm import mrotary_embedding

    q, k, wq, wk, cache, pos = _mrope_case(interleaved, is_neox)
    section = [4, 2, 2]
    leaves = [x.clone().requires_grad_() for x in (q, k, wq, wk)]
    qo, ko = qn.apply_cache(*leaves, pos, cache, eps=1e-5, is_neox=is_neox, mrope_section=section,
                            mrope_interleaved=interleaved)
    normed = [(x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True) + 1e-5) * w.double()).float()
              for x, w in ((q, wq), (k, wk))]
    mrotary_embedding(pos, normed[0], normed[1], q.shape[-1], cache, section, is_neox, interleaved)
    torch.testing.assert_close(qo, normed[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko, normed[1], rtol=1e-5, atol=1e-5)
    (qo * torch.arange(q.shape[-1], device=DEVICE)).sum().add(ko.square().sum()).backward()
    ref = [x.clone().requires_grad_() for x in (q, k, wq, wk)]
    streams = (2 if interleaved else 1, *section)
    qr, kr = qn._reference_cache(tuple(ref), (cache[:, :8], cache[:, 8:], pos), (not is_neox, False, 1e-5, streams),
                                  False)
    (qr * torch.arange(q.shape[-1], device=DEVICE)).sum().add(kr.square().sum()).backward()
    for a, b in zip(leaves, ref, strict=True):  # float32 sums over <= 60 terms of O(10): ~1e-5 relative
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("interleaved", [False, True], ids=["sections", "interleaved"])
def test_apply_cache_mrope_each_pair_reads_its_own_stream(interleaved):
    """Moving one stream's positions changes exactly the pairs of that stream (both channels of each), in q and
    k alike: a kernel that reads only stream 0 (the fused norm+RoPE bug of SGLang #35345) leaves streams 1 and 2's
    pairs unchanged and moves all pairs with stream 0."""
    _assert_pairs_follow_streams(interleaved)


def test_apply_cache_mrope_stream_zero_only_is_caught(monkeypatch):
    """Planted bug: the norm launch given stream stride 0, so every pair reads the temporal row (the kernel's
    streams still select sections, all at stream 0's position); the locality property above must fail."""
    import rope._launch as launch

    if not rope._backend.on_kernel_device(torch.empty(1, device=DEVICE)):
        pytest.skip("the PyTorch path has no launch to plant the bug in")
    strides = launch._pos_strides
    monkeypatch.setattr(launch, "_pos_strides", lambda positions: (0, *strides(positions)[1:]))
    for interleaved in (False, True):
        with pytest.raises(AssertionError):
            _assert_pairs_follow_streams(interleaved)


def _assert_pairs_follow_streams(interleaved):
    from rope.reference import section_of_pair

    q, k, wq, wk, cache, pos = _mrope_case(interleaved, True)
    section, pairs = [4, 2, 2], 8
    base = qn.apply_cache(q, k, wq, wk, pos, cache, mrope_section=section, mrope_interleaved=interleaved)
    owner = section_of_pair(section, pairs, interleaved)
    for m in range(3):
        moved = pos.clone()
        moved[m] = (moved[m] + 17) % 64
        out = qn.apply_cache(q, k, wq, wk, moved, cache, mrope_section=section, mrope_interleaved=interleaved)
        for before, after in zip(base, out, strict=True):
            changed = (before != after).any(dim=(0, 1))
            pair_changed = changed[:pairs] | changed[pairs:2 * pairs]  # neox pairs (i, i + rot/2)
            assert torch.equal(pair_changed.cpu(), owner == m), (m, pair_changed, owner)
            assert not changed[2 * pairs:].any(), "the unrotated channels moved"


def test_apply_cache_text_positions_unchanged_by_section():
    """[T] positions with a section are one stream for all three: the same bits as without a section."""
    q, k, wq, wk, cache, pos = _mrope_case(False, True)
    for interleaved in (False, True):
        a = qn.apply_cache(q, k, wq, wk, pos[1], cache, mrope_section=[4, 2, 2], mrope_interleaved=interleaved)
        b = qn.apply_cache(q, k, wq, wk, pos[1], cache)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


MROPE_BAD = [
    ("mrope_section", ValueError, dict(mrope_section=[4, 2, 1])),
    ("mrope_section", ValueError, dict(mrope_section=[4, 4])),
    ("mrope_section", ValueError, dict(mrope_section=[2, 4, 2], mrope_interleaved=True)),
    ("positions", ValueError, dict(mrope_section=None)),
    ("positions", ValueError, dict(positions="3d")),
    ("positions", ValueError, dict(positions="2xT")),
    ("positions", TypeError, dict(positions="float")),
    ("mrope_interleaved", TypeError, dict(mrope_interleaved=1)),
    ("mrope_interleaved", ValueError, dict(mrope_section=None, mrope_interleaved=True)),
    ("positions", ValueError, dict(positions="out")),
    ("q", TypeError, dict(q="double")),
]


@pytest.mark.parametrize("name,exc,over", MROPE_BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(MROPE_BAD)])
def test_apply_cache_mrope_bad_input(name, exc, over):
    q, k, wq, wk, cache, pos = _mrope_case(False, True)
    forms = {"3d": pos[..., None], "2xT": pos[:2], "float": pos.float(), "out": pos + 64, "double": q.double()}
    args = dict(q=q, k=k, q_weight=wq, k_weight=wk, positions=pos, cos_sin_cache=cache, mrope_section=[4, 2, 2])
    args.update({key: forms.get(v, v) if isinstance(v, str) else v for key, v in over.items()})
    before = [x.clone() for x in (q, k, pos)]
    with pytest.raises(exc) as err:
        qn.apply_cache(**args)
    assert str(err.value).startswith(name), str(err.value)
    assert all(torch.equal(x, y) for x, y in zip((q, k, pos), before, strict=True))


def _in_buffer(x: torch.Tensor, buffer: str) -> torch.Tensor:
    """x's values in a new tensor of the same shape: contiguous, with its rows padded (3 spare channels after each
    head), or contiguous but one element past a 16-byte boundary (neither vector loads nor 16-byte divisible
    pointers are possible)."""
    if buffer == "contiguous":
        return x.clone()
    if buffer == "row-padded":
        wide = torch.empty(*x.shape[:-1], x.shape[-1] + 3, dtype=x.dtype, device=x.device)
        wide[..., :x.shape[-1]] = x
        return wide[..., :x.shape[-1]]
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    out = flat[1:].view(x.shape)
    out.copy_(x)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_rows_bitwise_whatever_their_buffer(dtype, d, interleaved):
    """A head's outputs and its input gradients are bitwise the same whether q and k lie contiguous, in row-padded
    buffers or misaligned: the compiled variant (and with it the tile's register layout, which Triton picks by the
    rows' alignment) must not change the norm's order of summation (docs/contract.md, "Batch invariant"), forward or
    backward. Only a GPU can fail it: the interpreter adds in one order whatever the layout. (On the H200 these
    tiles kept `tl.sum`'s order across the three buffers; the packed qkv below is where it changed.)"""
    gen = torch.Generator().manual_seed(d)
    b, s, hq, hk = 4, (64 if DEVICE == "cuda" else 3), 1, 5
    q = torch.randn(b, s, hq, d, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(b, s, hk, d, generator=gen).to(dtype).to(DEVICE)
    th = (torch.rand(b, s, d // 2, generator=gen) * 9).to(DEVICE)
    twice = (lambda t: t.repeat_interleave(2, -1)) if interleaved else (lambda t: torch.cat([t, t], -1))
    cos, sin = twice(th.cos()).to(dtype), twice(th.sin()).to(dtype)
    wq, wk = (torch.randn(d, generator=gen).to(DEVICE) for _ in range(2))
    up_q = torch.randn(q.shape, generator=gen).to(dtype).to(DEVICE)
    up_k = torch.randn(k.shape, generator=gen).to(dtype).to(DEVICE)
    results = {}
    for buffer in ("contiguous", "row-padded", "misaligned"):
        qi = _in_buffer(q, buffer).requires_grad_()
        ki = _in_buffer(k, buffer).requires_grad_()
        qo, ko = qn.apply(qi, ki, wq, wk, cos, sin, eps=1e-6, unsqueeze_dim=2, interleaved=interleaved)
        torch.autograd.backward((qo, ko), (up_q, up_k))
        results[buffer] = (qo.detach(), ko.detach(), qi.grad, ki.grad)
    for buffer in ("row-padded", "misaligned"):
        for name, want, got in zip(("q", "k", "grad q", "grad k"), results["contiguous"], results[buffer],
                                   strict=True):
            differ = (got != want).sum().item()
            assert differ == 0, f"{name}: {differ} of {want.numel()} elements differ, {buffer} against contiguous"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_packed_rows_bitwise_whatever_their_buffer(dtype, d, is_neox):
    """vLLM's in-place op on a packed qkv, as the GPU suite's `batch_rows_alone` of `vllm-qknorm` drew it (float32
    weights, a bfloat16 cache, one q head and five k heads): every row bitwise the same whether qkv is contiguous,
    its rows padded (a slice of a wider buffer) or misaligned by one element. Summed by `tl.sum` (the tile's
    register layout), the H200 failed the four float16 cases: 5 of 163840 elements differed, row-padded against
    contiguous. Only a GPU can fail it."""
    gen = torch.Generator().manual_seed(d + is_neox)
    t, hq, hk, hv = (256 if DEVICE == "cuda" else 3), 1, 5, 2
    width = (hq + hk + hv) * d
    qkv = torch.randn(t, width, generator=gen).to(dtype).to(DEVICE)
    wq, wk = (torch.randn(d, generator=gen).to(DEVICE) for _ in range(2))
    theta = torch.rand(512, d // 2, generator=gen) * 30
    cache = torch.cat([theta.cos(), theta.sin()], -1).to(torch.bfloat16).to(DEVICE)
    pos = torch.randint(0, 512, (t,), generator=gen).to(DEVICE)
    results = {}
    for buffer in ("contiguous", "row-padded", "misaligned"):
        x = _in_buffer(qkv, buffer)
        qn.fused_qk_norm_rope(x, hq, hk, hv, d, 1e-6, wq, wk, cache, is_neox, pos)
        results[buffer] = x.clone()
    for buffer in ("row-padded", "misaligned"):
        differ = (results[buffer] != results["contiguous"]).sum().item()
        assert differ == 0, f"{differ} of {qkv.numel()} elements differ, {buffer} against contiguous"


@pytest.mark.parametrize("hq,hk,table,many", [(16, 4, False, True), (3, 2, False, False), (16, 4, True, False)])
def test_apply_freqs_programs_of_one_and_of_several_tiles(hq, hk, table, many, monkeypatch,
                                                          poison_outputs, gpu_decomposition):  # noqa: F811
    """The forward's programs hold a token's q and k rows in one tile, or in several (rows_per_program over BLOCK_R:
    the kernel compiles its loop over further tiles only then, MULTI_TILE). With the launcher's work split as on a
    GPU of one SM (8 programs' worth: 8 tokens), angles evaluated from freqs (no table: CUDA graph capture,
    inference tensors) give a program a whole token, 20 rows in three 8-row tiles or 5 rows in one; read from the
    angle table, a program is one tile. Each case is checked to take its path, then against the float64 definition
    on NaN-filled outputs: the rows of a program's later tiles are nowhere else, and a plan that skips them leaves
    NaN."""
    from rope import _launch

    monkeypatch.setattr(_launch, "_sm_count", lambda device: 1)
    plans = []
    launch = _launch.run

    def run(plan, pointers):
        plans.append(plan)
        launch(plan, pointers)

    monkeypatch.setattr(_launch, "run", run)
    gen = torch.Generator().manual_seed(hq)
    s, d, eps = 8, 16, 1e-6
    q, k = (torch.randn(s, 1, h, d, generator=gen).to(DEVICE) for h in (hq, hk))
    wq, wk = (torch.randn(d, generator=gen).to(DEVICE) for _ in range(2))
    freqs = (torch.rand(s, 1, 1, d, generator=gen) * 10).to(DEVICE)
    rope.set_angle_table(table)
    try:
        qo, ko = qn.apply_freqs(q, k, wq, wk, freqs, "sbhd", eps=eps)
    finally:
        rope.set_angle_table(True)
    (plan,) = plans
    rows_per_program, block_r = plan.arg("rows_per_program"), plan.arg("BLOCK_R")
    assert plan.arg("TABLE") == table and (rows_per_program > block_r) == many, (rows_per_program, block_r)
    cos, sin = freqs.double().cos(), freqs.double().sin()
    for name, x, w, got in (("q", q, wq, qo), ("k", k, wk, ko)):
        x64 = x.double()
        normed = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * w.double()
        want = rope.reference.rotate(normed, cos, sin, False)
        # float32 arithmetic over a 16-channel head: the mean of squares, its rsqrt and three products each add a
        # few float32 rounding errors (6e-8 relative); 1e-5 of |value| + 1e-5 leaves two orders of magnitude
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
