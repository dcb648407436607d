"""TransformerEngine's convention: the suite's own; the adapter is the identity.

Named `te`: TE's `apply_rotary_pos_emb` with `fused=True` pinned (TE's default, fused=False, is its unfused
PyTorch path). Capabilities follow the installed signature: releases without `interleaved`, `start_positions`
or `cp_size` lack those. Named `rope`: this package's `rope.apply_rotary_pos_emb`, the default target.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import replace

from . import Capabilities, first_importable

CAPABILITIES = Capabilities(notes="identity")
CANDIDATES = ("transformer_engine.pytorch.attention.rope:apply_rotary_pos_emb",
              "transformer_engine.pytorch.attention:apply_rotary_pos_emb",
              "transformer_engine.pytorch.dot_product_attention.rope:apply_rotary_pos_emb")
DISTS = ("transformer-engine", "transformer_engine", "transformer-engine-torch")  # distribution names, for the report
INSTALL = "pip install --no-build-isolation 'transformer_engine[pytorch]' (needs CUDA)"


def load_named(name):
    if name == "rope":
        from rope import apply_rotary_pos_emb

        return apply_rotary_pos_emb
    return first_importable(CANDIDATES, INSTALL, "TransformerEngine (transformer_engine.pytorch)")


def signature_capabilities(fn) -> Capabilities:
    """TE releases grew interleaved (1.12), start_positions (2.x) and context parallelism: take what is there."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return CAPABILITIES
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return CAPABILITIES
    caps = CAPABILITIES
    if "interleaved" not in params:
        caps = replace(caps, interleaved=False)
    if "start_positions" not in params:
        caps = replace(caps, start_positions="")
    if "cp_size" not in params:
        caps = replace(caps, context_parallel="")
    return caps


def wrap(fn, named=None):
    if named != "te":
        return fn, CAPABILITIES

    @functools.wraps(fn)
    def te_fused(t, freqs, *args, **kwargs):
        return fn(t, freqs, *args, fused=True, **kwargs)

    return te_fused, replace(signature_capabilities(fn), notes="TE's fused kernel (fused=True pinned)")
