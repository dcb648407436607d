"""rope: rotary position embedding in Triton, with TransformerEngine's API and semantics, and the
conventions of transformers (`rope.hf`), flash-attention (`rope.flash`) and vLLM (`rope.vllm`), and
multimodal RoPE (`rope.mrope`, and in `rope.hf` and `rope.vllm`), Meta's Llama (`rope.meta`) and
torchtitan (`rope.torchtitan`), DeepSeek-V4 (`rope.deepseek`), Megatron-LM's MLA training RoPE
(`rope.megatron`); QK-RMSNorm fused with RoPE (`rope.qknorm`) and RoPE fused with the KV-cache write
(`rope.serving`)."""
from . import deepseek, flash, hf, megatron, meta, mrope, qknorm, reference, serving, torchtitan, vllm
from ._checks import set_value_checks
from ._memo import clear as clear_caches
from ._table import set_angle_table
from .cache import RoPECache
from .embedding import RotaryPositionEmbedding
from .functional import apply_fused_qkv_rotary_pos_emb, apply_rotary_pos_emb, apply_rotary_pos_emb_qk

__all__ = [
    "apply_rotary_pos_emb", "apply_rotary_pos_emb_qk", "apply_fused_qkv_rotary_pos_emb", "RotaryPositionEmbedding",
    "RoPECache", "reference", "set_angle_table", "set_value_checks", "clear_caches", "hf", "flash", "vllm", "mrope",
    "meta", "torchtitan", "qknorm", "serving", "deepseek", "megatron",
]
__version__ = "0.2.0"
