"""The packed-QKV call names its own arguments in its errors (q_freqs, k_freqs, qkv), not the single-tensor call's
t and freqs it is built on; nothing is returned or written when it refuses."""
from __future__ import annotations

import pytest
import torch

import rope

CASES = {
    "k_freqs too short": (lambda f: (f, f[:2]), ValueError, "k_freqs: too short"),
    "q_freqs odd width": (lambda f: (f[..., :7], f), ValueError, "q_freqs: rotary width"),
    "q_freqs not a tensor": (lambda f: ("angles", f), TypeError, "q_freqs: expected a torch.Tensor"),
    "k_freqs integer": (lambda f: (f, f.long()), TypeError, "k_freqs: expected floating-point angles"),
    "k_freqs of another shape": (lambda f: (f, f[:, 0]), ValueError, "k_freqs: expected shape [s2, 1, 1, d2]"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_qkv_names_its_arguments(case):
    make, error, start = CASES[case]
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(4, 1, 2, 24, generator=gen)
    before = qkv.clone()
    q_freqs, k_freqs = make(torch.rand(4, 1, 1, 8, generator=gen) * 6)
    with pytest.raises(error) as info:
        rope.apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, [8, 8, 8])
    assert str(info.value).startswith(start), str(info.value)
    assert torch.equal(qkv, before)
