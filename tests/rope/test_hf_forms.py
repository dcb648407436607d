"""transformers' forms in rope.hf beyond Llama's: partial rotary, the one-tensor form and GLM's interleaved form,
against transformers' expressions written here (slice, rotate_half, cat), forward and backward, on the kernel path
(poisoned outputs: every element written) and the reference path."""
from __future__ import annotations

import pytest
import torch

import rope

from .cases import DEVICE, poison_outputs  # noqa: F401


def _rotate_half(x, interleaved):
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _eager(x, cos, sin, unsqueeze_dim, glm):
    """transformers' expression in float64: GLM's tables are the first half, each column repeated for its pair."""
    cos, sin = (t.unsqueeze(unsqueeze_dim).double() for t in (cos, sin))
    if glm:
        cos, sin = (t[..., : t.shape[-1] // 2].repeat_interleave(2, dim=-1) for t in (cos, sin))
    r = cos.shape[-1]
    x = x.double()
    return torch.cat([x[..., :r] * cos + _rotate_half(x[..., :r], glm) * sin, x[..., r:]], dim=-1)


@pytest.mark.parametrize("glm", [False, True], ids=["rotate_half", "glm"])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_odd_head(poison_outputs, glm, unsqueeze_dim, dtype):  # noqa: F811
    """Head dim 9, rotary width 6, 3 q heads and 1 k head: within one rounding of float64 (float32 math: the
    rounding to the output dtype dominates), the passed-through channels bitwise; gradients likewise."""
    gen = torch.Generator().manual_seed(5)
    b, s, d, r = 2, 4, 9, 6

    def heads(h):
        shape = (b, h, s, d) if unsqueeze_dim == 1 else (b, s, h, d)
        return torch.randn(shape, generator=gen).to(dtype).to(DEVICE).requires_grad_()

    q, k = heads(3), heads(1)
    half = torch.rand(b, s, r // 2, generator=gen) * 20
    ang = torch.cat([half, half], dim=-1)  # one angle per pair: the gradient is the rotation by -theta
    cos, sin = ang.cos().to(dtype).to(DEVICE), ang.sin().to(dtype).to(DEVICE)
    fn = rope.hf.apply_rotary_pos_emb_glm if glm else rope.hf.apply_rotary_pos_emb
    outs = fn(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    ups = [torch.randn(o.shape, generator=gen).to(dtype).to(DEVICE) for o in outs]
    grads = torch.autograd.grad(outs, (q, k), ups)
    eps = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8}[dtype]
    for x, out, up, g in zip((q, k), outs, ups, grads, strict=True):
        want = _eager(x.detach(), cos, sin, unsqueeze_dim, glm)
        back = _eager(up, cos, -sin, unsqueeze_dim, glm)  # the transpose: the rotation by -theta
        for got, ref, src in ((out, want, x), (g, back, up)):
            scale = src.detach().double().abs().amax(-1, keepdim=True)
            assert (got.double() - ref).abs().max() <= 2 * eps * scale.max() + 2.0**-20 * scale.max()
            assert torch.equal(got[..., r:], src[..., r:].to(got.dtype))


@pytest.mark.parametrize("r", [4, 8])
def test_single_is_the_pair_q(r):
    """The one-tensor form gives q's result of the pair form, bitwise (the same launch of q's rows)."""
    gen = torch.Generator().manual_seed(r)
    q = torch.randn(2, 3, 5, 8, generator=gen).to(DEVICE)
    k = torch.randn(2, 2, 5, 8, generator=gen).to(DEVICE)
    ang = torch.rand(1, 5, r, generator=gen) * 20
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    x = rope.hf.apply_rotary_pos_emb_single(q, cos, sin)
    assert torch.equal(x, rope.hf.apply_rotary_pos_emb(q, k, cos, sin)[0])


def test_rank2_tables_refused_with_the_batch_form_named():
    """Liger's [s, r] tables are not transformers': its expression would broadcast them over the heads."""
    q = torch.randn(1, 5, 5, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"^cos: expected shape \[b, s, r\].*cos\[None\]"):
        rope.hf.apply_rotary_pos_emb(q, q, torch.ones(5, 8, device=DEVICE), torch.zeros(5, 8, device=DEVICE))
