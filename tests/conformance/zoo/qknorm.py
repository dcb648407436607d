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
