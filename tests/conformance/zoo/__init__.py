"""Planted bugs, per convention: pure-PyTorch implementations, each correct but for one realistic bug that
valid input exposes. `CORRECT` in each module is the bug-free one (it must pass every property); `BUGS` maps a
bug's name to (the function, the properties expected to catch it). test_zoo.py runs them through the suite:
    pytest --rope-impl hf:tests.conformance.zoo.hf:k_rotates_q tests/conformance    fails
"""

import torch


def rotate_half(x, interleaved=False):
    """transformers' rotate_half (pairs (i, i + d/2)), or GPT-J's for interleaved pairs (2i, 2i + 1): the
    partner of each channel, negated on the first of its pair."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def per_channel(half, interleaved):
    """A table with one column per pair -> one per channel."""
    return half.repeat_interleave(2, dim=-1) if interleaved else torch.cat([half, half], dim=-1)
