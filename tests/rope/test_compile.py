"""torch.compile: the kernel as a custom op (docs/contract.md section 7).

A model using rope compiles with fullgraph=True (no graph breaks), matches eager bitwise forward
and backward, recompiles nothing when only s or b change, and the op passes torch.library.opcheck
(schema, fake implementation, AOT dispatch). Every convention's kernel call traces as the same op,
`rope::rotate` (`rope::rotate_` in place). The op has no autograd of its own: traced code records it in
`rope._backend.Rotation` (`NormRotation` for QK norm), whose backward the compiled-against-eager tests check.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import rope

from .cases import DEVICE, ON_GPU, make_freqs, make_t


# h and d differ from every s, b, s*b and b+1 the recompile test draws: Dynamo's duck sizing guards
# on equal sizes (d == s*b, say), which would recompile for reasons that have nothing to do with rope.
def _inputs(tensor_format, s, b, seed=0, dtype=torch.float32, h=7, d=40):
    gen = torch.Generator().manual_seed(seed)
    t = make_t(tensor_format, s * (b if tensor_format == "thd" else 1), b, h, d, dtype, gen)
    return t, make_freqs(64, d, gen)


OPCHECK_CASES = [
    dict(tensor_format="sbhd"),
    dict(tensor_format="bshd", interleaved=True),
    dict(tensor_format="sbhd", start_positions="start"),
    dict(tensor_format="sbhd", cp_size=2, cp_rank=1),
    dict(tensor_format="thd", cu_seqlens=[0, 3, 3, 8]),
]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_opcheck(case, backward):
    case = dict(case)
    fmt = case.pop("tensor_format")
    t, freqs = _inputs(fmt, 8 if fmt != "thd" else 8, 2 if fmt != "thd" else 1)
    start = torch.randint(0, 4, (t.shape[0 if fmt == "bshd" else 1],), device=DEVICE) if case.pop(
        "start_positions", None) else None
    cu = case.pop("cu_seqlens", None)
    cu = torch.tensor(cu, dtype=torch.int32, device=DEVICE) if cu is not None else None
    flags = (fmt, case.get("interleaved", False), case.get("cp_size", 1), case.get("cp_rank", 0))
    args = ("te", [t], [freqs, start, cu, None, None], repr(flags), backward)
    torch.library.opcheck(torch.ops.rope.rotate.default, args)


def _permuted_cases():
    """Conventions whose outputs keep the input's memory order (`empty_like`'s), each given such an input: q and k
    (x) contiguous [b, h, s, d] in the kernel's [b, s, h, d] roles; and q a padded one (not dense)."""
    gen = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, h, 5, 8, generator=gen).to(DEVICE).transpose(1, 2) for h in (3, 1))
    ang = torch.rand(2, 5, 4, generator=gen).to(DEVICE)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    yield "hf", [q, k], [cos, sin], repr((False, None, None, False))
    padded = torch.randn(2, 3, 5, 16, generator=gen).to(DEVICE)[..., :8].transpose(1, 2)  # not dense: x's order
    yield "hf-padded", [padded, k], [cos, sin], repr((False, None, None, False))
    yield "flash", [q], [ang[0].cos(), ang[0].sin(), None, None], repr(("bshd", False))
    yield "deepseek-v4", [q], [ang.cos()[..., :2], ang.sin()[..., :2]], repr(())


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("case", list(_permuted_cases()), ids=lambda c: c[0])
def test_opcheck_keeps_the_memory_order(case, backward):
    """The custom op's fake outputs have the strides the kernel gives (the input's memory order), which
    `torch.compile` plans later operations by; opcheck compares them with the real op's."""
    name, ts, reads, flags = case
    torch.library.opcheck(torch.ops.rope.rotate.default, (name.removesuffix("-padded"), ts, reads, flags, backward))


def test_opcheck_inplace():
    """The in-place op (vLLM's rotary_embedding: q and k written at positions of its cos/sin cache)."""
    gen = torch.Generator().manual_seed(2)
    ang = torch.rand(9, 4, generator=gen) * 6
    q, k = torch.randn(5, 2, 8, generator=gen).to(DEVICE), torch.randn(5, 1, 8, generator=gen).to(DEVICE)
    positions = torch.randint(0, 9, (5,), generator=gen).to(DEVICE)
    flags = repr((False, (0, 0, 0, 0), None, False))  # vLLM's: (interleaved, streams, schedule, inverse)
    args = ("vllm", [q, k], [ang.cos().to(DEVICE), ang.sin().to(DEVICE), positions], flags)
    torch.library.opcheck(torch.ops.rope.rotate_.default, args)


