"""Qwen3-VL's interleaved multimodal RoPE, as a function of its own (no layout flag):
    fn(q, k, cos, sin, mrope_section, unsqueeze_dim=1) -> (q_embed, k_embed)
cos, sin [3, b or 1, s, d] as in spec/hf_mrope.py (one table per stream, cat(theta, theta)), read in Qwen3-VL's
layout: pair i (channels i and i + d/2) reads stream i % 3 while i < 3 * mrope_section[i % 3], else stream 0,
as transformers' Qwen3-VL `apply_interleaved_mrope` selects the angles before its plain `apply_rotary_pos_emb`.
mrope_section sums to d/2 and each of streams 1 and 2 holds its count of pairs below 3 * section. New tensors
in torch's promotion of q's and cos's dtypes; the gradient flows to q and k.
"""
from __future__ import annotations

from .hf_mrope import HFMRoPE, batch_rows_alone, equal_streams, inverse, q_k_independent, unsqueeze_dim_equivalent


class Qwen3VLMRoPE(HFMRoPE):
    NAME = "qwen3vl-mrope"
    INTERLEAVED_LAYOUT = True
    # No stream relabelling here: the interleaved layout gives each stream its own residue of pairs.
    INVARIANTS = {"batch_rows_alone": batch_rows_alone, "equal_streams": equal_streams, "inverse": inverse,
                  "q_k_independent": q_k_independent, "unsqueeze_dim": unsqueeze_dim_equivalent}


CONVENTION = Qwen3VLMRoPE()
