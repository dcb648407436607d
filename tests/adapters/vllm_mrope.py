"""vLLM's multimodal RoPE convention (its `MRotaryEmbedding`), as a function (rope.vllm.mrotary_embedding's):
    fn(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True, mrope_interleaved=False)
        -> (query, key)
positions [3, T] (temporal, height, width; or [T], text: one stream); query [T, h * d], key [T, h_k * d], written
in place; cos_sin_cache [max_position, rot_dim] = cat(cos, sin) of half width (one angle per pair) in query's
dtype; pair i reads the stream of its section (or, mrope_interleaved, Qwen3-VL's layout); is_neox: half-split
pairs, else GPT-J's; channels past rot_dim untouched. Forward only, as vLLM's.

Named `vllm-mrope`: vLLM's `MRotaryEmbedding` module, built for the call's sizes with its `cos_sin_cache` buffer
replaced by the caller's table (vLLM computes its own from `base`; the suite's angles are arbitrary) and called
as vLLM's model layers call it (`forward`: vLLM's Triton mRoPE kernel on CUDA, `forward_native` elsewhere); it
returns new tensors in some releases, which the function writes back into query and key.

Canonical call -> convention (`wrap_mrope`): as vllm.py, tokens flat in t's own order ([s * b] for sbhd,
[b * s] bshd, [T] thd), positions [3, *lead] (one stream: repeated) flattened the same way to [3, T], query a copy
of t as [T, h * d], key a second copy, the cache cos/sin of the first angle of each pair in t's dtype (float32
only is checked). Backward: vllm.py's, the op at -theta on a copy of the gradient (the exact adjoint where pairs
share an angle). TE's call -> canonical: three equal streams (`te_via_mrope`).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from . import MRoPECapabilities, accepts, cos_sin, first_importable, te_via_mrope, three_streams
from .vllm import CAPABILITIES as VLLM_CAPABILITIES
from .vllm import _Rotate, flatten

CAPABILITIES = replace(VLLM_CAPABILITIES, notes="vLLM's mRoPE call (in place), three equal position streams")
MROPE_CAPABILITIES = MRoPECapabilities(
    partial="native", dtypes=(torch.float32,), dtypes_why=VLLM_CAPABILITIES.dtypes_why,
    backward=VLLM_CAPABILITIES.backward, in_place=True, elementwise_freqs=False, bad_input="",
    notes="flat tokens [T, h*d], positions [3, T], cos_sin_cache [s2, d2] = cat(cos, sin) halves")
CANDIDATES = {"vllm-mrope": ("vllm.model_executor.layers.rotary_embedding:MRotaryEmbedding",)}
DISTS = {"vllm-mrope": ("vllm",)}  # distribution names, for the report
INSTALL = "pip install vllm (its mRoPE kernel needs a CUDA build)"


def load_named(name):
    return vllm_function(first_importable(CANDIDATES[name], INSTALL, "vLLM (its MRotaryEmbedding)"))


def vllm_function(cls):
    """vLLM's MRotaryEmbedding class -> a function of the convention's signature (one module per sizes)."""
    modules = {}
    takes_interleaved = accepts(cls.__init__, "mrope_interleaved")

    def vllm_mrotary_embedding(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                               mrope_interleaved=False):
        rows, rot = cos_sin_cache.shape
        sizes = (head_size, rot, rows, is_neox, cos_sin_cache.dtype, tuple(mrope_section), mrope_interleaved)
        module = modules.get(sizes)
        if module is None:
            kw = {"mrope_interleaved": True} if mrope_interleaved else {}
            module = modules[sizes] = _build(cls, head_size, rot, rows, is_neox, cos_sin_cache.dtype,
                                             list(mrope_section), kw)
        module.cos_sin_cache = cos_sin_cache  # the caller's angles, in place of vLLM's from `base`
        q, k = module(positions, query, key)
        for mine, theirs in ((query, q), (key, k)):
            if theirs is not None and theirs.data_ptr() != mine.data_ptr():
                mine.copy_(theirs.reshape(mine.shape))
        return query, key

    vllm_mrotary_embedding.takes_mrope_interleaved = takes_interleaved
    return vllm_mrotary_embedding


def _build(cls, head_size, rot, rows, is_neox, dtype, sections, kw):
    """The module, built inside a default vLLM config where the release has one (its custom ops read it)."""
    args = (head_size, rot, rows, 10000.0, is_neox, dtype)
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
    except ImportError:
        return cls(*args, mrope_section=sections, **kw)
    with set_current_vllm_config(VllmConfig()):
        return cls(*args, mrope_section=sections, **kw)


def _takes_mrope_interleaved(fn) -> bool:
    known = getattr(fn, "takes_mrope_interleaved", None)  # vllm_function's: its class's constructor decides
    return accepts(fn, "mrope_interleaved") if known is None else known


def wrap_mrope(fn, named=None):
    """The canonical mRoPE call (tests/adapters/mrope.py) -> fn(positions [3, T], query, key, head_size, cache,
    mrope_section, is_neox), through vllm.py's forward-and-adjoint autograd function."""
    caps = MROPE_CAPABILITIES if _takes_mrope_interleaved(fn) else replace(MROPE_CAPABILITIES, mrope_interleaved=False)

    @functools.wraps(fn)
    def vllm_mrope_as_canonical(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                                mrope_interleaved=False):
        cos_table, sin_table = cos_sin(freqs)
        half = cos_table[:, 0::2] if interleaved else cos_table[:, : cos_table.shape[-1] // 2]
        half_sin = sin_table[:, 0::2] if interleaved else sin_table[:, : sin_table.shape[-1] // 2]
        cos, sin = half.to(t.dtype), half_sin.to(t.dtype)
        cache = torch.cat([cos, sin], dim=-1).contiguous()
        back_cache = torch.cat([cos, -sin], dim=-1).contiguous()
        pos = three_streams(positions, t.shape[:-2]).reshape(3, -1)  # tokens in t's own order, as flatten's
        kw = {"mrope_interleaved": True} if mrope_interleaved else {}
        sections = list(mrope_section)

        def op(pos_, query, key, head_size, cache_, is_neox):  # vllm.py's op signature, sections bound
            return fn(pos_, query, key, head_size, cache_, sections, is_neox, **kw)

        out = _Rotate.apply(flatten(t, tensor_format), op, pos, cache, back_cache, not interleaved)
        return out.reshape(t.shape)

    return vllm_mrope_as_canonical, caps


def wrap(fn, named=None):
    return te_via_mrope(wrap_mrope(fn, named)[0]), CAPABILITIES
