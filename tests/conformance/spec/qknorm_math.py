"""QK-RMSNorm + RoPE in float64 and its accuracy model, shared by the `qknorm` and `vllm-qknorm` conventions.

Definition, per head x [d] with weight w (Gemma: 1 + w), from the inputs as given:
    r = (mean(x^2) + eps)^(-1/2),   n = x r,   a = n w,   y = R(a)   (R: the rotation of the first rot channels)

Accuracy (float32 math, one rounding to the output dtype D; u = 2^-24). The runner's model bounds an element by
EPS[D] |ref| + F32_EVAL scale (F32_EVAL = 2^-20, accuracy.py); a convention hands it `scale` through Expect.source
(pair_scale of a non-negative source is at least the source itself), so each scale below is the error argument:
- forward: the sum of d squares in any order errs by at most (d - 1) u relative (all terms positive), the mean
  and + eps one u each, rsqrt up to 4 u (the GPU's rsqrt.approx.f32: 2^-22.9): r within (d/2 + 5) u; a = x r w
  two or three more roundings; the rotation's own error is the rope model's 2^-20 on S = |a_i| + |a_partner|
  (|a_i| on the tail). In all at most (2^-20 + (d/2 + 8) u) S: scale K_FWD(d) S, K_FWD = 1 + (d + 16) / 32.
- input gradient g_x = r (g_n - n mean(g_n n)), g_n = R^T(g) w: R^T(g)_i within 2^-20 G_i (G: g's pair scale, |g_i|
  on the tail), |R^T(g)_i| <= G_i. r's error enters three times (r, n, and n inside the mean), the mean's sum of
  d products (d + 1) u: at most (2^-20 + (3 d + 32) u) B with B_i = r (G_i |w_i| + |n_i| mean_j(G_j |w_j| |n_j|)):
  scale K_BWD(d) B, K_BWD = 1 + (3 d + 32) / 16.
- weight gradient g_w_j = sum over the N tokens x heads of R^T(g)_j n_j: each term within (2^-20 + (d/2 + 8) u)
  G_j |n_j|, and a float32 sum of N terms in any order within (N - 1) u sum |terms| (Higham, Accuracy and
  Stability, 4.2): scale K_W sum_terms G_j |n_j|, K_W = 1 + (d/2 + 8 + N) / 16. The any-order bound grows with
  N: on the CPU's plans (N <= 60) it is within 2^-17 of the terms' sum; the device plans keep N <= 2^13.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import pairing


def k_fwd(d: int) -> float:
    return 1 + (d + 16) / 32


def k_bwd(d: int) -> float:
    return 1 + (3 * d + 32) / 16


def k_w(d: int, terms: int) -> float:
    return 1 + (d / 2 + 8 + terms) / 16


def norm(x, w, eps: float, gemma: bool):
    """(r [..., 1], n, a = n * w_eff) in float64, differentiable in x and w."""
    x = x.double()
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    n = x * r
    return r, n, n * (w.double() + 1.0 if gemma else w.double())


def norm_rope(x, w, eps, gemma, cos, sin, interleaved):
    """y = R(RMSNorm(x) w) by per-channel cos/sin [..., rot] broadcast against x[..., :rot] (float64)."""
    return pairing.rotate(norm(x, w, eps, gemma)[2], cos, sin, interleaved)


def elementwise_scale(t, rot: int, interleaved: bool):
    """|t_i| + |t_partner(i)| on the rotated channels, |t_i| on the tail."""
    s = pairing.pair_scale(t, rot, interleaved)
    s[..., rot:] = t.detach().double().abs()[..., rot:]
    return s


def forward_source(x, w, eps, gemma, rot, interleaved):
    """Expect.source of the forward: K_FWD(d) S (module docstring)."""
    a = norm(x.detach(), w.detach(), eps, gemma)[2]
    return k_fwd(x.shape[-1]) * elementwise_scale(a, rot, interleaved)


def input_grad_scale(up, x, w, eps, gemma, rot, interleaved):
    """K_BWD(d) B, the scale of the input's gradient (module docstring); up, x [..., d]."""
    r, n, _ = norm(x.detach(), w.detach(), eps, gemma)
    weff = (w.detach().double() + 1.0 if gemma else w.detach().double()).abs()
    g = elementwise_scale(up, rot, interleaved) * weff
    return k_bwd(x.shape[-1]) * r * (g + n.abs() * (g * n.abs()).mean(-1, keepdim=True))


