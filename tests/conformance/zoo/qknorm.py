"""QK-RMSNorm + RoPE, training form (spec/qknorm.py): a correct implementation and planted bugs."""
from __future__ import annotations

import torch

from . import rotate_half, row_rms


def _rope(a, cos, sin, interleaved):
    rot = cos.shape[-1]
    head = a[..., :rot]
    return torch.cat([head * cos + rotate_half(head, interleaved) * sin, a[..., rot:]], dim=-1)


def _norm_rope(x, w, cos, sin, eps, ud, interleaved, gemma, rms=None, weight_after=False):
    xf = x.float()
    r = row_rms(xf, eps) if rms is None else rms(xf)
    weff = w.float() + 1.0 if gemma else w.float()
    cos, sin = cos.unsqueeze(ud).float(), sin.unsqueeze(ud).float()
    if weight_after:
        return (_rope(xf * r, cos, sin, interleaved) * weff).to(x.dtype)
    return _rope(xf * r * weff, cos, sin, interleaved).to(x.dtype)


def correct(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False, gemma=False):
    return tuple(_norm_rope(x, w, cos, sin, eps, unsqueeze_dim, interleaved, gemma)
                 for x, w in ((q, q_weight), (k, k_weight)))


def norm_over_rotated_only(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False,
                           gemma=False):
    """The mean of x^2 over the rotated channels only (partial rotary): the norm must span the head."""
    rot = cos.shape[-1]

    def rms(xf):
        return torch.rsqrt(xf[..., :rot].square().mean(-1, keepdim=True) + eps)

    return tuple(_norm_rope(x, w, cos, sin, eps, unsqueeze_dim, interleaved, gemma, rms)
                 for x, w in ((q, q_weight), (k, k_weight)))


def eps_outside_sqrt(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False, gemma=False):
    """rsqrt(mean(x^2)) + eps: eps added to the factor, not under the root."""
    def rms(xf):
        return torch.rsqrt(xf.square().mean(-1, keepdim=True)) + eps

    return tuple(_norm_rope(x, w, cos, sin, eps, unsqueeze_dim, interleaved, gemma, rms)
                 for x, w in ((q, q_weight), (k, k_weight)))


def weight_after_rotation(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False,
                          gemma=False):
    """R(n) * w: the weight applied to the rotated channels, where each channel's weight meets its partner's value."""
    return tuple(_norm_rope(x, w, cos, sin, eps, unsqueeze_dim, interleaved, gemma, weight_after=True)
                 for x, w in ((q, q_weight), (k, k_weight)))


def math_depends_on_batch(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False,
                          gemma=False):
    """One sequence sums its squares in float64, a batch in float32 (a decode path and a prefill path): each result
    within the norm's rounding, but a sequence's result depends on what else is in the batch."""
    def rms(xf):
        if xf.shape[0] != 1:
            return torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        return torch.rsqrt(xf.double().square().mean(-1, keepdim=True) + eps).float()

    return tuple(_norm_rope(x, w, cos, sin, eps, unsqueeze_dim, interleaved, gemma, rms)
                 for x, w in ((q, q_weight), (k, k_weight)))


def mean_over_all_heads(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False,
                        gemma=False):
    """One r per token: the mean of x^2 over all of its heads (a norm over the projection's width, as q_norm in
    OLMo 2 does, applied where the model normalises per head)."""
    hdim = unsqueeze_dim

    def rms(xf):
        return torch.rsqrt(xf.square().mean(dim=(hdim, -1), keepdim=True) + eps)

    return tuple(_norm_rope(x, w, cos, sin, eps, unsqueeze_dim, interleaved, gemma, rms)
                 for x, w in ((q, q_weight), (k, k_weight)))


def gemma_ignored(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False, gemma=False):
    """w where Gemma's 1 + w is asked."""
    return correct(q, k, q_weight, k_weight, cos, sin, eps, unsqueeze_dim, interleaved, False)


def sum_not_mean(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False, gemma=False):
    """rsqrt(sum(x^2) + eps): the sum of squares where the mean is meant."""
    def rms(xf):
        return torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)

    return tuple(_norm_rope(x, w, cos, sin, eps, unsqueeze_dim, interleaved, gemma, rms)
                 for x, w in ((q, q_weight), (k, k_weight)))


def q_uses_k_weight(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False, gemma=False):
    """One weight for both (k's): a kernel handed a single weight pointer."""
    return correct(q, k, k_weight, k_weight, cos, sin, eps, unsqueeze_dim, interleaved, gemma)


