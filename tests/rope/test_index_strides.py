"""Start positions and offsets given as strided or expanded views: the kernels read one per sequence at stride 1
(they take no stride for them), so the dispatch gives them a dense copy (`_backend.dispatch`). Read from the
data pointer as dense instead, `[2, 0, 5][::1]` of a stride-2 view reads the elements between, and past the tables."""
from __future__ import annotations

import pytest
import torch

import rope
import rope.flash
import rope.qknorm

from .cases import DEVICE

GEN = torch.Generator().manual_seed(0)
OFFSETS = [2, 0, 5]


def _views(dtype):
    """(name, view): the offsets every other element of a wider tensor whose gaps hold other in-range values; and
    one offset expanded to every sequence (`torch.tensor([k]).expand(b)`), beside the two others it was sliced from."""
    wide = torch.tensor([OFFSETS[0], 1, OFFSETS[1], 4, OFFSETS[2], 3], dtype=dtype, device=DEVICE)
    base = torch.tensor(OFFSETS, dtype=dtype, device=DEVICE)
    return [("every other element", wide[::2]), ("expanded", base[:1].expand(len(OFFSETS)))]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_te_start_positions_any_strides(dtype):
    t = torch.randn(4, 3, 2, 16, generator=GEN).to(DEVICE)  # sbhd, b = 3
    freqs = (torch.rand(12, 1, 1, 16, generator=GEN) * 3).to(DEVICE)
    for name, view in _views(dtype):
        got = rope.apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=view)
        want = rope.apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=view.contiguous())
        assert torch.equal(got, want), f"start_positions {name}"


@pytest.mark.parametrize("varlen", [False, True], ids=["bshd", "varlen"])
def test_flash_seqlen_offsets_any_strides(varlen):
    if varlen:
        x = torch.randn(9, 2, 16, generator=GEN).to(DEVICE)
        cu = torch.tensor([0, 4, 5, 9], dtype=torch.int32, device=DEVICE)
        kw = dict(cu_seqlens=cu, max_seqlen=4)
    else:
        x, kw = torch.randn(3, 4, 2, 16, generator=GEN).to(DEVICE), {}
    angles = torch.rand(9, 8, generator=GEN) * 3
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    for name, view in _views(torch.int32):
        got = rope.flash.apply_rotary_emb(x, cos, sin, seqlen_offsets=view, **kw)
        want = rope.flash.apply_rotary_emb(x, cos, sin, seqlen_offsets=view.contiguous(), **kw)
        assert torch.equal(got, want), f"seqlen_offsets {name}"


def test_qknorm_start_positions_any_strides():
    q = torch.randn(4, 3, 2, 16, generator=GEN).to(DEVICE)
    k = torch.randn(4, 3, 1, 16, generator=GEN).to(DEVICE)
    w = torch.randn(16, generator=GEN).to(DEVICE)
    freqs = (torch.rand(12, 1, 1, 16, generator=GEN) * 3).to(DEVICE)
    for name, view in _views(torch.int64):
        got = rope.qknorm.apply_freqs(q, k, w, w, freqs, start_positions=view)
        want = rope.qknorm.apply_freqs(q, k, w, w, freqs, start_positions=view.contiguous())
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), f"start_positions {name}"
