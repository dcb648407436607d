"""`rope.qknorm.apply(..., schedule="eager")`: bitwise Qwen3's (Gemma 3's) RMSNorm and transformers' rotation as
eager PyTorch runs them on CUDA.

On the GPU the oracle is that expression itself, run by PyTorch. On the CPU (Triton's interpreter) it is the CUDA
kernels' order written out row by row from ATen's Reduce.cuh (torch 2.10 and later; the suite's
`qknorm_math.cuda_row_mean_of_squares`, which the native `--rope-schedule eager` uses too): PyTorch's CPU kernels
reduce the mean in another order, so the expression run on the CPU is not the oracle there. The rsqrt of the CPU
run is PyTorch's CPU rsqrt, as the interpreter's; on CUDA both sides use the approximate instruction.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import rope

from ..conformance.spec.qknorm_math import cuda_row_mean_of_squares as _row_variance
from .cases import DEVICE, ON_GPU, poison_outputs  # noqa: F401

F32 = np.float32


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _expected(x, w, cos, sin, eps, gemma):
    """Qwen3RMSNorm(x) (Gemma3RMSNorm) then transformers' apply_rotary_pos_emb, [b, h, s, d] x, in x's dtype; on the
    CPU the mean is `_row_variance`'s."""
    h = x.to(torch.float32)
    if x.is_cuda:
        variance = h.pow(2).mean(-1, keepdim=True)
    else:
        flat = h.reshape(-1, h.shape[-1]).numpy()
        variance = torch.tensor([_row_variance(r, flat.shape[0]) for r in flat]).reshape(*h.shape[:-1], 1)
    h = h * torch.rsqrt(variance + eps)
    y = (h * (1.0 + w.float())).type_as(x) if gemma else w * h.to(x.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (y * cos) + (_rotate_half(y) * sin)


# (b, s, hq, hk, d): decode with few rows (PyTorch widens a row's threads below 16 rows: at d 96 and 112 the sum's
# association changes with it), prefill-like rows, d 80 (not a power of two), d 128 and 256 (vectorized loads; at
# 256 with 16 rows or more, two vectors a thread)
SHAPES = [(1, 1, 4, 2, 64), (2, 9, 4, 1, 64), (1, 3, 2, 1, 80), (1, 1, 12, 6, 96), (1, 1, 15, 7, 112),
          (1, 1, 8, 2, 128), (2, 5, 4, 2, 128), (1, 2, 3, 1, 256), (2, 4, 4, 2, 256), (1, 4, 2, 2, 16)]


def _check(shape, dtype, gemma):
    """q and k ([b, h, s, d] views of the [b, s, h, d] projection, as Qwen3 passes them) bitwise the expression,
    each with its own row count's reduction; and the default schedule is not (the case can tell them apart)."""
    b, s, hq, hk, d = shape
    gen = torch.Generator().manual_seed(sum(shape) + 7 * gemma)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)

    q, k = randn(b, s, hq, d, scale=3.0).transpose(1, 2), randn(b, s, hk, d, scale=0.5).transpose(1, 2)
    wq, wk = randn(d, scale=0.3) + 1, randn(d, scale=0.3) + 1
    angles = torch.rand(b, s, d // 2, generator=gen, dtype=torch.float64) * 40
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype).to(DEVICE) for f in (torch.cos, torch.sin))
    got = rope.qknorm.apply(q, k, wq, wk, cos, sin, eps=1e-6, gemma=gemma, schedule="eager")
    default = rope.qknorm.apply(q, k, wq, wk, cos, sin, eps=1e-6, gemma=gemma)
    differs = 0
    for name, out, x, w, base in (("q", got[0], q, wq, default[0]), ("k", got[1], k, wk, default[1])):
        want = _expected(x, w, cos, sin, 1e-6, gemma)
        diff = (out != want).nonzero()
        assert diff.numel() == 0, f"{name}: first difference at {diff[0].tolist()}: {out[tuple(diff[0])].item()} " \
                                  f"against {want[tuple(diff[0])].item()}"
        differs += int((base != want).sum())
    if dtype != torch.float32:
        assert differs > 0, "the default schedule gave the eager expression's bits too: the case tells nothing"


DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Each shape with both norms, in two of the dtypes, turned rather than crossed: the reduction's order is a function of
# the shape alone (it reduces the float32 copy), the dtype and the norm only round around it; each kernel variant is
# a compile of about a second on a GPU.
EAGER_CASES = [(shape, DTYPES[(i + gemma) % 3], gemma) for i, shape in enumerate(SHAPES) for gemma in (False, True)]