def weight_grad_scale(up, x, w, eps, gemma, rot, interleaved):
    """K_W sum over tokens and heads of G_j |n_j| [d] (module docstring); up, x [..., d]."""
    n = norm(x.detach(), w.detach(), eps, gemma)[1]
    terms = n.numel() // max(n.shape[-1], 1)
    total = (elementwise_scale(up, rot, interleaved) * n.abs()).reshape(-1, n.shape[-1]).sum(0)
    return k_w(x.shape[-1], terms) * total


# ---------------------------------------------------------------------------------------- the eager schedule

def cuda_threads(rows: int, d: int) -> tuple:
    """(threads per row, channels per load) of PyTorch's CUDA reduction of a contiguous float32 [rows, d] tensor over
    d (ATen's Reduce.cuh, torch 2.10 and later): set_block_dimension with 512 threads a block, loads of 4 channels
    from d = 128 on (setReduceConfig)."""
    vec = 4 if d >= 128 else 1
    dim0 = d // vec
    dim0_pow2 = 2 ** int(np.log2(dim0)) if dim0 < 512 else 512
    dim1_pow2 = 2 ** int(np.log2(max(rows, 1))) if rows < 512 else 512
    width = min(dim0_pow2, 32)
    height = min(dim1_pow2, 512 // width)
    return min(dim0_pow2, 512 // height), vec


def cuda_row_mean_of_squares(row: np.ndarray, rows: int) -> np.float32:
    """mean(row^2) of one float32 row of a [rows, d] tensor as that kernel computes it: thread j sums its channels
    (without vectorized loads j, j + W, ..., the m-th into accumulator m % 4; with them, channel i of its vectors j,
    j + W, ... into accumulator i), then ((a0 + a1) + a2) + a3; the threads' sums folded in half (j adds j + h,
    h = W / 2, ..., 1); times float32(rows) / float32(rows * d). Every operation a float32 one."""
    f32 = np.float32
    d = row.shape[0]
    width, vec = cuda_threads(rows, d)
    sq = [f32(v) * f32(v) for v in row]
    threads = []
    for j in range(width):
        acc = [f32(0)] * 4
        if vec == 4:
            for v in range(j, d // 4, width):
                for i in range(4):
                    acc[i] = f32(acc[i] + sq[4 * v + i])
        else:
            for m, c in enumerate(range(j, d, width)):
                acc[m % 4] = f32(acc[m % 4] + sq[c])
        threads.append(f32(f32(f32(acc[0] + acc[1]) + acc[2]) + acc[3]))
    while len(threads) > 1:
        half = len(threads) // 2
        threads = [f32(threads[j] + threads[j + half]) for j in range(half)]
    return f32(threads[0] * f32(f32(rows) / f32(rows * d)))


def eager_variance(h: torch.Tensor) -> torch.Tensor:
    """`h.pow(2).mean(-1, keepdim=True)` of float32 h as PyTorch's CUDA kernels give it for h's values as a
    contiguous tensor (Qwen3 normalises the contiguous projection): on CUDA that expression itself; elsewhere
    `cuda_row_mean_of_squares` row by row (PyTorch's CPU kernels sum in another order)."""
    if h.is_cuda:
        return h.contiguous().pow(2).mean(-1, keepdim=True)
    flat = h.detach().reshape(-1, h.shape[-1]).cpu().numpy()
    means = [cuda_row_mean_of_squares(r, flat.shape[0]) for r in flat]
    return torch.tensor(np.array(means, dtype=np.float32).reshape(*h.shape[:-1], 1), device=h.device)
