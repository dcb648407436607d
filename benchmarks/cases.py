"""The benchmark cases (one problem each: format, sizes, dtype) and their random inputs.

Bytes per call are the problem's, the same for every implementation: t read once and written once (all
d channels: the pass-through tail of partial rotary counts), plus the float32 angle rows used. q/k cases
(k with its own head count): q and k both, the angle rows once. In place: t rotated in its own memory.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from rope import RotaryPositionEmbedding

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    name: str
    fmt: str  # "sbhd", "bshd" or "thd"
    s: int  # sequence length (sbhd/bshd); thd has sum(seqlens) tokens
    b: int
    h: int
    d: int
    dtype: str  # key of DTYPES
    rot_dim: int = 0  # 0: all of d
    interleaved: bool = False
    seqlens: tuple = ()  # thd only
    start_max: int = 0  # > 0: per-sequence start positions drawn from [0, start_max) (decode)
    hk: int = 0  # > 0: a q/k case, k with hk heads (q has h)
    inplace: bool = False
    hf: bool = False  # a q/k case in transformers' layout: [b, h, s, d] views of [b, s, h, d] memory, cos/sin gathered

    @property
    def d2(self) -> int:
        return self.rot_dim or self.d

    @property
    def kind(self) -> str:
        return "hf" if self.hf else "qk" if self.hk else "inplace" if self.inplace else "t"

    def _shape(self, h) -> tuple:
        if self.fmt == "thd":
            return (sum(self.seqlens), h, self.d)
        return (self.s, self.b, h, self.d) if self.fmt == "sbhd" else (self.b, self.s, h, self.d)

    @property
    def shapes(self) -> list:
        """Every tensor the case rotates: [t], or [q, k]."""
        return [self._shape(self.h), self._shape(self.hk)] if self.hk else [self._shape(self.h)]

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def elem_bytes(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def seq_len(self) -> int:
        return max(self.seqlens, default=0) if self.fmt == "thd" else self.s

    @property
    def bytes_fwd(self) -> int:
        """Inputs read and outputs written, plus the angle rows used (decode: one per sequence)."""
        rows = min(self.seq_len + self.start_max, self.b * self.s) if self.start_max else self.seq_len
        return 2 * self.numel * self.elem_bytes + rows * self.d2 * 4

    @property
    def label(self) -> str:
        text = " / ".join("x".join(map(str, shape)) for shape in self.shapes)
        if self.fmt == "thd":
            text += f" ({len(self.seqlens)} seqs, {min(self.seqlens)}..{max(self.seqlens)})"
        flags = [(self.d2 != self.d, f"rot {self.d2}/{self.d}"), (self.interleaved, "interleaved"),
                 (self.start_max, "start_positions"), (self.inplace, "in place")]
        return f"{self.fmt} {text} {self.dtype}" + "".join(f", {what}" for on, what in flags if on)


_LLAMA = dict(b=2, h=32, d=128)
CASES = [
    Case("headline_bf16", "sbhd", 2048, 16, 8, 256, "bf16"),
    Case("headline_fp32", "sbhd", 2048, 16, 8, 256, "fp32"),
    Case("small_64", "sbhd", 64, 1, 16, 64, "fp32"),  # launch-bound
    Case("small_128", "sbhd", 128, 1, 16, 128, "fp32"),  # launch-bound
    Case("small_32", "sbhd", 32, 1, 8, 256, "fp32"),  # launch-bound
    Case("llama_sbhd", "sbhd", 4096, **_LLAMA, dtype="bf16"),
    Case("llama_bshd", "bshd", 4096, **_LLAMA, dtype="bf16"),
    Case("llama_sbhd_fp16", "sbhd", 4096, **_LLAMA, dtype="fp16"),
    Case("llama_bshd_fp32", "bshd", 4096, **_LLAMA, dtype="fp32"),
    Case("partial", "sbhd", 4096, **_LLAMA, dtype="bf16", rot_dim=64),
    Case("interleaved", "sbhd", 4096, **_LLAMA, dtype="bf16", interleaved=True),
    Case("thd_short", "thd", 0, 1, 32, 128, "bf16", seqlens=(8,) * 2048),  # compare with bshd_2048x8
    Case("bshd_2048x8", "bshd", 8, 2048, 32, 128, "bf16"),  # the same tokens as thd_short
    Case("thd_long", "thd", 0, 1, 32, 128, "bf16", seqlens=(6144, 4096, 4096, 2048)),
    Case("decode", "sbhd", 1, 64, 32, 128, "bf16", start_max=4096),  # launch-bound
    Case("sweep_s256", "sbhd", 256, **_LLAMA, dtype="bf16"),
    Case("sweep_s1024", "sbhd", 1024, **_LLAMA, dtype="bf16"),
    Case("sweep_s16384", "sbhd", 16384, **_LLAMA, dtype="bf16"),
    Case("qk_llama_gqa", "sbhd", 4096, **_LLAMA, dtype="bf16", hk=8),  # q 32 / k 8 heads: one call vs two
    Case("qk_mqa_decode", "sbhd", 1, 64, 32, 128, "bf16", hk=1, start_max=4096),  # launch-bound
    Case("qk_thd_short", "thd", 0, 1, 32, 128, "bf16", hk=8, seqlens=(8,) * 2048),
    Case("llama_inplace", "sbhd", 4096, **_LLAMA, dtype="bf16", inplace=True),
    # transformers' layout, Llama-style (32 q heads, 8 kv heads): rope.hf against Liger, q and k in one launch
    *(Case(f"hf_b{b}_s{s}", "bshd", s, b, 32, 128, "bf16", hk=8, hf=True) for b, s in ((1, 1), (8, 128), (1, 4096),
                                                                                        (8, 4096))),
    Case("hf_decode", "bshd", 1, 64, 32, 128, "bf16", hk=8, hf=True, start_max=4096),  # launch-bound
]


@dataclass
class CaseInputs:
    case: Case
    freqs: torch.Tensor  # float32 [s + start_max, 1, 1, d2]: the real RotaryPositionEmbedding table
    cu_seqlens: torch.Tensor | None  # int32 [n + 1] (thd)
    start_positions: torch.Tensor | None  # int32 [b] (decode)
    ts: list  # input sets in the case's format: a tensor, or (q, k)
    gs: list  # one upstream gradient per set, in the same form

    @property
    def args(self) -> tuple:
        """TransformerEngine's arguments after t: freqs, tensor_format, start_positions, interleaved."""
        return self.freqs, self.case.fmt, self.start_positions, self.case.interleaved


