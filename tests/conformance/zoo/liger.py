"""Liger-Kernel's convention (spec/liger.py): a correct implementation and planted bugs.

Each rotates q and k token by token as Liger's kernel does: the rows of q's [b, s, h, d] memory, token
(sequence i, position j) reading row j of cos/sin (of sequence i where cos has a batch), its first half only.
"""
from __future__ import annotations

import torch


def tables3(cos, sin):
    """Rank-2 tables [s, r] as the [1, s, r] they stand for."""
    return (cos[None], sin[None]) if cos.dim() == 2 else (cos, sin)


def per_token(table, b, s):
    """[b, s, r/2]: each token's half table (batch 1 shared by every sequence)."""
    half = table[..., : table.shape[-1] // 2]
    return half.expand(b, s, half.shape[-1])


def rotated(x, c, s_, sign=1.0):
    """x [b, h, s, >= r] rotated over its first r = 2 * c.shape[-1] channels by half tables [b, s, r/2], in float32
    (one rounding to x's dtype); a new tensor of width r."""
    half = c.shape[-1]
    c, s_ = c.float().unsqueeze(1), sign * s_.float().unsqueeze(1)
    x1, x2 = x[..., :half].to(torch.float32, copy=True), x[..., half: 2 * half].to(torch.float32, copy=True)
    return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1).to(x.dtype)


def rotate_in_place(x, c, s_, sign=1.0):
    x[..., : 2 * c.shape[-1]].copy_(rotated(x, c, s_, sign))


