"""flash-attention's `inplace=True` on a leaf that requires grad (docs/contract.md, 7a): x written, a new tensor over
x's memory returned with the rotation's backward, x.grad the rotation by -theta of the upstream gradient (which is
left as it is), x's version counter advanced. On the kernel path (CUDA, or Triton's interpreter) and on the CPU
reference path, against a float64 oracle."""
from __future__ import annotations

import contextlib

import pytest
import torch

import rope
import rope._backend

from .cases import DEVICE, angles_table, oracle, oracle_grad, per_pair, poison_outputs, randn, reference_path  # noqa: F401
from .numerics import assert_within_rounding


@contextlib.contextmanager
def path(reference: bool):
    """The CPU reference path (as without Triton's interpreter), or the kernel's; on a GPU the kernel's only."""
    if reference and DEVICE != "cpu":
        pytest.skip("on a GPU the kernel path is the only one")
    with reference_path(reference):
        yield


def padded(shape, dtype, gen):
    """(x, its buffer): x [b, s, h, d] a view whose heads are padded by 3 channels on each side (NaN)."""
    buf = torch.full((*shape[:-1], shape[-1] + 6), float("nan"), dtype=dtype, device=DEVICE)
    x = buf[..., 3:3 + shape[-1]]
    x.copy_(randn(shape, dtype, gen))
    return x, buf


CASES = [  # (dtype, shape [b, s, h, d], rotary width, interleaved, varlen lengths, x a padded view)
    (torch.float32, (2, 5, 3, 16), 12, False, None, False),
    (torch.bfloat16, (2, 5, 1, 10), 10, True, None, True),  # h = 1: autograd's view_as restrides that dim
    (torch.float16, (1, 7, 2, 8), 4, False, (3, 0, 4), True),  # varlen: x [7, 2, 8] with cu_seqlens
]


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_leaf_written_returned_and_its_gradient(case, reference, poison_outputs):  # noqa: F811
    dtype, shape, rot, interleaved, lengths, is_view = CASES[case]
    gen = torch.Generator().manual_seed(21 + case)
    if lengths is not None:
        shape = shape[1:]
    x, buf = padded(shape, dtype, gen) if is_view else (randn(shape, dtype, gen), None)
    x.requires_grad_()
    x0 = x.detach().clone()
    pad0 = None if buf is None else buf.clone()
    cos, sin = angles_table(shape[-3] + 2, rot // 2, torch.float32, gen)
    kw = dict(interleaved=interleaved, seqlen_offsets=1)
    if lengths is not None:
        cu = torch.tensor((0, *lengths), device=DEVICE).cumsum(0).to(torch.int32)
        kw.update(cu_seqlens=cu, max_seqlen=max(lengths))
        pos = torch.cat([torch.arange(n, device=DEVICE) for n in lengths]) + 1
    else:
        pos = torch.arange(shape[1], device=DEVICE)[None, :].expand(shape[0], -1) + 1
    cf, sf = per_pair(cos, interleaved)[pos].unsqueeze(-2), per_pair(sin, interleaved)[pos].unsqueeze(-2)
    with path(reference):
        out = rope.flash.apply_rotary_emb(x, cos, sin, inplace=True, **kw)
    assert out is not x and x.is_leaf and x.grad is None
    assert out.data_ptr() == x.data_ptr() and out.shape == x.shape, "x's memory was not returned"
    assert out.requires_grad and out.grad_fn is not None, "the result is outside the autograd graph"
    assert x._version > 0, "x's version counter did not advance"
    assert_within_rounding(x.detach(), oracle(x0, cf, sf, interleaved), x0, rot, interleaved, "forward: x written")
    assert torch.equal(out.detach(), x.detach())
    if buf is not None:  # the padding around the view, NaN, unchanged
        assert torch.equal(buf.isnan(), pad0.isnan()) and buf[..., :3].isnan().all() and buf[..., -3:].isnan().all()
    g = randn(shape, dtype, gen)
    g0 = g.clone()
    out.backward(g)
    assert torch.equal(g, g0), "the upstream gradient was written"
    assert_within_rounding(x.grad, oracle_grad(g, cf, sf, interleaved), g, rot, interleaved, "backward: x.grad")


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
def test_leaf_saved_before_refuses_backward(reference):
    """A graph that saved x's values before the in-place call refuses its backward (x's version advanced) instead of
    computing a gradient from the rotated values."""
    gen = torch.Generator().manual_seed(5)
    x = randn((1, 4, 2, 8), torch.float32, gen).requires_grad_()
    cos, sin = angles_table(4, 4, torch.float32, gen)
    squares = (x * x).sum()  # saves x
    with path(reference):
        rope.flash.apply_rotary_emb(x, cos, sin, inplace=True).sum().backward()
    assert x.grad is not None
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        squares.backward()


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
def test_leaf_without_grad_mode_is_plain_in_place(reference):
    """With grad mode off nothing is recorded: x written and returned, as for any tensor."""
    gen = torch.Generator().manual_seed(6)
    x = randn((2, 3, 2, 8), torch.float32, gen).requires_grad_()
    cos, sin = angles_table(3, 4, torch.float32, gen)
    want = rope.flash.apply_rotary_emb(x.detach().clone(), cos, sin)
    with path(reference), torch.no_grad():
        out = rope.flash.apply_rotary_emb(x, cos, sin, inplace=True)
    assert out.data_ptr() == x.data_ptr() and out.grad_fn is None
    assert torch.equal(x.detach(), want)
