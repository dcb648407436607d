"""vLLM's convention (its `rotary_embedding` custom op, `vllm._custom_ops.rotary_embedding`):
    fn(positions, query, key, head_size, cos_sin_cache, is_neox) -> None
query [T, h * d] (key [T, h_k * d], or None in recent releases), written in place; positions [T] int64, one per
token; cos_sin_cache [max_position, rot_dim] = cat(cos, sin) of half width (one angle per pair) in query's
dtype; is_neox: half-split pairs (True) or GPT-J's interleaved ones (False); channels past rot_dim untouched.
Forward only: vLLM serves inference, its op has no autograd.

Conversion: every format becomes flat tokens in t's own order ([s * b] for sbhd, [b * s] for bshd, [T] for thd)
with per-token positions computed by the adapter (docs/contract.md section 3: start_positions, cu_seqlens and
the context-parallel layout all become positions); query is a copy of them as [T, h * d] (written in place), key
a second copy; the cache holds cos/sin of the first angle of each pair in t's dtype (float32 only is checked).
Backward: the adapter's, vLLM has none: the same op on the upstream gradient with cat(cos, -sin), the rotation
by -theta, which is the exact adjoint of a rotation (pairs share an angle here), so the forward is exercised in
both directions and the backward properties check it.
"""
from __future__ import annotations

import functools

import torch

from . import Capabilities, first_importable, half_angles, token_positions

CAPABILITIES = Capabilities(
    start_positions="adapter (positions)", context_parallel="adapter (positions)", dtypes=(torch.float32,),
    dtypes_why="cos_sin_cache is taken in query's dtype, rounded before the math",
    backward="adapter: the op at -theta (vLLM has none)", in_place=True, elementwise_freqs=False, bad_input="",
    notes="flat tokens [T, h*d], positions [T], cos_sin_cache [s2, d2] = cat(cos, sin) halves")
CANDIDATES = ("vllm.model_executor.layers.rotary_embedding:get_rope",)  # importable: vLLM is installed
KERNEL = "vllm._custom_ops:rotary_embedding"
DISTS = ("vllm",)  # distribution names, for the report
INSTALL = "pip install vllm (its rotary op needs a CUDA build)"


def load_named(name):
    first_importable(CANDIDATES, INSTALL, "vLLM (vllm.model_executor.layers.rotary_embedding)")
    return first_importable((KERNEL,), INSTALL, "vLLM's rotary_embedding op (vllm._custom_ops)")


def flatten(t, tensor_format):
    """t -> [T, h, d] tokens in t's own order (a view where t's layout allows)."""
    if tensor_format == "thd":
        return t
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


class _Rotate(torch.autograd.Function):
    """Forward: the op on copies; backward: the op at -theta on a copy of the gradient."""

    @staticmethod
    def forward(ctx, x, fn, positions, cache, back_cache, is_neox):
        ctx.fn, ctx.is_neox = fn, is_neox
        ctx.save_for_backward(positions, back_cache)
        return _run(fn, x, positions, cache, is_neox)

    @staticmethod
    def backward(ctx, g):
        positions, back_cache = ctx.saved_tensors
        return _run(ctx.fn, g, positions, back_cache, ctx.is_neox), None, None, None, None, None


def _run(fn, x, positions, cache, is_neox):
    T, h, d = x.shape
    query = x.detach().reshape(T, h * d).clone()  # [T, h * d], contiguous; written in place
    key = query.clone()
    fn(positions, query, key, d, cache, is_neox)
    return query.view(T, h, d)


def wrap(fn, named=None):
    @functools.wraps(fn)
    def vllm_as_te(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, cu_seqlens=None,
                   cp_size=1, cp_rank=0, **_):
        pos = token_positions(t.shape, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, t.device)
        if tensor_format == "sbhd":
            pos = pos.t()  # tokens in sbhd order: s-major
        theta = half_angles(freqs, interleaved)
        cos, sin = theta.cos().to(t.dtype), theta.sin().to(t.dtype)
        cache = torch.cat([cos, sin], dim=-1).contiguous()
        back_cache = torch.cat([cos, -sin], dim=-1).contiguous()
        out = _Rotate.apply(flatten(t, tensor_format), fn, pos.reshape(-1).contiguous(), cache, back_cache,
                            not interleaved)
        return out.reshape(t.shape)

    return vllm_as_te, CAPABILITIES
