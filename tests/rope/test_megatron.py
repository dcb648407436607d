"""Megatron-LM's `fused_mla_rope_inplace` and `fused_mla_rope_kv_split` (rope.megatron, docs/contract.md 7h and 7i)
where the conformance suite's properties do not reach: the forms autograd takes (a leaf written and a new tensor over
its memory returned; a tensor in the graph whose own history then holds the rotation; a view autograd will not rebase,
written as Megatron's Function writes it; the KV split's out buffers in the graph, refused once they are), and the
position and table copies kept per tensor, read again after that tensor is written in place. Against a float64
oracle, on the kernel path and on the CPU reference path."""
from __future__ import annotations

import pytest
import torch

import rope

from .cases import DEVICE, angles_table, oracle, oracle_grad, randn, reference_path

fused = rope.megatron.fused_mla_rope_inplace
NOPE, EMB = 4, 8


def _deinterleave(x):
    return torch.cat([x[..., 0::2], x[..., 1::2]], -1)


def _interleave(x):
    h = x.shape[-1] // 2
    return torch.stack((x[..., :h], x[..., h:]), -1).flatten(-2)


def _tables(rows, gen):
    """cos, sin [rows, EMB] whose two halves differ (Megatron's kernel reads every column)."""
    return angles_table(rows, EMB, torch.float32, gen)


def want(t, cos, sin, rows, remove_interleaving=False, inverse=False):
    """float64: t's trailing EMB channels read as pairs (2i, 2i + 1), rotated by columns i and i + EMB/2 of the
    rows' tables, written half-split (or back interleaved); the leading NOPE channels as they are."""
    x = t.detach().double()
    c, s = cos.double()[rows], (-sin if inverse else sin).double()[rows]
    c, s = (v[:, None, None] if x.dim() == 4 else v[:, None] for v in (c, s))
    out = oracle(_deinterleave(x[..., NOPE:]), c, s, False)
    return torch.cat([x[..., :NOPE], _interleave(out) if remove_interleaving else out], -1)


def want_grad(g, cos, sin, rows):
    """The transpose of `want` (remove_interleaving=False) applied to g: the rotation's adjoint, written back
    interleaved; the leading channels as they are."""
    c, s = cos.double()[rows][:, None, None], sin.double()[rows][:, None, None]
    back = oracle_grad(g[..., NOPE:], c, s, False)
    return torch.cat([g[..., :NOPE].double(), _interleave(back)], -1)