def test_eager_cases_meet_every_dtype_and_norm():
    pairs = [(dtype, gemma) for _, dtype, gemma in EAGER_CASES]
    assert all(pairs.count((dtype, gemma)) >= 3 for dtype in DTYPES for gemma in (False, True)), pairs
    for shape in SHAPES:
        cases = [(dtype, gemma) for s, dtype, gemma in EAGER_CASES if s == shape]
        assert len(cases) == 2 and len({d for d, _ in cases}) == 2 and len({g for _, g in cases}) == 2, (shape, cases)


@pytest.mark.parametrize("shape,dtype,gemma", EAGER_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{str(t)[6:]}-{'gemma3' if g else 'qwen3'}"
                              for s, t, g in EAGER_CASES])
def test_eager_schedule_is_the_eager_expression(poison_outputs, shape, dtype, gemma):  # noqa: F811
    _check(shape, dtype, gemma)


def _rows_ignored(rows, d):
    """Planted: PyTorch's threads per row as at 16 rows and more, whatever the row count."""
    return rope.reference.torch_row_reduction(max(rows, 16), d)


def _vectorized_above_128(rows, d):
    """Planted: torch 2.9's rule, loads of 4 channels only above d = 128 (a row of 128 read one channel a thread)."""
    if d != 128:
        return rope.reference.torch_row_reduction(rows, d)
    _, _, factor = rope.reference.torch_row_reduction(rows, d)
    return min(128, 512 // min(1 << (max(rows, 1).bit_length() - 1), 16)), 1, factor


@pytest.mark.parametrize("planted, shape", [(_rows_ignored, (1, 1, 15, 7, 112)),
                                                 (_vectorized_above_128, (2, 5, 4, 2, 128))],
                         ids=["rows_ignored", "vectorized_above_128"])
def test_planted_reductions_are_caught(poison_outputs, monkeypatch, planted, shape):  # noqa: F811
    """The launcher given another reduction plan (`_rows_ignored`, `_vectorized_above_128`) fails the check above,
    in float32: a sum that differs in its last bit moves r by an ulp, which a 16-bit output rounds away on most
    elements (the float32 cases are the ones that tell the order)."""
    monkeypatch.setattr(rope._launch, "torch_row_reduction", planted)
    rope.clear_caches()
    try:
        with pytest.raises(AssertionError, match="first difference"):
            _check(shape, torch.float32, False)
    finally:
        rope.clear_caches()


@pytest.mark.parametrize("kwargs, match", [
    (dict(schedule="float32"), "schedule: expected None or 'eager'"),
    (dict(schedule="eager", weight_dtype=torch.float32), "schedule: 'eager' reproduces a model run in one dtype: "
                                                         "q_weight"),
    (dict(schedule="eager", table_dtype=torch.float32), "schedule: 'eager' reproduces a model run in one dtype: cos"),
    (dict(schedule="eager", d=130), "schedule: 'eager' needs a head dim below 128 or a multiple of 4"),
])
def test_eager_schedule_bad_input(kwargs, match):
    """Refused before anything runs, naming `schedule`; q and k unwritten."""
    d = kwargs.pop("d", 64)
    q, k = torch.randn(1, 2, 3, d, dtype=torch.bfloat16, device=DEVICE), torch.randn(1, 1, 3, d, dtype=torch.bfloat16,
                                                                                      device=DEVICE)
    snapshot = (q.clone(), k.clone())
    w = torch.rand(d, device=DEVICE).to(kwargs.pop("weight_dtype", torch.bfloat16))
    cos = torch.rand(1, 3, d, device=DEVICE).to(kwargs.pop("table_dtype", torch.bfloat16))
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        rope.qknorm.apply(q, k, w, w, cos, cos, **kwargs)
    assert torch.equal(q, snapshot[0]) and torch.equal(k, snapshot[1])


@pytest.mark.skipif(ON_GPU, reason="checks the CPU oracle against PyTorch's own reduction where they must agree")
def test_cpu_oracle_orders_as_stated():
    """The row oracle is a sum in a fixed order times the rounded factor 1/d: on rows whose squares are small
    integers (every order exact) it is that exact sum times float32(1/80); on random rows it differs from PyTorch's
    CPU mean on some rows (another order, and a division), so it is not PyTorch's CPU kernel in disguise."""
    gen = torch.Generator().manual_seed(11)
    ints = torch.randint(-8, 9, (6, 80), generator=gen).float()
    factor = torch.tensor(F32(6) / F32(480))
    assert [_row_variance(r, 6) for r in ints.numpy()] == (ints.pow(2).sum(-1) * factor).tolist()
    rows = torch.randn(64, 96, generator=gen) * 3
    ours = torch.tensor([_row_variance(r, 64) for r in rows.numpy()])
    assert (ours != rows.pow(2).mean(-1)).any()