def _layer(x, freqs, cu_seqlens=None, tensor_format="sbhd", interleaved=False):
    # Work around the op too, so the compiled graph is a real graph and not just the op.
    y = rope.apply_rotary_pos_emb(x * 2.0, freqs, tensor_format=tensor_format, interleaved=interleaved,
                                  cu_seqlens=cu_seqlens)
    return torch.tanh(y)


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halfsplit", "interleaved"])
def test_fullgraph_matches_eager_and_never_recompiles(tensor_format, interleaved):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_layer, backend=counter, fullgraph=True, dynamic=True)
    # s and b change, never to 0 or 1 (those are specialized by Dynamo itself, for any model)
    for i, (s, b) in enumerate([(8, 2), (12, 2), (12, 3), (6, 4)]):
        t, freqs = _inputs(tensor_format, s, b, seed=i)
        cu = None
        if tensor_format == "thd":
            cu = torch.arange(0, s * b + 1, s, dtype=torch.int32, device=DEVICE)  # b sequences of s tokens
        x1 = t.clone().requires_grad_()
        x2 = t.clone().requires_grad_()
        kw = dict(cu_seqlens=cu, tensor_format=tensor_format, interleaved=interleaved)
        y1 = compiled(x1, freqs, **kw)
        y2 = _layer(x2, freqs, **kw)
        g = torch.randn(y1.shape, generator=torch.Generator().manual_seed(100 + i)).to(DEVICE)
        y1.backward(g)
        y2.backward(g)
        assert torch.equal(y1, y2)
        assert torch.equal(x1.grad, x2.grad)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_compiled_errors_on_bad_input():
    compiled = torch.compile(_layer, backend="eager", fullgraph=True)
    t, freqs = _inputs("sbhd", 8, 2)
    with pytest.raises(Exception, match="freqs"):
        compiled(t, freqs[:4])  # positions reach 7, freqs has 4 rows


def _exact_layer(x, freqs):
    # Inductor fuses elementwise ops and rounds once where eager rounds after each op, so around a
    # nonlinearity (tanh' = 1 - y^2 cancels near |y| = 1) compiled and eager bf16 legitimately differ
    # by many ulps. Scaling by powers of two rounds exactly in both, so any difference is the op's.
    return rope.apply_rotary_pos_emb(x * 2.0, freqs) * 0.5


@pytest.mark.skipif(not ON_GPU, reason="inductor on the CPU compiles C++ for minutes; checked on the GPU")
def test_inductor_fullgraph():
    compiled = torch.compile(_exact_layer, fullgraph=True, dynamic=True)
    t, freqs = _inputs("sbhd", 64, 4, dtype=torch.bfloat16, h=8, d=128)
    x1, x2 = t.clone().requires_grad_(), t.clone().requires_grad_()
    y1, y2 = compiled(x1, freqs), _exact_layer(x2, freqs)
    g = torch.randn(y1.shape, generator=torch.Generator().manual_seed(1)).to(y1)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(y1, y2)
    assert torch.equal(x1.grad, x2.grad)


