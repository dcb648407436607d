"""torch.compile: the kernel as a custom op (docs/contract.md section 7).

A model using rope compiles with fullgraph=True (no graph breaks), matches eager bitwise forward
and backward, recompiles nothing when only s or b change, and the op passes torch.library.opcheck
(schema, fake implementation, AOT dispatch). The op has no autograd of its own: traced code records it in
`rope._backend.Rotation`, the node of every rotation, whose backward the compiled-against-eager tests check.
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
    args = ("te", [t], [freqs, start, cu], repr((fmt, case.get("interleaved", False), case.get("cp_size", 1),
                                                 case.get("cp_rank", 0))), backward)
    torch.library.opcheck(torch.ops.rope.rotate.default, args)


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


def test_conventions_trace_as_the_reference():
    """Traced, the conventions (transformers', vLLM's, multimodal) run the reference's PyTorch operations: no
    graph break with fullgraph=True, and the eager result."""
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
