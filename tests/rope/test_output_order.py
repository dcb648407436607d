"""The memory order of new outputs, where a convention's own expression keeps its input's.

PyTorch's elementwise operations give a result the memory order of a permuted contiguous input, and transformers',
flash-attention's and DeepSeek-V4's callers rely on what that costs: a contiguous `[b, h, s, d]` tensor rotated as
its `[b, s, h, d]` view comes back contiguous with no transposing copy. rope's outputs out of place keep that order
(`Call.keep_order`), forward and backward; the values are the float64 expression's within one rounding.
"""
from __future__ import annotations

import pytest
import torch

import rope

from .cases import DEVICE, poison_outputs, reference_path  # noqa: F401


def _randn(*shape, dtype=torch.float32, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)


def _kernel_outputs(monkeypatch) -> list:
    """The storages of the outputs the launcher allocates from now on (each a kernel writes)."""
    allocated, empty = [], rope._launch.empty

    def recording(x, dense=False):
        out = empty(x, dense)
        allocated.append(out.untyped_storage().data_ptr())
        return out
    monkeypatch.setattr(rope._launch, "empty", recording)
    return allocated


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


# q as a model may hold it: contiguous [b, h, s, d]; the [b, h, s, d] view of the [b, s, h, d] projection; and
# both narrowed from a wider last dim (not dense: the result is dense in q's order of strides)
LAYOUTS = {
    "contiguous": lambda t: t.transpose(1, 2).contiguous(),
    "view": lambda t: t.transpose(1, 2),
    "padded": lambda t: torch.cat([t, t], -1).transpose(1, 2).contiguous()[..., : t.shape[-1]],
    "padded_view": lambda t: torch.cat([t, t], -1)[..., : t.shape[-1]].transpose(1, 2),
}


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("form", ["hf", "hf_single", "flash"])
def test_output_keeps_the_input_order(poison_outputs, form, layout, reference):  # noqa: F811
    """The result has the strides the convention's PyTorch expression gives it (transformers' `q * cos +
    rotate_half(q) * sin`; flash-attention's `empty_like(x)`), and that expression's values; on the kernel path and
    on the CPU's reference path alike."""
    gen = torch.Generator().manual_seed(3)
    b, s, h, d = 2, 5, 3, 16
    x = LAYOUTS[layout](_randn(b, s, h, d, gen=gen))  # [b, h, s, d]
    with reference_path(reference):
        if form == "flash":
            x = x.transpose(1, 2)  # flash's [b, s, h, d]
            angles = _randn(s, d // 2, gen=gen)
            out = rope.flash.apply_rotary_emb(x, angles.cos(), angles.sin())
            cos, sin = (torch.cat([f(angles)] * 2, -1)[None, :, None] for f in (torch.cos, torch.sin))
        else:
            angles = _randn(b, s, d // 2, gen=gen)
            cos, sin = (torch.cat([f(angles)] * 2, -1) for f in (torch.cos, torch.sin))
            if form == "hf":
                out, _ = rope.hf.apply_rotary_pos_emb(x, x[:, :1], cos, sin)
            else:
                out = rope.hf.apply_rotary_pos_emb_single(x, cos, sin)
            cos, sin = cos[:, None], sin[:, None]
    expression = x * cos + _rotate_half(x) * sin
    want = x.double() * cos.double() + _rotate_half(x.double()) * sin.double()
    assert out.stride() == (torch.empty_like(x) if form == "flash" else expression).stride()
    assert (out.double() - want).abs().max() <= 2.0**-22 * want.abs().max()


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_deepseek_v4_contiguous_heads_need_no_copy(poison_outputs, monkeypatch, grad):  # noqa: F811
    """V4's x [b, h, s, D] contiguous: the result (and x's gradient) is contiguous and is the kernel's output
    itself, written in one pass with no copy after it; the leading channels bitwise x's (the gradient's)."""
    gen = torch.Generator().manual_seed(4)
    b, h, s, d, w = 2, 3, 5, 16, 4
    x = _randn(b, h, s, d, dtype=torch.bfloat16, gen=gen).requires_grad_(grad)
    angles = _randn(b, s, w, gen=gen)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    upstream = _randn(b, h, s, d, dtype=torch.bfloat16, gen=gen)
    allocated = _kernel_outputs(monkeypatch)
    got = rope.deepseek.apply_rotary_pos_emb(x, cos, sin)
    if grad:
        got = torch.autograd.grad(got, x, upstream)[0]
    lead = upstream if grad else x.detach()
    assert got.is_contiguous()
    assert got.untyped_storage().data_ptr() == allocated[-1]
    assert torch.equal(got[..., : d - 2 * w], lead[..., : d - 2 * w])
