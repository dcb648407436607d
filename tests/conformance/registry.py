"""Implementations as namespaces of conventions: {convention: callable}, with declared capabilities.

`--rope-impl` resolves here for the native suite:
    NAME                          a named implementation: every convention it has (NAMED below)
    CONVENTION:module:callable    one callable in one convention (spec.NAMES)
    module:callable               te:module:callable (TransformerEngine's convention, the library's first)
A target declares what it lacks, so that a missing feature is reported as "not supported" instead of
failing every property: a `rope_capabilities` attribute on the callable ({capability: value}), a
`ROPE_CAPABILITIES` dict in its module ({convention: {capability: value}}), or `--rope-caps
"gqa=false,dtypes=float32"` (spec/<convention>.py lists each convention's capabilities).
"""
from __future__ import annotations

import functools
import importlib
from typing import NamedTuple

import torch

from . import spec

# named implementation -> (its distributions on the package index, how to install it): for the report's version
# row and for the one line that says a named implementation is not installed here
DISTRIBUTIONS = {
    "rope": (("rope-triton",), "pip install -e . (this repository)"),
    "rope-eager": (("rope-triton",), "pip install -e . (this repository)"),
    "rope-float32": (("rope-triton",), "pip install -e . (this repository)"),
    "hf": (("transformers",), "pip install transformers"),
    "flash": (("flash-attn", "flash_attn"),
              "pip install flash-attn --no-build-isolation (its Triton rotary needs the package to import; "
              "FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE skips the CUDA build)"),
    "liger": (("liger-kernel", "liger_kernel"), "pip install liger-kernel"),
    "liger-mrope": (("liger-kernel", "liger_kernel"), "pip install liger-kernel"),
    "vllm": (("vllm",), "pip install vllm (its rotary ops need a CUDA build)"),
    "te": (("transformer-engine", "transformer_engine", "transformer-engine-torch"),
           "pip install --no-build-isolation 'transformer_engine[pytorch]' (needs CUDA)"),
    "megatron": (("megatron-core", "megatron_core"),
                 "pip install megatron-core (its fused MLA RoPE is a Triton kernel: it needs a CUDA device)"),
}

