"""Random inputs for a case: angles, packing metadata, and a few sets of t and upstream gradients.

The angles are the real thing (`RotaryPositionEmbedding`: cat(theta, theta), or pairs for
interleaved), for every implementation, because some of the compared kernels only accept
duplicated-half angles ([s, d2/2] cos/sin tables). One angle table serves all of them, so every
implementation computes the same function on the same data.

t and the gradients are N(0, 1), never zeros: zeros hide unwritten outputs and can run faster
than real data. For a qk case an input set is the pair (q, k) and its gradient the pair (gq, gk);
`parts` and `leaf` handle both forms.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ..embedding import RotaryPositionEmbedding
from .shapes import Case


@dataclass
class CaseInputs:
    case: Case
    freqs: torch.Tensor  # float32 [freqs_len, 1, 1, d2]
    cu_seqlens: torch.Tensor | None  # int32 [n + 1] (thd)
    start_positions: torch.Tensor | None  # int32 [b] (decode)
    ts: list  # input sets, each contiguous in the case's format: a tensor, or (q, k) for a qk case
    gs: list  # one upstream gradient per set, in the same form

    @property
    def max_seqlen(self) -> int:
        return self.case.seq_len


def parts(x) -> list:
    """The tensors of an input set, gradient or output: [t], or [q, k]."""
    return list(x) if isinstance(x, (tuple, list)) else [x]


def leaf(x):
    """The set as fresh leaves that require grad, in the same form (tensor or tuple)."""
    if isinstance(x, (tuple, list)):
        return tuple(p.detach().requires_grad_() for p in x)
    return x.detach().requires_grad_()


def sets_for(case: Case, device: torch.device, l2_bytes: int, max_sets: int = 8) -> int:
    """How many input sets to rotate through so repeated calls do not just hit L2.

    One set when a call's traffic is at least twice the L2; otherwise enough sets for three
    L2s of traffic, at most `max_sets` (launch-bound shapes stay in L2 whatever we do, as they do
    in a model, where t was just written by the projection).
    """
    if device.type != "cuda" or case.bytes_fwd >= 2 * l2_bytes:
        return 1
    return max(1, min(max_sets, math.ceil(3 * l2_bytes / max(case.bytes_fwd, 1))))


def make_inputs(case: Case, device, n_sets: int = 1, seed: int = 0) -> CaseInputs:
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    dtype = case.torch_dtype

    def randn(shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    freqs = RotaryPositionEmbedding(case.d2, interleaved=case.interleaved, device=device)(case.freqs_len)
    cu = None
    if case.fmt == "thd":
        cu = torch.tensor([0] + list(itertools.accumulate(case.seqlens)), dtype=torch.int32, device=device)
    start = None
    if case.start_max:
        n = len(case.seqlens) if case.fmt == "thd" else case.b
        start = torch.randint(0, case.start_max, (n,), generator=gen, device=device, dtype=torch.int32)
    if case.hk:
        ts = [tuple(randn(shape) for shape in case.shapes) for _ in range(n_sets)]
        gs = [tuple(randn(shape) for shape in case.shapes) for _ in range(n_sets)]
    else:  # the draws single-tensor cases have always had
        ts = [randn(case.shape) for _ in range(n_sets)]
        gs = [randn(case.shape) for _ in range(n_sets)]
    return CaseInputs(case, freqs.contiguous(), cu, start, ts, gs)
