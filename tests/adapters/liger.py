"""Liger-Kernel's convention: Hugging Face's (hf.py), as a Triton kernel that writes in place:
    liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1) -> (q, k)
q, k [b, h, s, d]; cos/sin [1 or b, s, d] (rotary width = cos width in liger >= 0.8; earlier releases rotate the
whole head); the kernel reads the first half of cos/sin only (pairs share an angle) and computes in cos's dtype,
writing q and k (their contiguous [b, s, h, d] memory) in place.

Conversion: as hf.py (positions gathered by the adapter, cos/sin in t's dtype as HF models hand them over, so
16-bit math: float32 only is checked; partial rotary by slicing; thd as one row with per-token positions;
context parallelism through positions), with q and k passed as copies since they are written in place.
"""
from __future__ import annotations

from dataclasses import replace

from . import first_importable
from .hf import CAPABILITIES as HF_CAPABILITIES
from .hf import convert

CAPABILITIES = replace(HF_CAPABILITIES, in_place=True,
                       dtypes_why="cos/sin in t's dtype (as HF models pass them): the kernel's math runs in it",
                       notes="HF convention, in place; reads the first half of cos/sin")
CANDIDATES = ("liger_kernel.transformers.rope:liger_rotary_pos_emb",)
DISTS = ("liger-kernel", "liger_kernel")  # distribution names, for the report
INSTALL = "pip install liger-kernel"


def load_named(name):
    return first_importable(CANDIDATES, INSTALL, "Liger-Kernel (liger_kernel)")


def wrap(fn, named=None):
    return convert(fn, in_place=True), CAPABILITIES