# named implementation -> {convention: (candidate "module:attr" paths, declared capabilities)}
NAMED = {
    "rope": {
        "te": (("rope:apply_rotary_pos_emb",), {}),
        "hf": (("rope.hf:apply_rotary_pos_emb",), {}),
        "hf-single": (("rope.hf:apply_rotary_pos_emb_single",), {}),
        "hf-glm": (("rope.hf:apply_rotary_pos_emb_glm",), {}),
        "hf-deepseek-v3": (("rope.hf:apply_rotary_pos_emb_interleave",), {}),
        "deepseek-v4": (("rope.deepseek:apply_rotary_pos_emb",), {}),
        "megatron-mla": (("rope.megatron:fused_mla_rope_inplace",), {}),
        "megatron-mla-kv": (("rope.megatron:fused_mla_rope_kv_split",), {}),
        "flash": (("rope.flash:apply_rotary_emb",), {}),
        "vllm": (("rope.vllm:rotary_embedding",), {}),
        "hf-mrope": (("rope.hf:apply_multimodal_rotary_pos_emb",), {}),
        "qwen3vl-mrope": (("rope.hf:apply_multimodal_rotary_pos_emb",), {"_keywords": {"mrope_interleaved": True}}),
        "vllm-mrope": (("rope.vllm:mrotary_embedding",), {}),
        "mrope": (("rope.mrope:apply_multimodal_rotary_pos_emb",), {}),
        "te-qkv": (("rope:apply_fused_qkv_rotary_pos_emb",), {}),
        "qknorm": (("rope.qknorm:apply",), {}),
        "vllm-qknorm": (("rope.qknorm:fused_qk_norm_rope",), {}),
        "te-qknorm": (("rope.qknorm:apply_freqs",), {}),
        "qknorm-cache": (("rope.qknorm:apply_cache",), {}),
        "vllm-cache": (("rope.serving:rope_and_cache",), {}),
        "sglang-cache": (("rope.serving:apply_rope_inplace_with_kvcache",), {}),
        "meta": (("rope.meta:apply_rotary_emb",), {}),
        "torchtitan-complex": (("rope.torchtitan:complex_rope",), {}),
        "torchtitan-cossin": (("rope.torchtitan:cossin_rope",), {}),
    },
    # rope's schedules (`schedule=`): "eager" rounds as the conventions' PyTorch expressions run eagerly (the `dtype`
    # accuracy model, as transformers' own), "float32" each float32 operation; run with --rope-schedule of the same
    # name for the bitwise verdict
    **{f"rope-{schedule}": {
        **{conv: ((path,), {"_keywords": {"schedule": schedule},
                            **({"accuracy": "dtype"} if schedule == "eager" else {})})
           for conv, path in (("hf", "rope.hf:apply_rotary_pos_emb"),
                              ("hf-single", "rope.hf:apply_rotary_pos_emb_single"),
                              ("hf-glm", "rope.hf:apply_rotary_pos_emb_glm"), ("vllm", "rope.vllm:rotary_embedding"))},
        # QK norm's eager schedule reproduces a model run in one dtype (weights and tables in q's) and PyTorch's
        # reduction of a row, whose order follows the tensor's row count: not batch invariant, as PyTorch's own
        **({"qknorm": (("rope.qknorm:apply",), {"_keywords": {"schedule": "eager"}, "accuracy": "dtype",
                                                "weight_dtypes": "q", "float32_tables": False,
                                                "mixed_tables": False, "batch_invariant": False})}
           if schedule == "eager" else {})}
        for schedule in ("eager", "float32")},
    # transformers evaluates its expression in the activations' dtype; 5.x has no position_ids parameter
    # Llama's and Gemma's functions rotate the whole head (partial rotary is GPT-NeoX's, Phi's, Qwen3-Next's: run those
    # as hf:transformers.models.qwen3_next.modeling_qwen3_next:apply_rotary_pos_emb)
    "hf": {"hf": (("transformers.models.llama.modeling_llama:apply_rotary_pos_emb",),
                  {"accuracy": "dtype", "position_ids": False, "partial": False}),
           "hf-single": (("transformers.models.gemma4.modeling_gemma4:apply_rotary_pos_emb",
                          "transformers.models.gemma3n.modeling_gemma3n:apply_rotary_pos_emb"),
                         {"accuracy": "dtype", "partial": False}),
           "hf-glm": (("transformers.models.glm.modeling_glm:apply_rotary_pos_emb",
                       "transformers.models.glm4.modeling_glm4:apply_rotary_pos_emb"),
                      {"accuracy": "dtype", "position_ids": False}),
           # DeepSeek-V3's views the head as pairs and checks nothing (a narrow table broadcasts or fails inside)
           "hf-deepseek-v3": (("transformers.models.deepseek_v3.modeling_deepseek_v3:apply_rotary_pos_emb_interleave",),
                              {"accuracy": "dtype", "bad_input": False}),
           "deepseek-v4": (("transformers.models.deepseek_v4.modeling_deepseek_v4:apply_rotary_pos_emb",), {})},
    # Megatron-LM's MLA RoPE: a Triton kernel whose math runs in the promoted dtype of t and the tables (16-bit with
    # 16-bit tables: the dtype model); it asserts contiguous last dims and views t as [s * b, h, d] (sbhd), reads
    # position_ids as a dense array, launches a grid of s * b or T programs (none: an invalid launch), and checks with
    # asserts or not at all (a position past the tables is read out of bounds). Its backward rotates the upstream
    # gradient in that gradient's memory where it is contiguous (the backward property reports the write). Releases
    # without inverse, remove_interleaving or position_ids (older signatures) lack those (absent_caps).
    "megatron": {"megatron-mla": (("megatron.core.fusions.fused_mla_yarn_rope_apply:fused_mla_rope_inplace",),
                                  {"accuracy": "dtype", "strides": False, "empty": False, "bad_input": False}),
                 # its KV split: the same kernel conventions, tl.arange over k_dim, v_dim and emb_dim / 2 (powers of
                 # two), contiguous tables (asserted), kv and k_pos_emb viewed flat in sbhd; releases before
                 # remove_interleaving and the out buffers lack those, and the oldest name it
                 # fused_apply_mla_rope_for_kv (absent_caps)
                 "megatron-mla-kv": (("megatron.core.fusions.fused_mla_yarn_rope_apply:fused_mla_rope_kv_split",
                                      "megatron.core.fusions.fused_mla_yarn_rope_apply:fused_apply_mla_rope_for_kv"),
                                     {"accuracy": "dtype", "strides": False, "empty": False, "bad_input": False,
                                      "odd_widths": False})},
    # flash-attention's Triton apply_rotary asserts the tables are in x's dtype
    "flash": {"flash": (("flash_attn.layers.rotary:apply_rotary_emb",), {"float32_tables": False})},
    "liger": {"liger": (("liger_kernel.transformers.rope:liger_rotary_pos_emb",), {})},
    # Liger's mRoPE kernel: transformers' signature, q and k written where laid out as a projection gives them,
    # the first half of each table read, math in the tables' dtype
    "liger-mrope": {"hf-mrope": (("liger_kernel.transformers.qwen2vl_mrope:liger_multimodal_rotary_pos_emb",),
                                 {"in_place": True, "elementwise_tables": False, "accuracy": "dtype",
                                  "partial": False})},
    # vLLM's CUDA op: the cache in query's dtype, contiguous cache rows and int64 positions, math in query's dtype;
    # releases without rope_dim_offset or inverse (older signatures) lack those (absent_caps)
    "vllm": {"vllm": (("vllm._custom_ops:rotary_embedding",),
                      {"cache_dtypes": "query", "strided_cache": False, "strided_positions": False,
                       "int32_positions": False, "accuracy": "dtype"}),
             # its fused QK norm + RoPE: contiguous qkv, weights in qkv's dtype, int64 positions, head_dim 64/128/256
             "vllm-qknorm": (("vllm._custom_ops:fused_qk_norm_rope",),
                             {"weight_dtypes": "qkv", "strides": False, "int32_positions": False,
                              "head_dims": (64, 128, 256)})},
    # TE asserts contiguous qkv and freqs, and refuses start_positions with context parallelism; its kernel reads
    # start_positions as int32 and takes v's width as the head width of q and k (fused_rope.cu), neither checked;
    # its backward has no start_positions (TE documents them as inference only)
    # TE's apply_rotary_pos_emb with fused=True (its default, False, is the unfused PyTorch path) runs fused_rope.cu:
    # it reads freqs as a contiguous float32 [s2, d2] table from its data pointer (freqs.float() copies only other
    # dtypes: a float32 view is read wrongly), start_positions and cu_seqlens through int pointers (int64 values
    # are read as int32 words), launches a (s, b) grid (a size 0 is an invalid launch configuration: no empty
    # tensors), and checks its arguments with asserts and TORCH_CHECK (AssertionError, RuntimeError), some not at
    # all (start_positions past freqs is read out of bounds). Strided t and upstream gradients are read through
    # their strides; start_positions with context parallelism give cp_position(j) + start, as the contract says.
    # Releases without interleaved, start_positions or cp_size (older signatures) lack those (absent_caps).
    "te": {"te": (("transformer_engine.pytorch.attention.rope:apply_rotary_pos_emb",
                   "transformer_engine.pytorch.attention:apply_rotary_pos_emb"),
                  {"_keywords": {"fused": True}, "freqs_strides": False, "int64_start_positions": False,
                   "int64_cu_seqlens": False, "empty": False, "bad_input": False}),
           "te-qkv": (("transformer_engine.pytorch.attention.rope:apply_fused_qkv_rotary_pos_emb",
                       "transformer_engine.pytorch.attention:apply_fused_qkv_rotary_pos_emb"),
                      {"strides": False, "cp_start_positions": False, "int64_start_positions": False,
                       "v_width": False, "backward_start_positions": False})},
}
OURS = ("rope", "rope:apply_rotary_pos_emb", "rope.functional:apply_rotary_pos_emb")


