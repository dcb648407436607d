"""QK-RMSNorm + RoPE at positions into vLLM's cos_sin_cache (spec/qknorm_cache.py): a correct implementation and
planted bugs."""
from __future__ import annotations

import torch

from . import per_channel, rotate_half, row_rms
from .te_qknorm import check_norm_args


def _check(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox, gemma, mrope_section, check_eps):
    check_norm_args(q, k, q_weight, k_weight, eps, check_eps, {"is_neox": is_neox, "gemma": gemma})
    if positions.dim() == 2 and mrope_section is None:
        raise ValueError("positions: [3, T] needs mrope_section")
    if mrope_section is not None and sum(mrope_section) != cos_sin_cache.shape[1] // 2:
        raise ValueError(f"mrope_section: expected sections summing to {cos_sin_cache.shape[1] // 2}")


def streams_of_pairs(section, pairs, interleaved, zero_only=False):
    if zero_only:
        return torch.zeros(pairs, dtype=torch.int64)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(list(section)))
    stream = torch.zeros(pairs, dtype=torch.int64)
    stream[1:3 * section[1]:3] = 1
    stream[2:3 * section[2]:3] = 2
    return stream


def _norm_rope(x, w, cos, sin, eps, interleaved, gemma, rms=None):
    xf = x.float()
    r = row_rms(xf, eps) if rms is None else rms(xf)
    a = xf * r * (w.float() + 1.0 if gemma else w.float())
    rot = cos.shape[-1]
    head = a[..., :rot]
    return torch.cat([head * cos + rotate_half(head, interleaved) * sin, a[..., rot:]], dim=-1).to(x.dtype)


def correct(q, k, q_weight, k_weight, positions, cos_sin_cache, eps=1e-6, is_neox=True, gemma=False,
            mrope_section=None, mrope_interleaved=False, _rms=None, _gemma=None, _neox=None, _zero_only=False,
            _mrope_interleaved=None, _index=False, _check_eps=True, _heads=None):
    _check(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, is_neox, gemma, mrope_section, _check_eps)
    t, half = q.shape[0], cos_sin_cache.shape[1] // 2
    pos = torch.arange(t, device=q.device).expand_as(positions) % cos_sin_cache.shape[0] if _index else positions
    if mrope_section is None:
        rows = cos_sin_cache[pos.long()].float()
    else:
        inter = mrope_interleaved if _mrope_interleaved is None else _mrope_interleaved
        stream = streams_of_pairs(mrope_section, half, inter, _zero_only).to(q.device)
        rows3 = cos_sin_cache[pos.long().expand(3, t)].float()  # [3, T, rot]
        pair = torch.arange(half, device=q.device)
        rows = torch.cat([rows3[stream, :, pair].t(), rows3[stream, :, half + pair].t()], dim=-1)
    neox = is_neox if _neox is None else _neox
    cos, sin = (per_channel(x, not neox).unsqueeze(1) for x in (rows[:, :half], rows[:, half:]))
    g = gemma if _gemma is None else _gemma
    out = [_norm_rope(x, w, cos, sin, eps, not neox, g, _rms) for x, w in ((q, q_weight), (k, k_weight))]
    if _heads is not None:
        out[1] = torch.cat([_norm_rope(k[:, i:i + 1], k_weight if i == 0 else k_weight.detach(), cos, sin, eps,
                                       not neox, g) for i in range(k.shape[1])], dim=1)
    return out[0], out[1]


def norm_over_rotated_only(*args, **kw):
    """The mean of x^2 over the rotary width only (partial rotary): the norm must span the head."""
    rot, eps = args[5].shape[1], kw.get("eps", 1e-6)
    return correct(*args, **kw, _rms=lambda xf: torch.rsqrt(xf[..., :rot].square().mean(-1, keepdim=True) + eps))


def gemma_ignored(*args, **kw):
    """w where Gemma's 1 + w is asked."""
    return correct(*args, **kw, _gemma=False)


def mrope_stream_zero_only(*args, **kw):
    """Multimodal positions read from stream 0 (the temporal row) for every pair (sglang #35345's symptom)."""
    return correct(*args, **kw, _zero_only=True)


def mrope_interleaved_ignored(*args, **kw):
    """Qwen3-VL's interleaved sections read as consecutive ones."""
    return correct(*args, **kw, _mrope_interleaved=False)


def neox_inverted(*args, **kw):
    """is_neox read the other way round."""
    return correct(*args, **kw, _neox=not kw.get("is_neox", True))


def token_index_as_position(*args, **kw):
    """Token i at position i (positions ignored, as a prefill of one sequence from 0 would pass)."""
    return correct(*args, **kw, _index=True)


def eps_unchecked(*args, **kw):
    """eps <= 0 accepted (a zero head then divides by zero instead of being refused)."""
    return correct(*args, **kw, _check_eps=False)


def k_weight_grad_one_head(*args, **kw):
    """k_weight's gradient from k's head 0 only (a reduction over tokens that forgot k's heads): forward right."""
    return correct(*args, **kw, _heads=True)


def math_depends_on_batch(*args, **kw):
    """One token sums its squares in float64, more in float32 (a decode path and a prefill path): each result within
    the norm's rounding, but a token's result depends on what else is in the call."""
    one, eps = args[0].shape[0] == 1, kw.get("eps", 1e-6)

    def rms(xf):
        if not one:
            return torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        return torch.rsqrt(xf.double().square().mean(-1, keepdim=True) + eps).float()

    return correct(*args, **kw, _rms=rms)


CORRECT = correct
BUGS = {
    "math_depends_on_batch": (math_depends_on_batch, ("batch_rows_alone",)),
    "norm_over_rotated_only": (norm_over_rotated_only, ("forward", "rotation_preserves_norm")),
    "gemma_ignored": (gemma_ignored, ("forward", "rotation_preserves_norm")),
    "mrope_stream_zero_only": (mrope_stream_zero_only, ("forward", "mrope_stream_locality")),
    "mrope_interleaved_ignored": (mrope_interleaved_ignored, ("forward",)),
    "neox_inverted": (neox_inverted, ("forward",)),
    "token_index_as_position": (token_index_as_position, ("forward", "tokens_independent")),
    "eps_unchecked": (eps_unchecked, ("refuses_bad_input",)),
    "k_weight_grad_one_head": (k_weight_grad_one_head, ("backward",)),
}
