"""transformers' multimodal RoPE convention (Qwen2-VL's):
    apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1) -> (q_embed, k_embed)
    cos = cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section * 2, dim=-1))], dim=-1)  (sin alike)
    q_embed = q * cos + rotate_half(q) * sin
q, k [b, h, s, d]; cos, sin [3, b, s, d]: one table per position stream (temporal, height, width), gathered by
the model's rotary module at each stream's position ids, cat(freqs, freqs), in the activations' dtype. Liger's
`liger_multimodal_rotary_pos_emb` has the signature; its kernel reads the first half of each cos/sin row, indexes
cos with the full batch, computes in cos's dtype and writes q and k (their [b, s, h, d] memory) in place.
Qwen3-VL's interleaved sections are not part of transformers' function (its rotary module builds them into
cos/sin): a callable whose signature has `mrope_interleaved` (rope.hf's) gets them as that keyword.

Canonical call -> convention (`wrap_mrope`): as hf.py, q = t seen as [b, h, s, d] (thd as one row of T tokens),
partial rotary by slicing q[..., :d2]; positions [3, *lead] (one stream: repeated) seen batch-major as [3, b, s];
cos/sin = cos/sin(freqs[positions]) per stream, [3, b, s, d2] in t's dtype as a model's rotary module hands them
over (so 16-bit results are rounded twice: float32 only is checked); k a copy of q. Named liger-mrope: q as a copy
laid out as a projection gives it, since the kernel writes it. No GPT-J pairs (rotate_half), equal pair halves
only (the tables are cat(theta, theta)). TE's call -> canonical: three equal streams (`te_via_mrope`).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from . import MRoPECapabilities, accepts, cos_sin, first_importable, te_via_mrope, three_streams
from .hf import CAPABILITIES as HF_CAPABILITIES
from .hf import from_bhsd, to_bhsd
from .liger import CAPABILITIES as LIGER_CAPABILITIES

CANDIDATES = {
    "hf-mrope": ("transformers.models.qwen2_vl.modeling_qwen2_vl:apply_multimodal_rotary_pos_emb",),
    "liger-mrope": ("liger_kernel.transformers.qwen2vl_mrope:liger_multimodal_rotary_pos_emb",),
}
INSTALL = {"hf-mrope": "pip install transformers", "liger-mrope": "pip install liger-kernel"}
WHAT = {"hf-mrope": "transformers (its Qwen2-VL model)", "liger-mrope": "Liger-Kernel (liger_kernel)"}
DISTS = {"hf-mrope": ("transformers",), "liger-mrope": ("liger-kernel", "liger_kernel")}  # for the report

CAPABILITIES = replace(HF_CAPABILITIES, notes="transformers' mRoPE call, three equal position streams")
LIGER = replace(LIGER_CAPABILITIES, notes="Liger's mRoPE call (in place), three equal position streams")
MROPE_CAPABILITIES = MRoPECapabilities(
    interleaved=False, partial="adapter slices q[..., :d2]", dtypes=(torch.float32,),
    dtypes_why=HF_CAPABILITIES.dtypes_why, elementwise_freqs=False, bad_input="",
    notes="q [b, h, s, d], cos/sin [3, b, s, d2] gathered per stream")


def load_named(name):
    return first_importable(CANDIDATES[name], INSTALL[name], WHAT[name])


def mrope_capabilities(fn, in_place: bool) -> MRoPECapabilities:
    caps = replace(MROPE_CAPABILITIES, in_place=in_place)
    if in_place:
        caps = replace(caps, dtypes_why=LIGER_CAPABILITIES.dtypes_why, notes=caps.notes + "; in place")
    if not accepts(fn, "mrope_interleaved"):
        caps = replace(caps, mrope_interleaved=False)
    return caps


def wrap_mrope(fn, named=None):
    """The canonical mRoPE call (tests/adapters/mrope.py) -> fn(q, k, cos, sin, mrope_section)."""
    in_place = named == "liger-mrope"

    @functools.wraps(fn)
    def hf_mrope_as_canonical(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                              mrope_interleaved=False):
        if interleaved:
            raise ValueError("interleaved: the rotate_half convention pairs the two halves only")
        cos_table, sin_table = cos_sin(freqs)
        d2 = cos_table.shape[-1]
        pos = three_streams(positions, t.shape[:-2]).to(cos_table.device)
        if tensor_format == "sbhd":
            pos = pos.transpose(1, 2)  # [3, s, b] -> batch-major [3, b, s]
        elif tensor_format == "thd":
            pos = pos[:, None]  # one row of T tokens: [3, 1, T]
        cos, sin = cos_table[pos].to(t.dtype), sin_table[pos].to(t.dtype)  # [3, b, s, d2]
        q = to_bhsd(t, tensor_format)
        q_rot = q[..., :d2]
        if in_place:  # a differentiable copy, as a projection gives q: [b, s, h, d2] memory seen as [b, h, s, d2]
            q_rot = q_rot.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)
        k_rot = q_rot.detach().clone()
        kw = {"mrope_interleaved": True} if mrope_interleaved else {}  # transformers' function has no such keyword
        out = fn(q_rot, k_rot, cos, sin, list(mrope_section), **kw)[0]
        if d2 < q.shape[-1]:
            out = torch.cat([out, q[..., d2:]], dim=-1)
        return from_bhsd(out, tensor_format).contiguous()

    return hf_mrope_as_canonical, mrope_capabilities(fn, in_place)


def wrap(fn, named=None):
    return te_via_mrope(wrap_mrope(fn, named)[0]), LIGER if named == "liger-mrope" else CAPABILITIES