class Native(NamedTuple):
    fns: dict  # convention -> callable
    caps: dict  # convention -> declared capabilities
    missing: dict  # convention -> why it could not be imported (named implementations only)
    name: str = ""  # the --rope-impl text it was resolved from

    def __repr__(self):  # short: Hypothesis prints it in every failing example
        return f"Native({self.name!r})"


def import_attr(path: str):
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def parse_caps(text: str) -> dict:
    """"gqa=false,dtypes=float32+bfloat16,accuracy=dtype" -> {"gqa": False, "dtypes": (float32, bfloat16), ...};
    a value with '+' or naming a dtype is a tuple, true/false a bool, digits an int."""
    out = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--rope-caps: expected KEY=VALUE, got {item!r}")
        parts = value.split("+")
        if all(hasattr(torch, p) and isinstance(getattr(torch, p), torch.dtype) for p in parts):
            out[key] = tuple(getattr(torch, p) for p in parts)
        elif value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        elif len(parts) > 1:
            out[key] = tuple(int(p) if p.isdigit() else p for p in parts)
        else:
            out[key] = int(value) if value.isdigit() else value
    return out


def declared(fn, module, convention: str) -> dict:
    caps = dict(getattr(fn, "rope_capabilities", None) or {})
    per_module = getattr(module, "ROPE_CAPABILITIES", None) or {}
    return {**per_module.get(convention, {}), **caps}


