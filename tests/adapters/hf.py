"""Hugging Face transformers' convention (Llama's):
    apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) -> (q_embed, k_embed)
    q_embed = q * cos + rotate_half(q) * sin,   rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])
q, k are [b, h, s, d]; cos/sin are [b, s, d], already gathered at each token's position (the model's rotary
module returns them for its position_ids, cat(freqs, freqs), in the activations' dtype). transformers 4.x also
took a `position_ids` argument (unused since 4.38, removed in 5): the adapter passes the four tensors only.

Conversion: q = t seen as [b, h, s, d] (sbhd/bshd; thd as one row of T tokens, [1, h, T, d], as packed
sequences with per-token position_ids are fed to HF models); every token's position is computed by the adapter
from the format, start_positions, cu_seqlens and the context-parallel layout (docs/contract.md section 3), and
cos/sin = cos/sin(freqs[position]) in t's dtype, as HF's rotary module gives them. k is a copy of q (the
result for k is not used). An in-place implementation (liger.py) gets q as a copy laid out as a projection
gives it ([b, s, h, d] memory seen as [b, h, s, d], canonical strides), t's own strides otherwise. No
interleaved pairs (rotate_half only). Partial rotary by slicing in the adapter: q[..., :d2] goes in, the result
is concatenated with t[..., d2:]. The rotate_half formula reads a cos/sin element per channel, but HF's rotary
modules (and kernels written for them, such as Liger's, which reads the first half only) produce
cat(theta, theta): the convention is equal pair halves only.
"""
from __future__ import annotations

import functools

import torch

from . import Capabilities, angles, first_importable, token_positions

CAPABILITIES = Capabilities(
    interleaved=False, partial="adapter slices q[..., :d2]", start_positions="adapter (positions)",
    context_parallel="adapter (positions)", dtypes=(torch.float32,),
    dtypes_why="cos/sin are taken in t's dtype (as HF's rotary module returns them), rounded before the math",
    elementwise_freqs=False, bad_input="", notes="q [b, h, s, d], cos/sin [b, s, d2] gathered by position")
CANDIDATES = ("transformers.models.llama.modeling_llama:apply_rotary_pos_emb",)
DISTS = ("transformers",)  # distribution names, for the report
INSTALL = "pip install transformers"


def load_named(name):
    return first_importable(CANDIDATES, INSTALL, "transformers")


def to_bhsd(t, tensor_format):
    if tensor_format == "sbhd":
        return t.permute(1, 2, 0, 3)
    if tensor_format == "bshd":
        return t.transpose(1, 2)
    return t.transpose(0, 1).unsqueeze(0)  # thd: one row of T tokens


def from_bhsd(x, tensor_format):
    if tensor_format == "sbhd":
        return x.permute(2, 0, 1, 3)
    if tensor_format == "bshd":
        return x.transpose(1, 2)
    return x[0].transpose(0, 1)


def convert(fn, in_place: bool):
    """TE's call -> fn(q, k, cos, sin); in_place: the convention writes q and k (the adapter passes copies)."""

    @functools.wraps(fn)
    def hf_as_te(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, cu_seqlens=None,
                 cp_size=1, cp_rank=0, **_):
        if interleaved:
            raise ValueError("interleaved: the rotate_half convention pairs the two halves only")
        d2 = freqs.shape[-1]
        pos = token_positions(t.shape, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, freqs.device)
        if tensor_format == "thd":
            pos = pos[None]  # [1, T]
        theta = angles(freqs)[pos]  # [b, s, d2]
        cos, sin = theta.cos().to(t.dtype), theta.sin().to(t.dtype)
        q = to_bhsd(t, tensor_format)
        q_rot = q[..., :d2]
        if in_place:  # a differentiable copy, as a projection gives q: [b, s, h, d2] memory seen as [b, h, s, d2]
            q_rot = q_rot.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)
        k_rot = q_rot.detach().clone()
        out = fn(q_rot, k_rot, cos, sin)[0]
        if d2 < q.shape[-1]:
            out = torch.cat([out, q[..., d2:]], dim=-1)
        return from_bhsd(out, tensor_format).contiguous()

    return hf_as_te


def wrap(fn, named=None):
    return convert(fn, in_place=False), CAPABILITIES
