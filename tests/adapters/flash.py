"""flash-attention's convention:
    apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None) -> out
x is [b, s, h, d], or [total, h, d] with cu_seqlens (and max_seqlen); cos/sin are [seqlen_ro, rotary_dim / 2]
in x's dtype (flash asserts it): one angle per pair, so only angles equal within each pair are expressible
(half-split: freqs[..., :d2/2] == freqs[..., d2/2:]; interleaved: pairs equal). Token j of sequence i reads
row j + seqlen_offsets[i] (an int or a [b] tensor: TE's start_positions). Rotary width 2 * cos.shape[1] <= d
(partial rotary native). Its backward is the same kernel with conjugate=True.

Conversion: cos/sin = cos/sin of the first angle of each pair, rounded to t's dtype (so float32 only is checked:
the rounding breaks the one-rounding rule for 16-bit by design); sbhd runs as bshd through the transposed view
of the same memory; thd passes cu_seqlens and the longest local sequence as max_seqlen. No context parallelism
(a rank's positions are not contiguous). Outputs come back in TE's layout, contiguous.
"""
from __future__ import annotations

import functools

import torch

from . import Capabilities, first_importable, half_angles, local_lengths

CAPABILITIES = Capabilities(
    context_parallel="", dtypes=(torch.float32,),
    dtypes_why="cos/sin are taken in t's dtype (flash asserts it), rounded before the math",
    elementwise_freqs=False, bad_input="", notes="cos/sin [s2, d2/2] in t's dtype; sbhd as a bshd view")
CANDIDATES = ("flash_attn.layers.rotary:apply_rotary_emb",)
DISTS = ("flash-attn", "flash_attn")  # distribution names, for the report
INSTALL = ("pip install flash-attn --no-build-isolation (its Triton rotary needs the package to import; "
           "FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE skips the CUDA build)")


def load_named(name):
    return first_importable(CANDIDATES, INSTALL, "flash-attention (flash_attn)")


def wrap(fn, named=None):
    @functools.wraps(fn)
    def flash_as_te(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, cu_seqlens=None,
                    cp_size=1, cp_rank=0, **_):
        if cp_size != 1:
            raise ValueError("cp_size: flash-attention's convention has no context parallelism")
        theta = half_angles(freqs, interleaved)
        cos, sin = theta.cos().to(t.dtype).contiguous(), theta.sin().to(t.dtype).contiguous()
        kw = dict(interleaved=bool(interleaved), inplace=False)
        if start_positions is not None:
            kw["seqlen_offsets"] = start_positions
        if tensor_format == "thd":
            kw.update(cu_seqlens=cu_seqlens, max_seqlen=max(local_lengths(cu_seqlens), default=0))
        x = t.transpose(0, 1) if tensor_format == "sbhd" else t  # [b, s, h, d] (or [total, h, d])
        out = fn(x, cos, sin, **kw)
        return (out.transpose(0, 1) if tensor_format == "sbhd" else out).contiguous()

    return flash_as_te, CAPABILITIES