def absent_caps(conv: str, fn) -> dict:
    """The capabilities off for a callable whose signature lacks optional parameters the convention has
    (`PARAMETER_CAPS`: an older release's signature): those the parameters carry, and `explicit_defaults`, so
    that no argument it lacks is passed at its default either. None where the signature cannot be read or takes
    **kwargs."""
    import inspect

    needs = spec.load(conv).PARAMETER_CAPS
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if not needs or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {}
    off = {k: v for name, caps in needs.items() if name not in params for k, v in caps.items()}
    return {**off, "explicit_defaults": False} if off else {}


def resolve(spec_text: str, cli_caps: str = "") -> Native:
    """--rope-impl -> the native namespace. Unknown conventions are a ValueError; a named implementation with
    none of its conventions importable has them all in `missing`."""
    spec_text = (spec_text or "").strip()
    extra = parse_caps(cli_caps)
    name = "rope" if spec_text in OURS else spec_text
    if name in NAMED:
        fns, caps, missing = {}, {}, {}
        for conv, (paths, defaults) in NAMED[name].items():
            errors = []
            for path in paths:
                try:
                    fns[conv] = import_attr(path)
                    break
                except Exception as e:  # noqa: BLE001 - not installed, or an install that fails to import
                    errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120])
            if conv in fns:
                defaults = dict(defaults)
                keywords = defaults.pop("_keywords", None)  # a fixed keyword makes the callable this convention
                if keywords:
                    fns[conv] = functools.partial(fns[conv], **keywords)
                defaults.update(absent_caps(conv, fns[conv]))
                caps[conv] = {**defaults, **extra}
            else:
                missing[conv] = errors[0] if errors else "no candidate"
        return Native(fns, caps, missing)
    parts = spec_text.split(":")
    if len(parts) == 2 and all(parts):  # module:callable: TransformerEngine's convention
        parts = ["te", *parts]
    if len(parts) == 3 and parts[0] in spec.NAMES:
        conv, path = parts[0], f"{parts[1]}:{parts[2]}"
        fn = import_attr(path)
        module = importlib.import_module(parts[1])
        return Native({conv: fn}, {conv: {**absent_caps(conv, fn), **declared(fn, module, conv), **extra}}, {})
    return Native({}, {}, {})  # TE's convention, or a convention the TE bridges alone know