def close(got, ref, what):
    torch.testing.assert_close(got.detach().double(), ref, rtol=2**-20, atol=2**-20, msg=what)


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
def test_leaf_written_and_its_memory_returned(reference):
    """A leaf that requires grad (Megatron's own tests pass one): written in place, a new tensor over its memory
    returned with the rotation's node, the leaf still a leaf whose version advanced; its gradient the transpose of
    the upstream gradient, which is left as it is."""
    gen = torch.Generator().manual_seed(1)
    t = randn((5, 2, 3, NOPE + EMB), torch.float32, gen).requires_grad_()
    t0 = t.detach().clone()
    cos, sin = _tables(6, gen)
    rows = torch.arange(5, device=DEVICE)
    with reference_path(reference):
        out = fused(t, cos, sin, NOPE, EMB)
        assert out is not t and t.is_leaf and t._version > 0
        assert out.data_ptr() == t.data_ptr() and out.shape == t.shape and out.grad_fn is not None
        close(t, want(t0, cos, sin, rows), "forward: t written")
        g = randn(t.shape, torch.float32, gen)
        g0 = g.clone()
        out.backward(g)
    assert torch.equal(g, g0), "the upstream gradient was written"
    close(t.grad, want_grad(g, cos, sin, rows), "backward: t.grad")


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
def test_tensor_in_graph_holds_its_rotation(reference):
    """A tensor in the graph (a projection's output) is returned itself, and its own history holds the rotation:
    a later use of t, not of the result, still differentiates through it."""
    gen = torch.Generator().manual_seed(2)
    x = randn((4, 1, 2, NOPE + EMB), torch.float32, gen).requires_grad_()
    cos, sin = _tables(4, gen)
    rows = torch.arange(4, device=DEVICE)
    w = randn(x.shape, torch.float32, gen)
    with reference_path(reference):
        t = x * 2.0
        assert fused(t, cos, sin, NOPE, EMB) is t
        (t * w).sum().backward()
    close(x.grad, 2 * want_grad(w, cos, sin, rows), "backward through t after the call")


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
def test_view_autograd_does_not_rebase(reference):
    """An output of split (a view autograd will not let be written in place and rebased) is written unmarked, as
    Megatron's Function writes it: the returned tensor over its memory carries the rotation."""
    gen = torch.Generator().manual_seed(3)
    x = randn((4, 1, 2, 2 * (NOPE + EMB)), torch.float32, gen).requires_grad_()
    cos, sin = _tables(4, gen)
    rows = torch.arange(4, device=DEVICE)
    g = randn((4, 1, 2, NOPE + EMB), torch.float32, gen)
    with reference_path(reference):
        a, _ = torch.split(x * 1.0, NOPE + EMB, dim=-1)
        a0 = a.detach().clone()
        out = fused(a, cos, sin, NOPE, EMB)
        assert out is not a and out.data_ptr() == a.data_ptr()
        close(out, want(a0, cos, sin, rows), "forward")
        out.backward(g)
    close(x.grad[..., :NOPE + EMB], want_grad(g, cos, sin, rows), "backward: the written half")
    assert not x.grad[..., NOPE + EMB:].any(), "backward: the other half"


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
def test_saved_values_refuse_backward(reference):
    """A node that saved t's values before the call refuses its backward (t's version advanced), where Megatron's
    kernel would let it compute from the rotated values."""
    gen = torch.Generator().manual_seed(4)
    x = randn((3, 1, 1, NOPE + EMB), torch.float32, gen).requires_grad_()
    cos, sin = _tables(3, gen)
    with reference_path(reference):
        t = x.exp()  # exp saves its result for its backward
        fused(t, cos, sin, NOPE, EMB)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            t.sum().backward()


def test_kept_copies_follow_writes_in_place():
    """thd reads positions derived from cu_seqlens_q, remove_interleaving and inverse read copies of the tables, all
    kept per tensor: after cu_seqlens_q, cos and sin are written in place, the next call reads their new values."""
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32, device=DEVICE)
    cos, sin = _tables(8, gen)
    t = randn((4, 2, NOPE + EMB), torch.float32, gen)
    kw = dict(cp_rank=1, cp_size=2, inverse=True, remove_interleaving=True)
    rows = torch.tensor([1, 2, 1, 2], device=DEVICE)  # rank 1 of 2: chunks 1 and 2 of each 4-token sequence
    close(fused(t.clone(), cos, sin, NOPE, EMB, cu, **kw), want(t, cos, sin, rows, True, True), "first call")
    cu.copy_(torch.tensor([0, 8, 8], dtype=torch.int32))
    cos.copy_(cos.flip(0))
    sin.neg_()
    rows = torch.tensor([2, 3, 4, 5], device=DEVICE)  # one 8-token sequence: chunks 1 and 2 hold rows 2 to 5
    close(fused(t.clone(), cos, sin, NOPE, EMB, cu, **kw), want(t, cos, sin, rows, True, True), "after the writes")


def test_value_checks_follow_writes_in_place():
    """cu_seqlens_q whose values passed is checked again once written in place: nothing is written on the way to the
    error."""
    gen = torch.Generator().manual_seed(6)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    cos, sin = _tables(5, gen)
    t = randn((5, 1, NOPE + EMB), torch.float32, gen)
    fused(t.clone(), cos, sin, NOPE, EMB, cu)
    cu[0] = 1
    before = t.clone()
    with pytest.raises(ValueError, match="^cu_seqlens_q: must start at 0"):
        fused(t, cos, sin, NOPE, EMB, cu)
    assert torch.equal(t, before)


kv_split = rope.megatron.fused_mla_rope_kv_split
K, V = 4, 6


