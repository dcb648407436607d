"""Pure-PyTorch stand-ins of the libraries' rotary functions, written from their documented semantics, so that the
adapters run on any machine (tests/test_adapters.py):

    pytest --rope-impl hf:tests.adapters.standins:hf_apply_rotary_pos_emb
    pytest --rope-impl flash:tests.adapters.standins:flash_apply_rotary_emb
    pytest --rope-impl liger:tests.adapters.standins:liger_rotary_pos_emb
    pytest --rope-impl vllm:tests.adapters.standins:vllm_rotary_embedding

Each keeps its library's signature, layouts, dtype handling and in-place behaviour; the `broken_*` ones have one
bug each, which the suite must catch through the adapter.
"""
from __future__ import annotations

import torch


def rotate_half(x):
    """transformers' rotate_half: cat(-x2, x1) over the two halves of the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' Llama apply_rotary_pos_emb: q, k [b, h, s, d]; cos, sin [b, s, d]."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def broken_hf_wrong_sign(q, k, cos, sin, unsqueeze_dim=1):
    """rotate_half as cat(x2, -x1): every pair rotated by -theta."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) - (rotate_half(q) * sin), (k * cos) - (rotate_half(k) * sin)


def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Liger-Kernel's semantics: q, k [b, h, s, d] rotated in place, returned; cos/sin [1 or b, s, d2], of which
    the first half is read (pairs share an angle); math in cos's dtype; rotary width d2 = cos width."""
    d2 = cos.shape[-1]
    c, s_ = cos[..., : d2 // 2].unsqueeze(1), sin[..., : d2 // 2].unsqueeze(1)
    for x in (q, k):
        x1, x2 = x[..., : d2 // 2].to(c.dtype), x[..., d2 // 2: d2].to(c.dtype)
        new = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1).to(x.dtype)
        x[..., :d2].copy_(new)
    return q, k


def flash_apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                           max_seqlen=None):
    """flash-attention's apply_rotary_emb: x [b, s, h, d] or [total, h, d] with cu_seqlens; cos/sin
    [seqlen_ro, d2/2] in x's dtype, evaluated in float32; token j of sequence i reads row j + seqlen_offsets[i]."""
    assert x.dtype == cos.dtype, "Input and cos/sin must have the same dtype"
    ro = cos.shape[-1] * 2
    if cu_seqlens is None:
        lengths = [x.shape[1]] * x.shape[0]
    else:
        cu = cu_seqlens.tolist()
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    offsets = seqlen_offsets.tolist() if isinstance(seqlen_offsets, torch.Tensor) else [seqlen_offsets] * len(lengths)
    pos = torch.tensor([j + off for n, off in zip(lengths, offsets, strict=True) for j in range(n)],
                       dtype=torch.int64, device=x.device).reshape(x.shape[:-2])  # [b, s] or [total]
    c, s_ = cos[pos].unsqueeze(-2).float(), sin[pos].unsqueeze(-2).float()  # broadcast over heads
    xr = x[..., :ro].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : ro // 2], xr[..., ro // 2:]
        rot = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1)
    out = torch.cat([rot.to(x.dtype), x[..., ro:]], dim=-1)
    if inplace:
        x.copy_(out)
        return x
    return out


def broken_flash_ignores_offsets(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                                 cu_seqlens=None, max_seqlen=None):
    """seqlen_offsets (start_positions) dropped: every sequence starts at row 0."""
    return flash_apply_rotary_emb(x, cos, sin, interleaved, inplace, 0, cu_seqlens, max_seqlen)


def vllm_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    """vLLM's rotary_embedding op: query [T, h * d] (key [T, h_k * d] or None) rotated in place at
    positions [T]; cos_sin_cache [max_pos, rot_dim] = cat(cos, sin) halves, in query's dtype; is_neox:
    half-split pairs, else GPT-J's (2i, 2i + 1)."""
    rot = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rot/2]
    cos, sin = cos[:, None], sin[:, None]
    for x in (query, key):
        if x is None:
            continue
        v = x.view(x.shape[0], x.shape[1] // head_size, head_size)
        r = v[..., :rot]
        if is_neox:
            x1, x2 = r[..., : rot // 2], r[..., rot // 2:]
            new = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = r[..., 0::2], r[..., 1::2]
            new = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        r.copy_(new)


def broken_vllm_neox_inverted(positions, query, key, head_size, cos_sin_cache, is_neox):
    """is_neox read the wrong way round: half-split calls pair interleaved channels and vice versa."""
    vllm_rotary_embedding(positions, query, key, head_size, cos_sin_cache, not is_neox)


def broken_liger_positions_ignored(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Reads row 0 of the batch's cos/sin for every sequence (batch-broadcast assumed)."""
    return liger_rotary_pos_emb(q, k, cos[:1], sin[:1], position_ids, unsqueeze_dim)