def correct(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos, sin = tables3(cos, sin)
    b, _, s, _ = q.shape
    c, s_ = per_token(cos, b, s), per_token(sin, b, s)
    rotate_in_place(q, c, s_)
    rotate_in_place(k, c, s_)
    return q, k


def row_stride_of_sequence_dim(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Liger's launcher (liger-kernel 0.8.5): it transposes q to [b, s, h, d], makes it contiguous, and addresses
    token t's heads at t * stride(1) + head * d. PyTorch leaves a size-1 dim's stride free, so with s = 1 a
    contiguous [b, h, 1, d] q is "contiguous" transposed too, with stride(1) = d, not h * d: token t reads and
    writes the heads of rows t .. t + h - 1 (on an H200, decode q [64, 32, 1, 128]: 8.4 off float64). Tokens are
    taken in order here, as the interpreter runs programs; other layouts are copied first, as `.contiguous()` does."""
    cos, sin = tables3(cos, sin)
    b, _, s, _ = q.shape
    c, s_ = per_token(cos, b, s), per_token(sin, b, s)
    out = []
    for x in (q, k):
        t = x.transpose(1, 2)
        if not t.is_contiguous():
            t = t.contiguous()  # a copy, rotated and returned (as the launcher does)
        h, d, row = t.shape[2], t.shape[3], t.stride(1)
        flat = t.as_strided((t.numel(),), (1,))
        size = t.untyped_storage().nbytes() // t.element_size()
        for token in range(b * s):
            at = flat.storage_offset() + token * row
            if at + h * d > size:  # past the allocation: the kernel would read and write other memory
                continue
            heads = flat.as_strided((1, h, 1, d), (0, d, 0, 1), at)
            rotate_in_place(heads, c[token // s, token % s][None, None], s_[token // s, token % s][None, None])
        out.append(t.transpose(1, 2))
    return out[0], out[1]


def writes_a_copy(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Rotates a contiguous copy (as `.contiguous()` before the kernel makes one for other layouts) and returns the
    caller's q and k, unwritten."""
    correct(q.contiguous().clone(), k.contiguous().clone(), cos, sin)
    return q, k


def second_half_reads_written_first(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """In place, the first half of each pair stored before the second half reads it (no temporary)."""
    cos, sin = tables3(cos, sin)
    b, _, s, _ = q.shape
    c, s_ = per_token(cos, b, s).unsqueeze(1), per_token(sin, b, s).unsqueeze(1)
    half = c.shape[-1]
    for x in (q, k):
        x1, x2 = x[..., :half], x[..., half: 2 * half]
        x1.copy_((x1.float() * c.float() - x2.float() * s_.float()).to(x.dtype))
        x2.copy_((x2.float() * c.float() + x1.float() * s_.float()).to(x.dtype))
    return q, k


def k_rows_by_q_heads(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """k's rows of [b, s, hk, d] memory are assigned to tokens with q's head count (hq rows per token), so with
    GQA k's heads read other tokens' angles."""
    cos, sin = tables3(cos, sin)
    b, hq, s, _ = q.shape
    hk = k.shape[1]
    c, s_ = per_token(cos, b, s), per_token(sin, b, s)
    rotate_in_place(q, c, s_)
    row = torch.arange(b * s * hk, device=k.device).view(b, s, hk)
    token = (row // hq).clamp(max=b * s - 1)  # the token a row of q-sized groups falls in
    ck = c.reshape(b * s, c.shape[-1])[token].permute(0, 2, 1, 3)  # [b, hk, s, r/2]
    sk = s_.reshape(b * s, c.shape[-1])[token].permute(0, 2, 1, 3)
    half = ck.shape[-1]
    kc, ks = ck.float(), sk.float()
    x1, x2 = k[..., :half].to(torch.float32, copy=True), k[..., half: 2 * half].to(torch.float32, copy=True)
    k[..., : 2 * half].copy_(torch.cat([x1 * kc - x2 * ks, x2 * kc + x1 * ks], dim=-1).to(k.dtype))
    return q, k


def ignores_table_batch(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Every sequence reads the first sequence's table (the batch stride of cos dropped)."""
    cos, sin = tables3(cos, sin)
    return correct(q, k, cos[:1], sin[:1])


def rank2_as_batch(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """A rank-2 table [s, r] taken with cos.shape[0] as its batch (Liger's earlier launcher): sequence i reads rows
    i * s + j, clamped to the table's last row, so every sequence past the first gets wrong angles."""
    if cos.dim() == 3:
        return correct(q, k, cos, sin)
    b, _, s, _ = q.shape
    rows = (torch.arange(b, device=cos.device)[:, None] * s + torch.arange(s, device=cos.device)).clamp(max=s - 1)
    return correct(q, k, cos[rows], sin[rows])


def pairs_split_at_head_half(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Partial rotary paired at the head's half (d/2) instead of the rotary width's: the tables padded with the
    identity (cos 1, sin 0) to d/2 angles, so every channel moves and the pairs are wrong."""
    cos, sin = tables3(cos, sin)
    b, _, s, d = q.shape
    pad = d // 2 - cos.shape[-1] // 2
    c = torch.cat([per_token(cos, b, s), torch.ones(b, s, pad, dtype=cos.dtype, device=cos.device)], dim=-1)
    s_ = torch.cat([per_token(sin, b, s), torch.zeros(b, s, pad, dtype=sin.dtype, device=sin.device)], dim=-1)
    rotate_in_place(q, c, s_)
    rotate_in_place(k, c, s_)
    return q, k


def zeroes_tail(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The channels past the rotary width are stored as zeros (a tile written whole)."""
    correct(q, k, cos, sin)
    r = cos.shape[-1]
    with torch.no_grad():
        q[..., r:].zero_()
        k[..., r:].zero_()
    return q, k


def sign_flipped(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """sin's sign flipped (the backward kernel's formula in the forward): every pair rotated by -theta."""
    cos, sin = tables3(cos, sin)
    b, _, s, _ = q.shape
    c, s_ = per_token(cos, b, s), per_token(sin, b, s)
    rotate_in_place(q, c, s_, -1.0)
    rotate_in_place(k, c, s_, -1.0)
    return q, k


class _ForwardAgainInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, c, s_):
        ctx.save_for_backward(c, s_)
        ctx.width = x.shape[-1]
        return rotated(x, c, s_)

    @staticmethod
    def backward(ctx, g):
        c, s_ = ctx.saved_tensors
        rest = g.new_zeros((*g.shape[:-1], ctx.width - g.shape[-1]))  # x's channels past the rotary width
        return torch.cat([rotated(g, c, s_), rest], dim=-1), None, None  # R again, not its transpose


def backward_not_transposed(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """The backward pass runs the forward rotation (the kernel's BACKWARD_PASS flag not passed)."""
    cos, sin = tables3(cos, sin)
    b, _, s, _ = q.shape
    c, s_ = per_token(cos, b, s), per_token(sin, b, s)
    for x in (q, k):
        x[..., : cos.shape[-1]].copy_(_ForwardAgainInBackward.apply(x, c, s_))
    return q, k


CORRECT = correct
BUGS = {
    "writes_a_copy": (writes_a_copy, ("forward",)),
    "row_stride_of_sequence_dim": (row_stride_of_sequence_dim, ("forward",)),
    "second_half_reads_written_first": (second_half_reads_written_first, ("forward",)),
    "k_rows_by_q_heads": (k_rows_by_q_heads, ("forward", "q_k_independent")),
    "ignores_table_batch": (ignores_table_batch, ("forward",)),
    "rank2_as_batch": (rank2_as_batch, ("forward", "rank2_tables")),
    "pairs_split_at_head_half": (pairs_split_at_head_half, ("forward",)),
    "zeroes_tail": (zeroes_tail, ("forward",)),
    "sign_flipped": (sign_flipped, ("forward",)),
    "backward_not_transposed": (backward_not_transposed, ("backward",)),
}