def test_conventions_trace_in_one_graph():
    """Traced, several conventions (transformers', multimodal) in one function: no graph break with fullgraph=True,
    and the eager result."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 5, 8, generator=gen).to(DEVICE)
    k = torch.randn(1, 1, 5, 8, generator=gen).to(DEVICE)
    ang = (torch.rand(3, 1, 5, 4, generator=gen) * 6).to(DEVICE)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    t = torch.randn(5, 2, 8, generator=gen).to(DEVICE)
    freqs = (torch.rand(9, 1, 1, 8, generator=gen) * 6).to(DEVICE)
    positions = torch.randint(0, 9, (3, 5), generator=gen).to(DEVICE)

    def step(q, k, cos, sin, t, freqs, positions):
        a = rope.hf.apply_rotary_pos_emb(q, k, cos[0], sin[0])
        b = rope.hf.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [2, 1, 1])
        c = rope.mrope.apply_multimodal_rotary_pos_emb(t, freqs, positions, [2, 1, 1])
        return (*a, *b, c)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(q, k, cos, sin, t, freqs, positions), step(q, k, cos, sin, t, freqs, positions),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=2**-20, atol=2**-20)  # float32 evaluations of one map


def test_traced_after_eager_with_the_same_index_tensors():
    """An eager call first memoises that its positions passed the value checks; a traced call with the same tensors
    must not consult that memo (a weak reference and a version counter have no graph), so no graph break."""
    gen = torch.Generator().manual_seed(5)
    query, key = torch.randn(5, 2 * 8, generator=gen).to(DEVICE), torch.randn(5, 8, generator=gen).to(DEVICE)
    ang = torch.rand(9, 4, generator=gen) * 6
    cache = torch.cat([ang.cos(), ang.sin()], -1).to(DEVICE)
    positions = torch.randint(0, 9, (5,), generator=gen).to(DEVICE)
    t = torch.randn(5, 2, 8, generator=gen).to(DEVICE)
    freqs = (torch.rand(9, 1, 1, 8, generator=gen) * 6).to(DEVICE)
    start = torch.tensor([2], device=DEVICE)

    def step(query, key, t):
        q, k = query.clone(), key.clone()
        rope.vllm.rotary_embedding(positions, q, k, 8, cache, True)
        return q, k, rope.apply_rotary_pos_emb(t[:, None], freqs, "sbhd", start_positions=start, fused=False)

    want = step(query, key, t)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for got, w in zip(compiled(query, key, t), want, strict=True):
        torch.testing.assert_close(got, w, rtol=2**-20, atol=2**-20)  # float32 evaluations of one map


# Every convention under torch.compile: the kernel is the one custom op (rope::rotate, or rope::rotate_ in place)
# in the traced graph, and the compiled result and gradients are the eager kernel's, bit for bit (the op runs the
# same launch on the same tensors).


def _recording_backend():
    """aot_eager that keeps the forward and backward graphs AOTAutograd makes (after functionalization: an in-place
    op appears inside auto_functionalized)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {"forward": [], "backward": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")), graphs


def rope_ops(graphs) -> int:
    """How many calls of rope's custom ops the graphs hold."""
    ops = (torch.ops.rope.rotate.default, torch.ops.rope.rotate_.default)
    n = 0
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.target in ops or (node.op == "call_function" and "auto_functionalized" in str(node.target) and
                                      node.args and node.args[0] in ops):
                n += 1
    return n


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=_g(seed)).to(DEVICE)


