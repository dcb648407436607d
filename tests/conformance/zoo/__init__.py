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


def channels_adjacent(x):
    """x with its channels read as adjacent (last-dim stride 1), its other strides kept, as a kernel that takes the
    row strides and assumes dense channels reads it: within x's storage, since the view's last offset only moves
    down."""
    if x.numel() == 0 or x.stride(-1) == 1:
        return x
    return torch.as_strided(x, x.shape, (*x.stride()[:-1], 1), x.storage_offset())


def per_channel(half, interleaved):
    """A table with one column per pair -> one per channel."""
    return half.repeat_interleave(2, dim=-1) if interleaved else torch.cat([half, half], dim=-1)


def _halving_sum(x):
    """x [..., d] -> [..., 1]: the zero-padded row summed by halves, elementwise operations alone, so each row's
    order of additions is the same whatever the other dims."""
    d = x.shape[-1]
    y = torch.nn.functional.pad(x, (0, (1 << max(d - 1, 0).bit_length()) - d))
    while y.shape[-1] > 1:
        half = y.shape[-1] // 2
        y = y[..., :half] + y[..., half:]
    return y


class _RowSum(torch.autograd.Function):
    """The sum over the last dim in a fixed order (`_halving_sum`). PyTorch's own reductions pick their order by the
    number of rows (on CUDA a few rows are split over more threads), so there a row's sum depends on the batch and
    the QK-norm zoos' correct implementations would fail batch invariance. Backward: the gradient spread over the
    row, elementwise."""

    @staticmethod
    def forward(ctx, x):
        ctx.d = x.shape[-1]
        return _halving_sum(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.expand(*grad.shape[:-1], ctx.d)


class _Spread(torch.autograd.Function):
    """r [..., 1] spread over d columns; backward: the columns' gradients summed in `_halving_sum`'s fixed order (a
    broadcast multiplication would sum them with PyTorch's reduction)."""

    @staticmethod
    def forward(ctx, r, d):
        return r.expand(*r.shape[:-1], d).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _halving_sum(grad), None


def row_rms(xf, eps):
    """rsqrt(mean(x^2) + eps) of each row of xf (float32), spread over its columns: batch invariant forward and
    backward (`_RowSum`, `_Spread`), as a kernel that reduces each head on its own is."""
    d = xf.shape[-1]
    return _Spread.apply(torch.rsqrt(_RowSum.apply(xf * xf) / d + eps), d)
