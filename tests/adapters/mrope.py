"""The canonical multimodal RoPE (mRoPE) convention: `rope.mrope.apply_multimodal_rotary_pos_emb`'s signature,
    fn(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False, mrope_interleaved=False) -> out
t [T, h, d] (thd), [s, b, h, d] (sbhd) or [b, s, h, d] (bshd); freqs [s2, 1, 1, d2] (or a rope.RoPECache);
positions [3, *lead] (temporal, height, width; lead: t's token dims) or one stream [*lead]; mrope_section: rotary
pairs per stream, summing to d2 / 2. Returns a new tensor of t's shape and dtype, differentiable in t.

Named `rope-mrope`: this package's; `mrope:module:callable`: any callable with that signature. The mRoPE adapter
is the identity. TE's call maps onto it with three equal position streams (`te_via_mrope`: start_positions,
cu_seqlens and the context-parallel layout become positions), so the TE suite checks it as plain RoPE.
"""
from __future__ import annotations

from . import Capabilities, MRoPECapabilities, first_importable, te_via_mrope

CAPABILITIES = Capabilities(
    start_positions="adapter (positions)", context_parallel="adapter (positions)",
    bad_input="", notes="canonical mRoPE call, three equal position streams")
MROPE_CAPABILITIES = MRoPECapabilities(notes="identity")
CANDIDATES = {"rope-mrope": ("rope.mrope:apply_multimodal_rotary_pos_emb",)}
DISTS = {"rope-mrope": ("rope-triton",)}  # distribution names per named implementation, for the report
INSTALL = "pip install -e . (this repository)"


def load_named(name):
    return first_importable(CANDIDATES[name], INSTALL, "rope (rope.mrope)")


def wrap(fn, named=None):
    return te_via_mrope(fn), CAPABILITIES


def wrap_mrope(fn, named=None):
    return fn, MROPE_CAPABILITIES