def parts(x) -> list:
    """The tensors of an input set, gradient or output: [t], or [q, k]."""
    return list(x) if isinstance(x, (tuple, list)) else [x]


def leaf(x):
    """The set as fresh leaves that require grad, in the same form."""
    if isinstance(x, (tuple, list)):
        return tuple(p.detach().requires_grad_() for p in x)
    return x.detach().requires_grad_()


def sets_for(case: Case, l2_bytes: int, max_sets: int = 8) -> int:
    """Input sets to rotate through so that repeated calls do not just re-read the L2: one when a call
    moves at least two L2s, else enough for three L2s of traffic (at most max_sets)."""
    return 1 if case.bytes_fwd >= 2 * l2_bytes else min(max_sets, math.ceil(3 * l2_bytes / case.bytes_fwd))


def make_inputs(case: Case, device, n_sets: int = 1, seed: int = 0) -> CaseInputs:
    """N(0, 1) inputs and gradients (never zeros: they hide unwritten outputs and can run faster)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, device=device).to(DTYPES[case.dtype])

    freqs = RotaryPositionEmbedding(case.d2, interleaved=case.interleaved, device=device)(case.seq_len + case.start_max)
    cu = start = None
    if case.fmt == "thd":
        cu = torch.tensor([0, *itertools.accumulate(case.seqlens)], dtype=torch.int32, device=device)
    if case.start_max:
        n = len(case.seqlens) if case.fmt == "thd" else case.b
        start = torch.randint(0, case.start_max, (n,), generator=gen, device=device, dtype=torch.int32)

    def one_set():
        return tuple(randn(shape) for shape in case.shapes) if case.hk else randn(case.shapes[0])

    return CaseInputs(case, freqs.contiguous(), cu, start, [one_set() for _ in range(n_sets)],
                      [one_set() for _ in range(n_sets)])
