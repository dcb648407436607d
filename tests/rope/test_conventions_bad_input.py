"""Bad input to the conventions (rope.hf, rope.flash, rope.vllm, packed QKV, RoPECache, multimodal RoPE): each
case breaks one thing of a valid call; the call raises ValueError or TypeError naming the argument at fault, before any
launch, and every input (in place ones included) keeps its values."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

import rope

from .cases import DEVICE

OTHER_DEVICE = "cpu" if DEVICE != "cpu" else "meta"


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype).to(DEVICE)


def hf_args(**change):
    b, h, s, d = 2, 3, 5, 8
    kw = dict(q=_r(b, h, s, d), k=_r(b, 1, s, d), cos=_r(b, s, d), sin=_r(b, s, d))
    kw.update(change)
    return rope.hf.apply_rotary_pos_emb, kw


def hf_single_args(**change):
    kw = dict(x=_r(2, 3, 5, 9), cos=_r(1, 5, 6), sin=_r(1, 5, 6))
    kw.update(change)
    return rope.hf.apply_rotary_pos_emb_single, kw


def hf_glm_args(**change):
    b, h, s, d = 2, 3, 5, 8
    kw = dict(q=_r(b, h, s, d), k=_r(b, 1, s, d), cos=_r(b, s, 4), sin=_r(b, s, 4))
    kw.update(change)
    return rope.hf.apply_rotary_pos_emb_glm, kw


def hf_deepseek_args(**change):
    b, h, s, d = 2, 3, 5, 8
    kw = dict(q=_r(b, h, s, d), k=_r(b, 1, s, d), cos=_r(b, s, d), sin=_r(b, s, d))
    kw.update(change)
    return rope.hf.apply_rotary_pos_emb_interleave, kw


def deepseek_v4_args(**change):
    kw = dict(x=_r(2, 3, 5, 12), cos=_r(2, 5, 4), sin=_r(2, 5, 4))
    kw.update(change)
    return rope.deepseek.apply_rotary_pos_emb, kw


def megatron_args(**change):
    """sbhd: t [s, b, h, nope + emb] with nope 4, emb 8; tables [rows, 1, 1, emb]."""
    kw = dict(t=_r(5, 2, 3, 12), cos=_r(6, 1, 1, 8), sin=_r(6, 1, 1, 8), nope_dim=4, emb_dim=8)
    kw.update(change)
    return rope.megatron.fused_mla_rope_inplace, kw


def megatron_thd_args(**change):
    """thd: two sequences of 4 tokens on rank 1 of 2 (4 local rows) and a padding row; tables [rows, emb]."""
    kw = dict(t=_r(5, 3, 12), cos=_r(4, 8), sin=_r(4, 8), nope_dim=4, emb_dim=8,
              cu_seqlens_q=torch.tensor([0, 4, 8], dtype=torch.int32, device=DEVICE), cp_rank=1, cp_size=2)
    kw.update(change)
    return rope.megatron.fused_mla_rope_inplace, kw


def megatron_kv_args(**change):
    """sbhd: kv [s, b, h, k + v] with k 4, v 6, k_pos_emb [s, b, 1, emb] with emb 8; tables [rows, 1, 1, emb]."""
    kw = dict(kv=_r(5, 2, 3, 10), k_pos_emb=_r(5, 2, 1, 8), cos=_r(6, 1, 1, 8), sin=_r(6, 1, 1, 8), emb_dim=8,
              k_dim=4, v_dim=6)
    kw.update(change)
    return rope.megatron.fused_mla_rope_kv_split, kw


def megatron_kv_thd_args(**change):
    """thd: two sequences of 4 tokens on rank 1 of 2 (4 local rows) and a padding row, written into buffers."""
    kw = dict(kv=_r(5, 3, 10), k_pos_emb=_r(5, 1, 8), cos=_r(4, 8), sin=_r(4, 8), emb_dim=8, k_dim=4, v_dim=6,
              cu_seqlens_kv=torch.tensor([0, 4, 8], dtype=torch.int32, device=DEVICE), cp_rank=1, cp_size=2,
              out_key=_r(5, 3, 12), out_value=_r(5, 3, 6))
    kw.update(change)
    return rope.megatron.fused_mla_rope_kv_split, kw


def _kv_and_its_value_view():
    kv = _r(5, 3, 10)
    return dict(kv=kv, out_value=kv[..., 4:])


def flash_args(**change):
    kw = dict(x=_r(2, 5, 3, 8), cos=_r(7, 3), sin=_r(7, 3))
    kw.update(change)
    return rope.flash.apply_rotary_emb, kw


def flash_thd_args(**change):
    kw = dict(x=_r(6, 3, 8), cos=_r(7, 3), sin=_r(7, 3),
              cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE), max_seqlen=4)
    kw.update(change)
    return rope.flash.apply_rotary_emb, kw


def vllm_args(**change):
    t = 5
    kw = dict(positions=torch.tensor([0, 3, 1, 9, 2], device=DEVICE), query=_r(t, 4 * 16), key=_r(t, 2 * 16),
              head_size=16, cos_sin_cache=_r(10, 8), is_neox=True)
    kw.update(change)
    return rope.vllm.rotary_embedding, kw


def qkv_args(**change):
    kw = dict(qkv=_r(4, 2, 3, 8 + 4 + 4), q_freqs=_r(4, 1, 1, 4), k_freqs=_r(4, 1, 1, 4),
              qkv_split_arg_list=[8, 4, 4])
    kw.update(change)
    return rope.apply_fused_qkv_rotary_pos_emb, kw


def mrope_args(**change):
    t = 6
    kw = dict(t=_r(t, 3, 16), freqs=_r(10, 1, 1, 12), positions=torch.randint(0, 10, (3, t), device=DEVICE),
              mrope_section=[2, 2, 2])
    kw.update(change)
    return rope.mrope.apply_multimodal_rotary_pos_emb, kw


def mrope_qk_args(**change):
    kw = dict(q=_r(2, 5, 3, 16), k=_r(2, 5, 1, 16), freqs=_r(10, 1, 1, 12),
              positions=torch.randint(0, 10, (3, 2, 5), device=DEVICE), mrope_section=[2, 2, 2], tensor_format="bshd")
    kw.update(change)
    return rope.mrope.apply_multimodal_rotary_pos_emb_qk, kw


def hf_mrope_args(**change):
    b, h, s, d = 2, 3, 5, 8
    kw = dict(q=_r(b, h, s, d), k=_r(b, 1, s, d), cos=_r(3, b, s, d), sin=_r(3, b, s, d), mrope_section=[2, 1, 1])
    kw.update(change)
    return rope.hf.apply_multimodal_rotary_pos_emb, kw


def vllm_mrope_args(**change):
    t = 5
    kw = dict(positions=torch.randint(0, 10, (3, t), device=DEVICE), query=_r(t, 4 * 16), key=_r(t, 2 * 16),
              head_size=16, cos_sin_cache=_r(10, 12), mrope_section=[2, 2, 2])
    kw.update(change)
    return rope.vllm.mrotary_embedding, kw


CASES = [
    # multimodal RoPE
    ("mrope: sections not covering the pairs", mrope_args, dict(mrope_section=[2, 2, 1]), "mrope_section"),
    ("mrope: two sections", mrope_args, dict(mrope_section=[3, 3]), "mrope_section"),
    ("mrope: a negative section", mrope_args, dict(mrope_section=[4, 4, -2]), "mrope_section"),
    ("mrope: a float section", mrope_args, dict(mrope_section=[2.0, 2, 2]), "mrope_section"),
    ("mrope: a bool section", mrope_args, dict(mrope_section=[True, 3, 2]), "mrope_section"),
    ("mrope: interleaved sections that do not fit", mrope_args, dict(mrope_section=[0, 6, 0], mrope_interleaved=True),
     "mrope_section"),
    ("mrope: mrope_interleaved not a bool", mrope_args, dict(mrope_interleaved=1), "mrope_interleaved"),
    ("mrope: four streams", mrope_args, dict(positions=torch.zeros(4, 6, dtype=torch.int64, device=DEVICE)),
     "positions"),
    ("mrope: positions of other tokens", mrope_args, dict(positions=torch.zeros(3, 5, dtype=torch.int64,
                                                                               device=DEVICE)), "positions"),
    ("mrope: float positions", mrope_args, dict(positions=torch.zeros(3, 6, device=DEVICE)), "positions"),
    ("mrope: positions on another device", mrope_args,
     dict(positions=torch.zeros(3, 6, dtype=torch.int64, device=OTHER_DEVICE)), "positions"),
    ("mrope: a position past freqs", mrope_args,
     dict(positions=torch.tensor([[0] * 6, [0] * 6, [0, 0, 10, 0, 0, 0]], device=DEVICE)), "positions"),
    ("mrope: a negative position", mrope_args,
     dict(positions=torch.tensor([[0] * 6, [0, -1, 0, 0, 0, 0], [0] * 6], device=DEVICE)), "positions"),
    ("mrope: bshd positions in sbhd order", mrope_qk_args,
     dict(positions=torch.zeros(3, 5, 2, dtype=torch.int64, device=DEVICE)), "positions"),
    ("mrope: k of other tokens", mrope_qk_args, dict(k=_r(2, 4, 1, 16)), "k"),
    ("mrope: freqs wider than t", mrope_args, dict(freqs=_r(10, 1, 1, 18)), "freqs"),
    ("mrope: unknown format", mrope_args, dict(tensor_format="tbhd"), "tensor_format"),
    ("hf mrope: cos without streams", hf_mrope_args, dict(cos=_r(2, 5, 8), sin=_r(2, 5, 8)), "cos"),
    ("hf mrope: four streams", hf_mrope_args, dict(cos=_r(4, 2, 5, 8), sin=_r(4, 2, 5, 8)), "cos"),
    ("hf mrope: sections of the full width", hf_mrope_args, dict(mrope_section=[4, 2, 2]), "mrope_section"),
    ("hf mrope: sin of another shape", hf_mrope_args, dict(sin=_r(3, 1, 5, 8)), "sin"),
    ("vllm mrope: sections over the channels", vllm_mrope_args, dict(mrope_section=[4, 4, 4]), "mrope_section"),
    ("vllm mrope: a position past the cache", vllm_mrope_args,
     dict(positions=torch.tensor([[0] * 5, [0] * 5, [0, 0, 0, 10, 0]], device=DEVICE)), "positions"),
    ("vllm mrope: two streams", vllm_mrope_args, dict(positions=torch.zeros(2, 5, dtype=torch.int64, device=DEVICE)),
     "positions"),
    ("vllm mrope: query of other tokens", vllm_mrope_args, dict(query=_r(4, 64)), "query"),
    ("vllm mrope: is_neox not a bool", vllm_mrope_args, dict(is_neox=None), "is_neox"),
    ("mrope: float64 t", mrope_args, dict(t=_r(6, 3, 16, dtype=torch.float64)), "t"),
    ("mrope: interleaved not a bool", mrope_args, dict(interleaved=1), "interleaved"),
    ("hf mrope: mrope_interleaved not a bool", hf_mrope_args, dict(mrope_interleaved="yes"), "mrope_interleaved"),
    ("vllm mrope: 0-d positions", vllm_mrope_args, dict(positions=torch.tensor(1, device=DEVICE)), "positions"),
    ("vllm mrope: float64 query", vllm_mrope_args, dict(query=_r(5, 64, dtype=torch.float64)), "query"),
    ("vllm mrope: mrope_interleaved not a bool", vllm_mrope_args, dict(mrope_interleaved=0), "mrope_interleaved"),
    # transformers
    ("hf: q not a tensor", hf_args, dict(q=None), "q"),
    ("hf: k not a tensor", hf_args, dict(k=[[0.0]]), "k"),
    ("hf: unsqueeze_dim True", hf_args, dict(unsqueeze_dim=True), "unsqueeze_dim"),
    ("hf: unsqueeze_dim 1.0", hf_args, dict(unsqueeze_dim=1.0), "unsqueeze_dim"),
    ("hf: cos of another length", hf_args, dict(cos=_r(2, 4, 8), sin=_r(2, 4, 8)), "cos"),
    ("hf: cos of another batch", hf_args, dict(cos=_r(3, 5, 8), sin=_r(3, 5, 8)), "cos"),
    ("hf: 2-D cos", hf_args, dict(cos=_r(5, 8), sin=_r(5, 8)), "cos"),
    ("hf: sin of another dtype", hf_args, dict(sin=_r(2, 5, 8, dtype=torch.float16)), "sin"),
    ("hf: integer cos", hf_args, dict(cos=torch.ones(2, 5, 8, dtype=torch.int32, device=DEVICE)), "cos"),
    ("hf: cos on another device", hf_args, dict(cos=torch.ones(2, 5, 8, device=OTHER_DEVICE)), "cos"),
    ("hf: k of another length", hf_args, dict(k=_r(2, 1, 4, 8)), "k"),
    ("hf: 3-D q", hf_args, dict(q=_r(2, 3, 5)), "q"),
    ("hf: odd rotary width", hf_args, dict(q=_r(2, 3, 5, 7), k=_r(2, 1, 5, 7), cos=_r(2, 5, 7), sin=_r(2, 5, 7)),
     "cos"),
    ("hf: cos wider than the head", hf_args, dict(cos=_r(2, 5, 10), sin=_r(2, 5, 10)), "cos"),
    ("hf: cos of width 0", hf_args, dict(cos=_r(2, 5, 0), sin=_r(2, 5, 0)), "cos"),
    ("hf mrope: sections over the head, cos of the rotary width", hf_mrope_args,
     dict(cos=_r(3, 2, 5, 4), sin=_r(3, 2, 5, 4)), "mrope_section"),
    ("hf single: x not a tensor", hf_single_args, dict(x=None), "x"),
    ("hf single: 3-D x", hf_single_args, dict(x=_r(3, 5, 9)), "x"),
    ("hf single: cos of another length", hf_single_args, dict(cos=_r(1, 4, 6), sin=_r(1, 4, 6)), "cos"),
    ("hf single: odd rotary width", hf_single_args, dict(cos=_r(1, 5, 5), sin=_r(1, 5, 5)), "cos"),
    ("hf single: cos wider than the head", hf_single_args, dict(cos=_r(1, 5, 10), sin=_r(1, 5, 10)), "cos"),
    ("hf single: 2-D cos", hf_single_args, dict(cos=_r(5, 6), sin=_r(5, 6)), "cos"),
    ("hf single: sin of another shape", hf_single_args, dict(sin=_r(1, 5, 4)), "sin"),
    ("hf single: unsqueeze_dim 0", hf_single_args, dict(unsqueeze_dim=0), "unsqueeze_dim"),
    ("hf glm: odd rotary width", hf_glm_args, dict(cos=_r(2, 5, 3), sin=_r(2, 5, 3)), "cos"),
    ("hf glm: cos wider than the head", hf_glm_args, dict(cos=_r(2, 5, 16), sin=_r(2, 5, 16)), "cos"),
    ("hf glm: k of another head dim", hf_glm_args, dict(k=_r(2, 1, 5, 6)), "k"),
    ("hf glm: unsqueeze_dim True", hf_glm_args, dict(unsqueeze_dim=True), "unsqueeze_dim"),
    ("hf: unsqueeze_dim 3", hf_args, dict(unsqueeze_dim=3), "unsqueeze_dim"),
    ("hf deepseek: cos narrower than the head", hf_deepseek_args, dict(cos=_r(2, 5, 4), sin=_r(2, 5, 4)), "cos"),
    ("hf deepseek: odd head dim (and rotary width)", hf_deepseek_args,
     dict(q=_r(2, 3, 5, 7), k=_r(2, 1, 5, 7), cos=_r(2, 5, 7), sin=_r(2, 5, 7)), "cos"),
    ("hf deepseek: k of another head dim", hf_deepseek_args, dict(k=_r(2, 1, 5, 6)), "k"),
    ("hf deepseek: sin of another shape", hf_deepseek_args, dict(sin=_r(2, 5, 6)), "sin"),
    ("hf deepseek: unsqueeze_dim 0", hf_deepseek_args, dict(unsqueeze_dim=0), "unsqueeze_dim"),
    ("deepseek v4: pairs wider than the head", deepseek_v4_args, dict(cos=_r(2, 5, 7), sin=_r(2, 5, 7)), "cos"),
    ("deepseek v4: no pair", deepseek_v4_args, dict(cos=_r(2, 5, 0), sin=_r(2, 5, 0)), "cos"),
    ("deepseek v4: cos of another length", deepseek_v4_args, dict(cos=_r(2, 4, 4), sin=_r(2, 4, 4)), "cos"),
    ("deepseek v4: sin of another shape", deepseek_v4_args, dict(sin=_r(2, 5, 3)), "sin"),
    ("deepseek v4: 3-D x", deepseek_v4_args, dict(x=_r(3, 5, 12)), "x"),
    ("deepseek v4: unsqueeze_dim 3", deepseek_v4_args, dict(unsqueeze_dim=3), "unsqueeze_dim"),
    # Megatron-LM
    ("megatron: head other than nope_dim + emb_dim", megatron_args, dict(nope_dim=5), "t"),
    ("megatron: emb_dim not a multiple of 4", megatron_args, dict(nope_dim=6, emb_dim=6, cos=_r(6, 1, 1, 6),
                                                                   sin=_r(6, 1, 1, 6)), "emb_dim"),
    ("megatron: rotary_interleaved", megatron_args, dict(rotary_interleaved=True), "rotary_interleaved"),
    ("megatron: inverse not a bool", megatron_args, dict(inverse=1), "inverse"),
    ("megatron: cp_rank past cp_size", megatron_args, dict(cp_rank=2, cp_size=2), "cp_rank"),
    ("megatron: cos of another width", megatron_args, dict(cos=_r(6, 1, 1, 4), sin=_r(6, 1, 1, 4)), "cos"),
    ("megatron: 3-D cos", megatron_args, dict(cos=_r(6, 1, 8), sin=_r(6, 1, 8)), "cos"),
    ("megatron: sin of another shape", megatron_args, dict(sin=_r(6, 8)), "sin"),
    ("megatron: cos shorter than s", megatron_args, dict(cos=_r(4, 1, 1, 8), sin=_r(4, 1, 1, 8)), "cos"),
    ("megatron: position_ids with sbhd", megatron_args, dict(position_ids=torch.arange(5, device=DEVICE)),
     "position_ids"),
    ("megatron: t expanded", megatron_args, dict(t=_r(1, 2, 3, 12).expand(5, 2, 3, 12)), "t"),
    ("megatron: float64 t", megatron_args, dict(t=_r(5, 2, 3, 12, dtype=torch.float64)), "t"),
    ("megatron: 3-D t without cu_seqlens_q", megatron_args, dict(t=_r(5, 3, 12)), "t"),
    ("megatron thd: 4-D t", megatron_thd_args, dict(t=_r(5, 1, 3, 12)), "t"),
    ("megatron thd: cu_seqlens_q not from 0", megatron_thd_args,
     dict(cu_seqlens_q=torch.tensor([2, 4, 8], device=DEVICE)), "cu_seqlens_q"),
    ("megatron thd: cu_seqlens_q decreasing", megatron_thd_args,
     dict(cu_seqlens_q=torch.tensor([0, 8, 4], device=DEVICE)), "cu_seqlens_q"),
    ("megatron thd: float cu_seqlens_q", megatron_thd_args, dict(cu_seqlens_q=torch.zeros(3, device=DEVICE)),
     "cu_seqlens_q"),
    ("megatron thd: positions past the tables", megatron_thd_args, dict(cos=_r(2, 8), sin=_r(2, 8)), "cos"),
    ("megatron thd: position_ids of another length", megatron_thd_args,
     dict(position_ids=torch.zeros(4, dtype=torch.int64, device=DEVICE)), "position_ids"),
    ("megatron thd: a position id past the tables", megatron_thd_args,
     dict(position_ids=torch.tensor([0, 1, 2, 3, 4], device=DEVICE)), "position_ids"),
    ("megatron thd: a negative position id", megatron_thd_args,
     dict(position_ids=torch.tensor([0, 1, -1, 3, 0], device=DEVICE)), "position_ids"),
    ("megatron kv: head other than k_dim + v_dim", megatron_kv_args, dict(k_dim=5), "kv"),
    ("megatron kv: k_pos_emb with a head per kv head", megatron_kv_args, dict(k_pos_emb=_r(5, 2, 3, 8)),
     "k_pos_emb"),
    ("megatron kv: k_pos_emb of other tokens", megatron_kv_args, dict(k_pos_emb=_r(4, 2, 1, 8)), "k_pos_emb"),
    ("megatron kv: float64 k_pos_emb", megatron_kv_args, dict(k_pos_emb=_r(5, 2, 1, 8, dtype=torch.float64)),
     "k_pos_emb"),
    ("megatron kv: emb_dim not a multiple of 4", megatron_kv_args, dict(emb_dim=6, k_pos_emb=_r(5, 2, 1, 6),
                                                                        cos=_r(6, 1, 1, 6), sin=_r(6, 1, 1, 6)),
     "emb_dim"),
    ("megatron kv: rotary_interleaved", megatron_kv_args, dict(rotary_interleaved=True), "rotary_interleaved"),
    ("megatron kv: remove_interleaving not a bool", megatron_kv_args, dict(remove_interleaving=1),
     "remove_interleaving"),
    ("megatron kv: cos of another width", megatron_kv_args, dict(cos=_r(6, 1, 1, 4), sin=_r(6, 1, 1, 4)), "cos"),
    ("megatron kv: cos shorter than s", megatron_kv_args, dict(cos=_r(4, 1, 1, 8), sin=_r(4, 1, 1, 8)), "cos"),
    ("megatron kv: 3-D kv without cu_seqlens_kv", megatron_kv_args, dict(kv=_r(5, 3, 10)), "kv"),
    ("megatron kv: out_key without out_value", megatron_kv_args, dict(out_key=_r(5, 2, 3, 12)), "out_value"),
    ("megatron kv thd: out_value of another shape", megatron_kv_thd_args, dict(out_value=_r(5, 3, 7)), "out_value"),
    ("megatron kv thd: out_key of another dtype", megatron_kv_thd_args,
     dict(out_key=_r(5, 3, 12, dtype=torch.bfloat16)), "out_key"),
    ("megatron kv thd: out_key that requires grad", megatron_kv_thd_args,
     dict(out_key=_r(5, 3, 12).requires_grad_()), "out_key"),
    ("megatron kv thd: out_value over kv's memory", megatron_kv_thd_args, _kv_and_its_value_view(), "out_value"),
    ("megatron kv thd: cu_seqlens_kv decreasing", megatron_kv_thd_args,
     dict(cu_seqlens_kv=torch.tensor([0, 8, 4], device=DEVICE)), "cu_seqlens_kv"),
    ("megatron kv thd: positions past the tables", megatron_kv_thd_args, dict(cos=_r(2, 8), sin=_r(2, 8)), "cos"),
    # flash-attention
    ("flash: odd rotary width table", flash_args, dict(cos=_r(7, 5), sin=_r(7, 5)), "cos"),
    ("flash: 3-D cos", flash_args, dict(cos=_r(7, 3, 1), sin=_r(7, 3, 1)), "cos"),
    ("flash: sin of another shape", flash_args, dict(sin=_r(6, 3)), "sin"),
    ("flash: table shorter than seqlen", flash_args, dict(cos=_r(4, 3), sin=_r(4, 3)), "cos"),
    ("flash: int offset past the table", flash_args, dict(seqlen_offsets=8), "seqlen_offsets"),
    ("flash: offsets reaching past the table", flash_args,
     dict(seqlen_offsets=torch.tensor([0, 3], device=DEVICE)), "cos"),
    ("flash: negative offsets", flash_args, dict(seqlen_offsets=torch.tensor([0, -1], device=DEVICE)),
     "seqlen_offsets"),
    ("flash: offsets of another length", flash_args, dict(seqlen_offsets=torch.tensor([0], device=DEVICE)),
     "seqlen_offsets"),
    ("flash: float offsets", flash_args, dict(seqlen_offsets=torch.zeros(2, device=DEVICE)), "seqlen_offsets"),
    ("flash: offsets on another device", flash_args,
     dict(seqlen_offsets=torch.zeros(2, dtype=torch.int64, device=OTHER_DEVICE)), "seqlen_offsets"),
    ("flash: cu_seqlens total short", flash_thd_args, dict(cu_seqlens=torch.tensor([0, 2, 5], device=DEVICE)),
     "cu_seqlens"),
    ("flash: cu_seqlens decreasing", flash_thd_args, dict(cu_seqlens=torch.tensor([0, 4, 2, 6], device=DEVICE)),
     "cu_seqlens"),
    ("flash: varlen sequence past the table", flash_thd_args, dict(cu_seqlens=torch.tensor([0, 6], device=DEVICE),
                                                                   cos=_r(5, 3), sin=_r(5, 3)), "cos"),
    ("flash: inplace on an expanded x", flash_args, dict(x=_r(1, 5, 3, 8).expand(2, 5, 3, 8), inplace=True), "x"),
    ("flash: x not a tensor", flash_args, dict(x=None), "x"),
    ("flash: int64 x", flash_args, dict(x=torch.ones(2, 5, 3, 8, dtype=torch.int64, device=DEVICE)), "x"),
    ("flash: float64 x", flash_args, dict(x=_r(2, 5, 3, 8, dtype=torch.float64)), "x"),
    ("flash: interleaved not a bool", flash_args, dict(interleaved=1), "interleaved"),
    ("flash: inplace not a bool", flash_args, dict(inplace="no"), "inplace"),
    ("flash: int offset leaving too few rows", flash_args, dict(cos=_r(10, 3), sin=_r(10, 3), seqlen_offsets=6),
     "cos"),
    # vLLM
    ("vllm: 0-d positions", vllm_args, dict(positions=torch.tensor(3, device=DEVICE), query=_r(1, 64),
                                            key=_r(1, 32)), "positions"),
    ("vllm: int64 query", vllm_args, dict(query=torch.ones(5, 64, dtype=torch.int64, device=DEVICE),
                                          key=torch.ones(5, 32, dtype=torch.int64, device=DEVICE)), "query"),
    ("vllm: float64 query", vllm_args, dict(query=_r(5, 64, dtype=torch.float64), key=_r(5, 32, dtype=torch.float64)),
     "query"),
    ("vllm: int64 key", vllm_args, dict(key=torch.ones(5, 32, dtype=torch.int64, device=DEVICE)), "key"),
    ("vllm: query not a tensor", vllm_args, dict(query=None), "query"),
    ("vllm: position past the cache", vllm_args, dict(positions=torch.tensor([0, 3, 1, 10, 2], device=DEVICE)),
     "positions"),
    ("vllm: negative position", vllm_args, dict(positions=torch.tensor([0, -1, 1, 2, 2], device=DEVICE)),
     "positions"),
    ("vllm: float positions", vllm_args, dict(positions=torch.zeros(5, device=DEVICE)), "positions"),
    ("vllm: positions on another device", vllm_args, dict(positions=torch.zeros(5, dtype=torch.int64,
                                                                                device=OTHER_DEVICE)), "positions"),
    ("vllm: query of other tokens", vllm_args, dict(query=_r(4, 64)), "query"),
    ("vllm: query not a multiple of head_size", vllm_args, dict(query=_r(5, 60)), "query"),
    ("vllm: key of another dtype", vllm_args, dict(key=_r(5, 32, dtype=torch.float16)), "key"),
    ("vllm: cache wider than head_size", vllm_args, dict(cos_sin_cache=_r(10, 18)), "cos_sin_cache"),
    ("vllm: odd cache width", vllm_args, dict(cos_sin_cache=_r(10, 7)), "cos_sin_cache"),
    ("vllm: 1-D cache", vllm_args, dict(cos_sin_cache=_r(80)), "cos_sin_cache"),
    ("vllm: integer cache", vllm_args, dict(cos_sin_cache=torch.ones(10, 8, dtype=torch.int64, device=DEVICE)),
     "cos_sin_cache"),
    ("vllm: is_neox not a bool", vllm_args, dict(is_neox=1), "is_neox"),
    ("vllm: head_size 0", vllm_args, dict(head_size=0), "head_size"),
    ("vllm: head_size 1", vllm_args, dict(head_size=1), "head_size"),
    # TransformerEngine's packed QKV
    ("qkv: split not summing to the last dim", qkv_args, dict(qkv_split_arg_list=[8, 4, 3]), "qkv_split_arg_list"),
    ("qkv: nq not a multiple of nk", qkv_args, dict(qkv=_r(4, 2, 3, 6 + 4 + 4), qkv_split_arg_list=[6, 4, 4]),
     "qkv_split_arg_list"),
    ("qkv: an empty v part", qkv_args, dict(qkv=_r(4, 2, 3, 12), qkv_split_arg_list=[8, 4, 0]),
     "qkv_split_arg_list"),
    ("qkv: thd", qkv_args, dict(tensor_format="thd"), "tensor_format"),
    ("qkv: q_freqs too short", qkv_args, dict(q_freqs=_r(3, 1, 1, 4)), "q_freqs"),
]


def _snapshot(kw):
    return {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}


@pytest.mark.parametrize("name,args,change,arg", CASES, ids=[c[0] for c in CASES])
def test_rejected_before_launch(name, args, change, arg):
    fn, kw = args()
    fn(**kw)  # the valid call runs
    fn, kw = args(**change)
    before = _snapshot(kw)
    with mock.patch.object(rope._launch, "run", side_effect=AssertionError("launched")):
        with pytest.raises((ValueError, TypeError)) as err:
            fn(**kw)
    named = any(str(err.value).startswith(f"{a}:") for a in arg.split("|"))
    assert named, f"message does not begin with {arg}: {err.value}"
    for k, v in before.items():
        assert torch.equal(kw[k], v), f"{k} changed"


def test_cache_rejects_bad_tables():
    with pytest.raises(ValueError, match="sin"):
        rope.RoPECache(_r(4, 8), _r(4, 6))
    with pytest.raises(TypeError, match="cos"):
        rope.RoPECache(torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="cos"):
        rope.RoPECache(_r(4, 7), _r(4, 7))
    cache = rope.RoPECache.from_freqs(_r(6, 1, 1, 8))
    with pytest.raises(ValueError, match="freqs"):
        cache.update_(_r(5, 1, 1, 8))
    with pytest.raises(ValueError, match="freqs: too short"):
        rope.apply_rotary_pos_emb(_r(7, 1, 2, 8), cache)


@pytest.mark.parametrize("args,change,name", [
    (hf_args, dict(q=None), "q"), (hf_args, dict(k=None), "k"), (hf_single_args, dict(x=None), "x"),
    (hf_glm_args, dict(k=None), "k"), (hf_deepseek_args, dict(q=None), "q"), (deepseek_v4_args, dict(x=None), "x"),
    (flash_args, dict(x=None), "x"),
    (vllm_args, dict(query=None), "query"), (vllm_args, dict(key="key"), "key"), (mrope_args, dict(t=None), "t"),
    (megatron_args, dict(t=None), "t"), (megatron_thd_args, dict(cu_seqlens_q=[0, 4, 8]), "cu_seqlens_q"),
    (megatron_kv_args, dict(k_pos_emb=None), "k_pos_emb"), (megatron_kv_thd_args, dict(out_value=[0.0]), "out_value"),
], ids=["hf q", "hf k", "hf single x", "hf glm k", "hf deepseek q", "deepseek v4 x", "flash x", "vllm query",
        "vllm key", "mrope t", "megatron t", "megatron cu_seqlens_q", "megatron kv k_pos_emb",
        "megatron kv out_value"])
def test_a_tensor_argument_that_is_no_tensor_is_a_type_error(args, change, name):
    """docs/contract.md section 5: a tensor argument that is not a tensor raises TypeError, in every convention."""
    fn, kw = args(**change)
    with pytest.raises(TypeError, match=rf"^{name}: expected a torch.Tensor, got"):
        fn(**kw)


def test_flash_int_offset_message_reports_the_rows_needed():
    """seqlen 8 from seqlen_offsets 9 needs rows 9..16 of cos: 17 rows, and cos has 16."""
    fn, kw = flash_args(x=_r(2, 8, 3, 8), cos=_r(16, 3), sin=_r(16, 3), seqlen_offsets=9)
    with pytest.raises(ValueError) as err:
        fn(**kw)
    assert str(err.value) == "cos: too short: seqlen 8 from seqlen_offsets = 9 needs 17 rows (seqlen_ro), got 16"


def test_vllm_messages_name_query_and_key():
    """vLLM's arguments are `query` and `key`: query and key sharing memory is blamed on `key`, not `k`."""
    fn, kw = vllm_args()
    kw["key"] = kw["query"][:, :32]
    before = kw["query"].clone()
    with pytest.raises(ValueError, match=r"^key: in-place rotation of query and key that share memory"):
        fn(**kw)
    assert torch.equal(kw["query"], before)


def test_embedding_arguments():
    with pytest.raises(ValueError, match=r"^max_seq_len: expected an int >= 0, got -1"):
        rope.RotaryPositionEmbedding(64)(-1)
    with pytest.raises(ValueError, match=r"^max_seq_len"):
        rope.RotaryPositionEmbedding(64)(2.5)
    with pytest.raises(TypeError, match=r"^interleaved: expected a bool"):
        rope.RotaryPositionEmbedding(64, interleaved=1)
    assert rope.RotaryPositionEmbedding(64)(0).shape == (0, 1, 1, 64)
