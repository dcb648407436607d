"""The benchmark cases: one problem each (format, sizes, dtype, mode), and the bytes it must move.

Every implementation in a run gets the same case, converted to the layout it is meant for. The
byte count is the problem's, not the implementation's: t (all d channels) read once and written
once, plus the rows of float32 angles the case uses. So GB/s is comparable across
implementations, and an implementation that reads extra tables (cos and sin in the input dtype)
or copies the pass-through channels separately pays for it in time, not in the count.

Three kinds of case: "t" (one tensor, TransformerEngine's call), "qk" (q and k rotated with the
same angles, k with its own head count: both tensors read and written, the angle rows once, as
one launch needs them) and "inplace" (t rotated in its own memory, forward only).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# At and above this many bytes per call a case is bandwidth-bound on any current GPU: the
# issue's 95 %-of-copy target applies (64 MB: a few times the L2 of an H100/H200).
LARGE_BYTES = 64_000_000


@dataclass(frozen=True)
class Case:
    name: str
    fmt: str  # "sbhd", "bshd" or "thd"
    s: int  # sequence length (sbhd/bshd); for thd, the token count is sum(seqlens)
    b: int
    h: int
    d: int
    dtype: str  # key of DTYPES
    rot_dim: int = 0  # 0: all of d
    interleaved: bool = False
    seqlens: tuple = ()  # thd only
    start_max: int = 0  # > 0: per-sequence start positions drawn from [0, start_max) (decode)
    hk: int = 0  # > 0: a qk case, k with hk heads (q has h)
    inplace: bool = False  # an in-place case: forward only
    # small: launch-bound, compared with clone in a graph and by host cost per eager call;
    # sweep: a point of the sequence-length plots; quick: part of --quick; smoke: CPU smoke test;
    # qk_headline: the large qk case, held to the copy target and in the pytest-benchmark suite.
    tags: frozenset = field(default_factory=frozenset)
    note: str = ""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def d2(self) -> int:
        return self.rot_dim or self.d

    @property
    def tokens(self) -> int:
        return sum(self.seqlens) if self.fmt == "thd" else self.s * self.b

    @property
    def kind(self) -> str:
        return "qk" if self.hk else "inplace" if self.inplace else "t"

    def _shape(self, h) -> tuple:
        if self.fmt == "sbhd":
            return (self.s, self.b, h, self.d)
        if self.fmt == "bshd":
            return (self.b, self.s, h, self.d)
        return (self.tokens, h, self.d)

    @property
    def shape(self) -> tuple:
        """t's shape (q's for a qk case)."""
        return self._shape(self.h)

    @property
    def shapes(self) -> list:
        """Every tensor the case rotates: [t], or [q, k]."""
        return [self.shape, self._shape(self.hk)] if self.hk else [self.shape]

    @property
    def numel(self) -> int:
        """Elements of every tensor the case rotates (q and k together for a qk case)."""
        total = 0
        for shape in self.shapes:
            n = 1
            for v in shape:
                n *= v
            total += n
        return total

    @property
    def seq_len(self) -> int:
        """Length of the longest sequence: the x axis of the sweep plots."""
        return max(self.seqlens, default=0) if self.fmt == "thd" else self.s

    @property
    def freqs_len(self) -> int:
        """Rows of the angle table: every position the case reaches, and no more."""
        return self.seq_len + self.start_max

    @property
    def freqs_rows_used(self) -> int:
        if self.start_max:
            return min(self.freqs_len, self.b * self.s)
        return self.seq_len

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def bytes_fwd(self) -> int:
        """t read + out written (all d channels, so the copied tail counts) + the angles read.

        qk: q and k read and written, the angle rows once (one launch reads them for both).
        """
        return 2 * self.numel * self.elem_bytes + self.freqs_rows_used * self.d2 * 4

    @property
    def bytes_bwd(self) -> int:
        """The same traffic with the gradient in place of t."""
        return self.bytes_fwd

    @property
    def small(self) -> bool:
        return "small" in self.tags

    @property
    def large(self) -> bool:
        return self.bytes_fwd >= LARGE_BYTES

    @property
    def label(self) -> str:
        dims = "x".join(str(v) for v in self.shape)
        if self.fmt == "thd":
            n = len(self.seqlens)
            lens = sorted(set(self.seqlens))
            dims += f" ({n} seqs of {lens[0]})" if len(lens) == 1 else f" ({n} seqs, {min(lens)}..{max(lens)})"
        extra = []
        if self.hk:
            extra.append(f"q {self.h} / k {self.hk} head{'s' if self.hk > 1 else ''}")
        if self.d2 != self.d:
            extra.append(f"rot {self.d2}/{self.d}")
        if self.interleaved:
            extra.append("interleaved")
        if self.start_max:
            extra.append("start_positions")
        if self.inplace:
            extra.append("in place")
        return dims + (" " + ", ".join(extra) if extra else "")


def _t(*names):
    return frozenset(names)


_LLAMA = dict(b=2, h=32, d=128)
CASES = [
    Case("headline_bf16", "sbhd", 2048, 16, 8, 256, "bf16", tags=_t("quick"),
         note="the shape of an earlier study against TransformerEngine"),
    Case("headline_fp32", "sbhd", 2048, 16, 8, 256, "fp32"),
    Case("small_64", "sbhd", 64, 1, 16, 64, "fp32", tags=_t("small")),
    Case("small_128", "sbhd", 128, 1, 16, 128, "fp32", tags=_t("small", "quick")),
    Case("small_32", "sbhd", 32, 1, 8, 256, "fp32", tags=_t("small")),
    Case("llama_sbhd", "sbhd", 4096, **_LLAMA, dtype="bf16", tags=_t("sweep", "quick"),
         note="Llama-like: 32 heads of 128"),
    Case("llama_bshd", "bshd", 4096, **_LLAMA, dtype="bf16"),
    Case("llama_sbhd_fp16", "sbhd", 4096, **_LLAMA, dtype="fp16"),
    Case("llama_bshd_fp32", "bshd", 4096, **_LLAMA, dtype="fp32"),
    Case("partial", "sbhd", 4096, **_LLAMA, dtype="bf16", rot_dim=64,
         note="rotary on 64 of 128 channels; bytes include the copied tail"),
    Case("interleaved", "sbhd", 4096, **_LLAMA, dtype="bf16", interleaved=True),
    Case("thd_short", "thd", 0, 1, 32, 128, "bf16", seqlens=(8,) * 2048, tags=_t("quick"),
         note="2048 packed sequences of 8 tokens; compare with bshd_2048x8"),
    Case("bshd_2048x8", "bshd", 8, 2048, 32, 128, "bf16", tags=_t("quick"),
         note="the same tokens as thd_short, padded-free bshd"),
    Case("thd_long", "thd", 0, 1, 32, 128, "bf16", seqlens=(6144, 4096, 4096, 2048),
         note="a few long packed sequences"),
    Case("decode", "sbhd", 1, 64, 32, 128, "bf16", start_max=4096, tags=_t("small", "quick"),
         note="one new token per sequence at its own position"),
    Case("sweep_s256", "sbhd", 256, **_LLAMA, dtype="bf16", tags=_t("sweep")),
    Case("sweep_s1024", "sbhd", 1024, **_LLAMA, dtype="bf16", tags=_t("sweep", "quick")),
    Case("sweep_s16384", "sbhd", 16384, **_LLAMA, dtype="bf16", tags=_t("sweep")),
    # Appended after the single-tensor cases: a case's inputs are seeded by its place in the run,
    # so the cases above keep the inputs (and numbers) they had.
    Case("qk_llama_gqa", "sbhd", 4096, **_LLAMA, dtype="bf16", hk=8, tags=_t("quick", "qk_headline"),
         note="Llama-like GQA: q 32 heads, k 8 heads of 128, one call vs two"),
    Case("qk_mqa_decode", "sbhd", 1, 64, 32, 128, "bf16", hk=1, start_max=4096, tags=_t("small"),
         note="MQA decode: one new token per sequence, k 1 head"),
    Case("qk_thd_short", "thd", 0, 1, 32, 128, "bf16", hk=8, seqlens=(8,) * 2048,
         note="2048 packed sequences of 8 tokens, q 32 / k 8 heads"),
    Case("llama_inplace", "sbhd", 4096, **_LLAMA, dtype="bf16", inplace=True, tags=_t("quick"),
         note="llama_sbhd rotated in place, forward only under no_grad"),
]

# Tiny cases for the CPU smoke run (Triton's interpreter): every code path, little work.
SMOKE_CASES = [
    Case("smoke_sbhd", "sbhd", 4, 2, 2, 16, "fp32", tags=_t("small", "sweep")),
    Case("smoke_bshd_partial", "bshd", 4, 2, 2, 32, "bf16", rot_dim=16),
    Case("smoke_thd_interleaved", "thd", 0, 1, 2, 16, "fp16", interleaved=True, seqlens=(3, 5, 0, 4)),
    Case("smoke_decode", "sbhd", 1, 4, 2, 16, "fp32", start_max=32, tags=_t("small")),
    Case("smoke_qk", "sbhd", 1, 4, 4, 16, "bf16", hk=1, start_max=32, tags=_t("small", "qk_headline")),
    Case("smoke_inplace", "bshd", 4, 2, 2, 16, "fp16", inplace=True),
]

# Pairs whose costs the issue compares: (packed thd, bshd with the same tokens).
THD_PAIRS = [("thd_short", "bshd_2048x8")]


def select(names=None, quick=False, smoke=False) -> list:
    """The cases of a run: by name (any of CASES and SMOKE_CASES), or the quick/smoke/full list."""
    pool = {c.name: c for c in CASES + SMOKE_CASES}
    if names:
        unknown = [n for n in names if n not in pool]
        if unknown:
            raise ValueError(f"unknown case(s) {unknown}; known: {', '.join(pool)}")
        return [pool[n] for n in names]
    if smoke:
        return list(SMOKE_CASES)
    if quick:
        return [c for c in CASES if "quick" in c.tags]
    return list(CASES)