def _tables(rows, width, seed=0, per_pair=False, lead=()):
    ang = torch.rand(*lead, rows, width // 2, generator=_g(seed)) * 6
    if not per_pair:
        ang = torch.cat([ang, ang], -1)
    return ang.cos().to(DEVICE), ang.sin().to(DEVICE)


def _vllm_cache(rows=9, rot=8, seed=3):
    ang = torch.rand(rows, rot // 2, generator=_g(seed)) * 6
    return torch.cat([ang.cos(), ang.sin()], -1).to(DEVICE)


def _positions(*shape, rows=9, seed=4):
    return torch.randint(0, rows, shape, generator=_g(seed)).to(DEVICE)


def _hf_case(fn, **kw):
    cos, sin = _tables(5, 8, lead=(1,))
    return lambda q, k: fn(q, k, cos, sin, **kw), [_rand(1, 2, 5, 8), _rand(1, 1, 5, 8, seed=1)]


def _deepseek_v4():
    cos, sin = _tables(5, 4, per_pair=True, lead=(1,))  # [1, 5, 2]: one column per pair, the trailing 4 of 8 rotated
    return lambda x: rope.deepseek.apply_rotary_pos_emb(x, cos, sin), [_rand(1, 2, 5, 8)]


def _megatron(thd):
    """Megatron's in place form on a projection's output (not a leaf, as its callers pass it): the trailing 8 of 12
    channels; sbhd by the inverse rotation, thd on rank 1 of 2 with a padding row, written back interleaved."""
    cos, sin = _tables(9, 8)
    if thd:
        cu = torch.tensor([0, 4, 8], dtype=torch.int32, device=DEVICE)
        kw, x = dict(cu_seqlens_q=cu, cp_rank=1, cp_size=2, remove_interleaving=True), _rand(5, 2, 12)
    else:
        kw, x = dict(inverse=True), _rand(5, 1, 2, 12)

    def f(x):
        return rope.megatron.fused_mla_rope_inplace(x * 1.0, cos, sin, 4, 8, **kw)
    return f, [x]


def _megatron_kv(thd, out=False):
    """Megatron's KV split on an up-projection's output (2 heads of 4 nope + 6 value channels) and the shared rope head
    of 8 channels, neither a leaf: sbhd; thd on rank 1 of 2 with a padding row, written back interleaved; `out`, into
    buffers the caller allocates (forward only: they take no gradient)."""
    cos, sin = _tables(9, 8)
    if thd:
        cu = torch.tensor([0, 4, 8], dtype=torch.int32, device=DEVICE)
        kw, kv, pe = dict(cu_seqlens_kv=cu, cp_rank=1, cp_size=2, remove_interleaving=True), _rand(5, 2, 10), \
            _rand(5, 1, 8, seed=1)
    else:
        kw, kv, pe = {}, _rand(5, 1, 2, 10), _rand(5, 1, 1, 8, seed=1)

    def f(kv, pe):
        if out:
            kw.update(out_key=kv.new_empty((*kv.shape[:-1], 12)), out_value=kv.new_empty((*kv.shape[:-1], 6)))
        return rope.megatron.fused_mla_rope_kv_split(kv * 1.0, pe * 1.0, cos, sin, 8, 4, 6, **kw)
    return f, [kv, pe]


def _hf_single():
    cos, sin = _tables(5, 8, lead=(1,))
    return lambda x: rope.hf.apply_rotary_pos_emb_single(x, cos, sin), [_rand(1, 2, 5, 8)]


def _hf_mrope():
    cos, sin = _tables(5, 8, lead=(3, 1))
    return (lambda q, k: rope.hf.apply_multimodal_rotary_pos_emb(q, k, cos, sin, [2, 1, 1]),
            [_rand(1, 2, 5, 8), _rand(1, 1, 5, 8, seed=1)])


def _mrope(qk):
    freqs = (torch.rand(9, 1, 1, 8, generator=_g(5)) * 6).to(DEVICE)
    pos = _positions(3, 5)
    if qk:
        return (lambda q, k: rope.mrope.apply_multimodal_rotary_pos_emb_qk(q, k, freqs, pos, [2, 1, 1]),
                [_rand(5, 2, 8), _rand(5, 1, 8, seed=1)])
    return lambda t: rope.mrope.apply_multimodal_rotary_pos_emb(t, freqs, pos, [2, 1, 1]), [_rand(5, 2, 8)]


def _meta():
    ang = torch.rand(5, 4, generator=_g(6)) * 6
    freqs_cis = torch.polar(torch.ones_like(ang), ang).to(DEVICE)
    return lambda q, k: rope.meta.apply_rotary_emb(q, k, freqs_cis), [_rand(1, 5, 2, 8), _rand(1, 5, 1, 8, seed=1)]


def _flash(inplace, thd=False):
    cos, sin = _tables(9, 8, per_pair=True)
    kw = dict(seqlen_offsets=1)
    x = _rand(1, 5, 2, 8)
    if thd:
        kw = dict(cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE))
        x = _rand(5, 2, 8)
    if inplace:
        def f(x):
            y = x * 1.0  # not a leaf: written in place under autograd, as flash's Function does
            return rope.flash.apply_rotary_emb(y, cos, sin, inplace=True, **kw)
        return f, [x]
    return lambda x: rope.flash.apply_rotary_emb(x, cos, sin, **kw), [x]


def _vllm(mrope):
    cache = _vllm_cache()
    pos = _positions(3, 5) if mrope else _positions(5)

    def f(query, key):
        q, k = query.clone(), key.clone()
        if mrope:
            rope.vllm.mrotary_embedding(pos, q, k, 8, cache, [2, 1, 1])
        else:
            rope.vllm.rotary_embedding(pos, q, k, 8, cache, True)
        return q, k
    return f, [_rand(5, 2 * 8), _rand(5, 8, seed=1)]


def _serving(form):
    """RoPE fused with the KV-cache write, in place: q, k and both caches are returned (clones of the inputs, so that
    each run starts from the same values)."""
    cache = _vllm_cache()
    pos = _positions(5)
    v = _rand(5, 1, 8, seed=2)
    slots = torch.tensor([3, -1, 0, 5, 1]).to(DEVICE) if form == "vllm" else torch.tensor([3, 6, 0, 5, 1]).to(DEVICE)

    def f(query, key, key_cache, value_cache):
        q, k, kc, vc = query.clone(), key.clone(), key_cache.clone(), value_cache.clone()
        if form == "vllm":
            rope.serving.rope_and_cache(pos, q, k, v, kc, vc, slots, cache, True)
        else:
            rope.serving.apply_rope_inplace_with_kvcache(q, k, v, kc, vc, cache, pos, slots, is_neox=False)
        return q, k, kc, vc
    caches = [_rand(2, 4, 1, 8, seed=3), _rand(2, 4, 1, 8, seed=4)] if form == "vllm" else \
        [_rand(8, 1, 8, seed=3), _rand(8, 1, 8, seed=4)]
    return f, [_rand(5, 2, 8), _rand(5, 1, 8, seed=1), *caches]


def _titan(form, positions):
    q, k = _rand(5, 2, 8), _rand(5, 1, 8, seed=1)
    pos = _positions(5) if positions else None
    ang = torch.rand(9, 4, generator=_g(7)) * 6
    complex_cache = torch.polar(torch.ones_like(ang), ang).to(DEVICE)
    cossin_cache = torch.cat([ang.cos(), ang.cos(), ang.sin(), ang.sin()], -1).to(DEVICE)
    if form == "complex":
        return lambda q, k: rope.torchtitan.complex_rope(q, k, complex_cache, pos), [q, k]
    if form == "cossin":
        return lambda q, k: rope.torchtitan.cossin_rope(q, k, cossin_cache, pos), [q, k]
    if form == "complex_apply":
        return lambda q, k: rope.torchtitan.complex_apply_rotary_emb(q, k, complex_cache[:5, None]), [q, k]
    return lambda q, k: rope.torchtitan.cossin_apply_rotary_emb(q, k, cossin_cache[:5, None]), [q, k]


def _qknorm(form):
    q, k = _rand(1, 2, 5, 8), _rand(1, 1, 5, 8, seed=1)
    wq, wk = _rand(8, seed=2), _rand(8, seed=3)
    if form == "tables":
        cos, sin = _tables(5, 8, lead=(1,))
        return lambda q, k, wq, wk: rope.qknorm.apply(q, k, wq, wk, cos, sin), [q, k, wq, wk]
    if form == "freqs":
        freqs = (torch.rand(9, 1, 1, 8, generator=_g(5)) * 6).to(DEVICE)
        return (lambda q, k, wq, wk: rope.qknorm.apply_freqs(q, k, wq, wk, freqs, "bshd"),
                [q.transpose(1, 2), k.transpose(1, 2), wq, wk])
    cache, pos = _vllm_cache(), _positions(5)
    if form == "cache":
        return (lambda q, k, wq, wk: rope.qknorm.apply_cache(q, k, wq, wk, pos, cache),
                [_rand(5, 2, 8), _rand(5, 1, 8, seed=1), wq, wk])

    def fused(qkv, wq, wk):  # vLLM's op: in place, no backward
        qkv = qkv.clone()
        rope.qknorm.fused_qk_norm_rope(qkv, 2, 1, 1, 8, 1e-6, wq, wk, cache, True, pos)
        return qkv
    return fused, [_rand(5, 4 * 8), wq, wk]


def _te(qk, form="freqs"):
    freqs = (torch.rand(9, 1, 1, 8, generator=_g(5)) * 6).to(DEVICE)
    if form == "cache":
        cache = rope.RoPECache.from_freqs(freqs)
        return lambda t: rope.apply_rotary_pos_emb(t, cache), [_rand(5, 1, 2, 8)]
    if form == "qkv":
        return (lambda qkv: rope.apply_fused_qkv_rotary_pos_emb(qkv, freqs[..., :4], freqs[..., :4], [4, 4, 4]),
                [_rand(5, 1, 2, 12)])
    if form == "inplace":
        def f(q, k):
            q, k = q * 1.0, k * 1.0
            return rope.apply_rotary_pos_emb_qk(q, k, freqs, start_positions=start, inplace=True)
        start = torch.tensor([2], device=DEVICE)
        return f, [_rand(5, 1, 2, 8), _rand(5, 1, 1, 8, seed=1)]
    if qk:
        return (lambda q, k: rope.apply_rotary_pos_emb_qk(q, k, freqs), [_rand(5, 1, 2, 8), _rand(5, 1, 1, 8, seed=1)])
    return lambda t: rope.apply_rotary_pos_emb(t, freqs), [_rand(5, 1, 2, 8)]


# name -> (a function of tensors and their values, whether it has a backward)
CONVENTIONS = {
    "hf": (lambda: _hf_case(rope.hf.apply_rotary_pos_emb), True),
    "hf-single": (_hf_single, True),
    "hf-glm": (lambda: _hf_case(rope.hf.apply_rotary_pos_emb_glm), True),
    "hf-deepseek-v3": (lambda: _hf_case(rope.hf.apply_rotary_pos_emb_interleave), True),
    "deepseek-v4": (_deepseek_v4, True),
    "megatron-mla": (lambda: _megatron(False), True),
    "megatron-mla-thd": (lambda: _megatron(True), True),
    "megatron-mla-kv": (lambda: _megatron_kv(False), True),
    "megatron-mla-kv-thd": (lambda: _megatron_kv(True), True),
    "megatron-mla-kv-out": (lambda: _megatron_kv(False, out=True), False),
    "hf-mrope": (_hf_mrope, True),
    "mrope": (lambda: _mrope(False), True),
    "mrope-qk": (lambda: _mrope(True), True),
    "meta": (_meta, True),
    "flash": (lambda: _flash(False), True),
    "flash-thd": (lambda: _flash(False, thd=True), True),
    "flash-inplace": (lambda: _flash(True), True),
    "vllm": (lambda: _vllm(False), False),
    "vllm-mrope": (lambda: _vllm(True), False),
    "vllm-kv-cache": (lambda: _serving("vllm"), False),
    "sglang-kv-cache": (lambda: _serving("sglang"), False),
    "torchtitan-complex": (lambda: _titan("complex", False), True),
    "torchtitan-complex-positions": (lambda: _titan("complex", True), True),
    "torchtitan-cossin": (lambda: _titan("cossin", False), True),
    "torchtitan-cossin-positions": (lambda: _titan("cossin", True), True),
    "torchtitan-complex-apply": (lambda: _titan("complex_apply", False), True),
    "torchtitan-cossin-apply": (lambda: _titan("cossin_apply", False), True),
    "qknorm": (lambda: _qknorm("tables"), True),
    "qknorm-cache": (lambda: _qknorm("cache"), True),
    "qknorm-freqs": (lambda: _qknorm("freqs"), True),
    "qknorm-vllm-inplace": (lambda: _qknorm("fused"), False),
    "te": (lambda: _te(False), True),
    "te-qk": (lambda: _te(True), True),
    "te-cache": (lambda: _te(False, "cache"), True),
    "te-qkv": (lambda: _te(False, "qkv"), True),
    "te-qk-inplace": (lambda: _te(True, "inplace"), True),
}


def _run(fn, inputs, grad):
    xs = [x.clone().requires_grad_(grad) for x in inputs]
    outs = fn(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if not grad:
        return outs, ()
    weights = [torch.randn(o.shape, generator=_g(100 + i)).to(o) for i, o in enumerate(outs)]
    sum((o * w).sum() for o, w in zip(outs, weights, strict=True)).backward()
    return outs, [x.grad for x in xs]


@pytest.mark.parametrize("name", list(CONVENTIONS))
def test_every_convention_compiles_to_the_custom_op(name):
    """fullgraph=True: no graph break; the traced forward holds rope's custom op (and the backward the op in the
    other direction); results and gradients equal the eager kernel's bit for bit."""
    make, has_backward = CONVENTIONS[name]
    fn, inputs = make()
    backend, graphs = _recording_backend()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    for grad in (False, True) if has_backward else (False,):
        got, got_grads = _run(compiled, inputs, grad)
        want, want_grads = _run(fn, inputs, grad)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"{name}: compiled result differs from eager"
        for g, w in zip(got_grads, want_grads, strict=True):
            assert (g is None) == (w is None) and (g is None or torch.equal(g, w)), f"{name}: gradients differ"
    assert rope_ops(graphs["forward"]) >= 1, f"{name}: no rope custom op in the traced forward"
    if has_backward:
        assert rope_ops(graphs["backward"]) >= 1, f"{name}: no rope custom op in the traced backward"