def want_kv(kv, pe, cos, sin, rows):
    """float64 (key, value): k_pos_emb's pairs (2i, 2i + 1) rotated by columns i and i + EMB/2 of the rows' tables,
    written half-split, after every head's leading K channels of kv; value kv's trailing V channels."""
    c, s = cos.double()[rows], sin.double()[rows]
    c, s = (v[:, None, None] if kv.dim() == 4 else v[:, None] for v in (c, s))
    rope_ = oracle(_deinterleave(pe.detach().double()), c, s, False).expand(*kv.shape[:-1], EMB)
    kv = kv.detach().double()
    return torch.cat([kv[..., :K], rope_], -1), kv[..., K:]


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
def test_kv_split_into_buffers_in_the_graph(reference):
    """The out buffers hold the results and are returned themselves; autograd records through them: kv's gradient the
    upstream gradients side by side, k_pos_emb's (in another dtype than kv) the transpose of the rotation of the
    heads' sum. Once in the graph a buffer requires grad and is refused by the next call, as Megatron's is."""
    gen = torch.Generator().manual_seed(7)
    kv = randn((5, 2, 3, K + V), torch.float32, gen).requires_grad_()
    pe = randn((5, 2, 1, EMB), torch.bfloat16, gen).requires_grad_()
    cos, sin = _tables(6, gen)
    rows = torch.arange(5, device=DEVICE)
    out_key = torch.full((5, 2, 3, K + EMB), float("nan"), device=DEVICE)
    out_value = torch.full((5, 2, 3, V), float("nan"), device=DEVICE)
    with reference_path(reference):
        key, value = kv_split(kv, pe, cos, sin, EMB, K, V, out_key=out_key, out_value=out_value)
        assert key is out_key and value is out_value and key.grad_fn is not None
        wk, wv = want_kv(kv, pe, cos, sin, rows)
        close(key, wk, "forward: key")
        assert torch.equal(value.double(), wv), "forward: value"
        gk, gv = randn(key.shape, torch.float32, gen), randn(value.shape, torch.float32, gen)
        torch.autograd.backward((key, value), (gk, gv))
        with pytest.raises(ValueError, match="^out_key: must not require grad"):
            kv_split(kv, pe, cos, sin, EMB, K, V, out_key=out_key, out_value=out_value.detach())
    assert torch.equal(kv.grad, torch.cat([gk[..., :K], gv], -1)), "backward: kv"
    summed = gk[..., K:].sum(-2, keepdim=True)  # float32: the sum over the heads, as the broadcast's backward takes it
    want_pe = _interleave(oracle_grad(summed, cos.double()[rows][:, None, None], sin.double()[rows][:, None, None],
                                      False))
    torch.testing.assert_close(pe.grad.double(), want_pe, rtol=2**-7, atol=2**-7, msg="backward: k_pos_emb")


def test_kv_split_reads_positions_after_cu_seqlens_written():
    """thd reads the position table kept per cu_seqlens_kv tensor (shared with fused_mla_rope_inplace's): after
    cu_seqlens_kv is written in place, the next call reads its new values."""
    gen = torch.Generator().manual_seed(8)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32, device=DEVICE)
    cos, sin = _tables(8, gen)
    kv, pe = randn((4, 2, K + V), torch.float32, gen), randn((4, 1, EMB), torch.float32, gen)
    kw = dict(cp_rank=1, cp_size=2)
    rows = torch.tensor([1, 2, 1, 2], device=DEVICE)  # rank 1 of 2: chunks 1 and 2 of each 4-token sequence
    close(kv_split(kv, pe, cos, sin, EMB, K, V, cu, **kw)[0], want_kv(kv, pe, cos, sin, rows)[0], "first call")
    cu.copy_(torch.tensor([0, 8, 8], dtype=torch.int32))
    rows = torch.tensor([2, 3, 4, 5], device=DEVICE)  # one 8-token sequence: chunks 1 and 2 hold rows 2 to 5
    close(kv_split(kv, pe, cos, sin, EMB, K, V, cu, **kw)[0], want_kv(kv, pe, cos, sin, rows)[0], "after the write")