def weight_grad_one_head(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False,
                         gemma=False):
    """The weight gradients from head 0 only (a reduction over tokens that forgot the heads): the forward is right."""
    def one(x, w):
        h = x.shape[unsqueeze_dim]
        parts = [_norm_rope(x.narrow(unsqueeze_dim, i, 1), w if i == 0 else w.detach(), cos, sin, eps, unsqueeze_dim,
                            interleaved, gemma) for i in range(h)]
        return torch.cat(parts, dim=unsqueeze_dim)

    return one(q, q_weight), one(k, k_weight)


def _cuda_mean_of_squares(h):
    """h.pow(2).mean(-1, keepdim=True) for float32 h as PyTorch's CUDA kernels sum a row (Reduce.cuh, torch 2.10
    and later): on CUDA the expression; on the CPU its order, W threads a row (W by the row count N and d), each
    summing its channels into four accumulators, the threads folded in half, times float32(N) / float32(N d). Written
    apart from the spec's `qknorm_math.cuda_row_mean_of_squares`, so that the schedule verdicts compare two
    transcriptions of that order, not one with itself."""
    h = h.contiguous()
    if h.is_cuda:
        return h.pow(2).mean(-1, keepdim=True)
    d, n = h.shape[-1], max(h.numel() // max(h.shape[-1], 1), 1)
    vec = 4 if d >= 128 else 1
    p = min(1 << ((d // vec).bit_length() - 1), 512)
    w = min(p, 512 // min(1 << (n.bit_length() - 1), 512, 512 // min(p, 32)))
    sq = h.pow(2)
    acc = [torch.zeros(*h.shape[:-1], w) for _ in range(4)]
    for c in range(d):  # channel c: thread and accumulator as the kernel reads it
        if vec == 4:
            thread, slot = (c // 4) % w, c % 4
        else:
            thread, slot = c % w, (c // w) % 4
        acc[slot][..., thread] += sq[..., c]
    t = ((acc[0] + acc[1]) + acc[2]) + acc[3]
    while t.shape[-1] > 1:
        t = t[..., : t.shape[-1] // 2] + t[..., t.shape[-1] // 2:]
    factor = torch.tensor(float(n), dtype=torch.float32) / torch.tensor(float(n * d), dtype=torch.float32)
    return t * factor


def _qwen3(x, w, cos, sin, eps, ud, interleaved, gemma, weight_in_float32=False):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(_cuda_mean_of_squares(h) + eps)
    if gemma:
        y = (h * (1.0 + w.float())).type_as(x)
    else:
        y = (w.float() * h).to(x.dtype) if weight_in_float32 else w * h.to(x.dtype)
    return _rope(y, cos.unsqueeze(ud), sin.unsqueeze(ud), interleaved)


def eager(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False, gemma=False):
    """Qwen3RMSNorm (Gemma3RMSNorm) and transformers' rotation as a model in one dtype runs them eagerly on CUDA
    (not a planted bug: the schedule `eager`, within the `dtype` accuracy model)."""
    return tuple(_qwen3(x, w, cos, sin, eps, unsqueeze_dim, interleaved, gemma)
                 for x, w in ((q, q_weight), (k, k_weight)))


def eager_weight_in_float32(q, k, q_weight, k_weight, cos, sin, eps=1e-6, unsqueeze_dim=1, interleaved=False,
                            gemma=False):
    """Qwen3's weight applied in float32 before the one rounding (Gemma's way): accurate, not the eager schedule
    (test_zoo.SCHEDULE_VERDICTS)."""
    return tuple(_qwen3(x, w, cos, sin, eps, unsqueeze_dim, interleaved, gemma, weight_in_float32=True)
                 for x, w in ((q, q_weight), (k, k_weight)))


# the eager schedule holds for a model run in one dtype: weights and tables in q's
for _fn in (eager, eager_weight_in_float32):
    _fn.rope_capabilities = dict(weight_dtypes="q", float32_tables=False, mixed_tables=False, accuracy="dtype")

CORRECT = correct
BUGS = {
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "norm_over_rotated_only": (norm_over_rotated_only, ("forward", "rotation_preserves_norm")),
    "eps_outside_sqrt": (eps_outside_sqrt, ("forward",)),
    "weight_after_rotation": (weight_after_rotation, ("forward", "equals_rope_of_norm")),
    "mean_over_all_heads": (mean_over_all_heads, ("forward", "rotation_preserves_norm")),
    "gemma_ignored": (gemma_ignored, ("forward", "unit_rms_limit")),
    "sum_not_mean": (sum_not_mean, ("forward", "unit_rms_limit", "rotation_preserves_norm")),
    "q_uses_k_weight": (q_uses_k_weight, ("forward", "q_k_independent")),
    "weight_grad_one_head": (weight_grad_one_head, ("backward",)),
}
