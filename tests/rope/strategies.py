"""Hypothesis strategies for rotary-embedding calls: draw the structure, build the data from a seed.

A drawn `Spec` holds only structure (format, sizes, dtype, mode, context parallelism, packed
sequence lengths, memory layouts, the kind of angles and values) and one integer seed. `build`
turns it into tensors with a seeded `torch.Generator` on the CPU, then moves them to the test
device, so a failing example prints as a short, readable structure and replays exactly.

Shapes are bounded per Hypothesis profile (`LIMITS`), and every profile shares one element cap
for `t`, overridable with the environment variable ROPE_MAX_ELEMENTS.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional

import torch
from hypothesis import settings
from hypothesis import strategies as st

from .cases import DEVICE

FORMATS = ("sbhd", "bshd", "thd")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAYOUTS = ("contiguous", "transposed", "sliced", "strided_last")
GRAD_LAYOUTS = ("contiguous", "expanded", "transposed", "strided_last")


class Limits(NamedTuple):
    max_d: int
    max_s: int  # local sequence length (sbhd/bshd)
    max_b: int
    max_h: int
    max_rows: int  # s * b * h (tokens * heads for thd)
    max_tokens: int  # thd: local tokens in the packed tensor
    max_seqs: int  # thd: sequences
    max_cp: int
    max_start: int
    max_extra_freqs: int
    max_elements: int
    # Head dims to draw from (None: any 2..max_d). On the GPU every new (d, d2, dtype, mode) is a
    # new kernel compilation, so that profile keeps to the head dims models use, with full and
    # half rotary width; the odd sizes are covered by the explicit examples and by cpu-interp.
    head_dims: Optional[tuple] = None


# The interpreter runs one Triton program after another (about 5 ms each, one per token or token
# group), so cpu-interp keeps tokens and rows few. `gpu` reaches tens of MB per tensor.
LIMITS = {
    "cpu-interp": Limits(max_d=64, max_s=12, max_b=3, max_h=4, max_rows=64, max_tokens=16, max_seqs=5,
                         max_cp=3, max_start=8, max_extra_freqs=4, max_elements=4096),
    "gpu": Limits(max_d=256, max_s=2048, max_b=8, max_h=32, max_rows=1 << 16, max_tokens=4096, max_seqs=48,
                  max_cp=4, max_start=2048, max_extra_freqs=64, max_elements=8 << 20,
                  head_dims=(64, 80, 96, 128, 256)),
}
LIMITS["nightly"] = LIMITS["gpu"] if torch.cuda.is_available() else LIMITS["cpu-interp"]


def profile_name() -> str:
    getter = getattr(settings, "get_current_profile_name", None)
    name = getter() if getter else getattr(settings, "_current_profile", "default")
    return name if name in LIMITS else ("gpu" if torch.cuda.is_available() else "cpu-interp")


_OVERRIDE: list = []


@contextmanager
def limits_override(lim: Limits):
    """Draw with these limits inside the block (tests of the suite itself keep shapes small)."""
    _OVERRIDE.append(lim)
    try:
        yield
    finally:
        _OVERRIDE.pop()


def limits() -> Limits:
    lim = _OVERRIDE[-1] if _OVERRIDE else LIMITS[profile_name()]
    cap = os.environ.get("ROPE_MAX_ELEMENTS")
    return lim._replace(max_elements=min(lim.max_elements, int(cap))) if cap else lim


def scaled_examples(factor: float) -> settings:
    """The profile's example count times `factor`, for properties much cheaper or dearer than most."""
    return settings(max_examples=max(1, int(settings.default.max_examples * factor)))


# ----------------------------------------------------------------------------------------------
# The drawn structure
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """Structure of one call. For thd, `s` is the local token count and `b` is 1 (derived)."""

    tensor_format: str
    dtype: torch.dtype
    s: int
    b: int
    h: int
    d: int
    rot_dim: int
    interleaved: bool
    cp_size: int = 1
    cp_rank: int = 0
    seqlens: tuple = ()  # thd: global length of every sequence
    max_start: Optional[int] = None  # start_positions in [0, max_start]; None: not passed
    extra_freqs: int = 0  # rows of freqs past the largest position
    angles: str = "random"  # random (every element its own angle) | rotation (p * omega, equal pairs) | zero
    angle_log2: int = 3  # angles reach 2**angle_log2 rad
    values: str = "normal"  # normal: N(0, 1) | near_max: uniform in +-max(dtype)/2
    layout: str = "contiguous"
    grad_layout: str = "contiguous"
    freqs_layout: str = "contiguous"  # or sliced: a window of a wider last dim, as rotary_percent < 1 gives
    seed: int = 0

    @property
    def shape(self):
        return {"sbhd": (self.s, self.b, self.h, self.d), "bshd": (self.b, self.s, self.h, self.d),
                "thd": (self.s, self.h, self.d)}[self.tensor_format]

    @property
    def n_seqs(self):
        return len(self.seqlens) if self.tensor_format == "thd" else self.b

    @property
    def local_lengths(self):
        if self.tensor_format == "thd":
            return [n // self.cp_size for n in self.seqlens]
        return [self.s] * self.b

    def max_position(self, start: Optional[int] = None) -> int:
        """Largest position any token reaches (docs/contract.md section 3), -1 when there is no token."""
        top = -1
        for length in self.local_lengths:
            if length == 0:
                continue
            if self.cp_size == 1:
                top = max(top, length - 1)
            else:
                top = max(top, (2 * self.cp_size - self.cp_rank) * (length // 2) - 1)
        if top >= 0 and self.max_start is not None:
            top += self.max_start if start is None else start
        return top

    @property
    def freqs_len(self):
        return self.max_position() + 1 + self.extra_freqs


def make_spec(tensor_format="sbhd", dtype=torch.float32, s=4, b=2, h=2, d=16, rot_dim=None, interleaved=False,
              seqlens=(), **kw) -> Spec:
    """A Spec with derived fields filled in (for @example pins)."""
    cp_size = kw.get("cp_size", 1)
    if tensor_format == "thd":
        s, b = sum(seqlens) // cp_size, 1
    return Spec(tensor_format, dtype, s, b, h, d, d if rot_dim is None else rot_dim, interleaved,
                seqlens=tuple(seqlens), **kw)


# ----------------------------------------------------------------------------------------------
# Composable strategies
# ----------------------------------------------------------------------------------------------

def dtypes():
    return st.sampled_from(DTYPES)


def head_dims(lim: Limits):
    if lim.head_dims:
        return st.sampled_from(lim.head_dims)
    # d need not be even or a power of two: only the rotary width is constrained
    return st.integers(2, lim.max_d)


def rot_dims(d: int, partial: Optional[bool] = None):
    """Even widths 2 <= d2 <= d (d2 < d when partial)."""
    hi = d // 2 if partial is not True else (d - 1) // 2
    lo = d // 2 if partial is False else 1
    if partial is False and d % 2:
        raise ValueError("a full-width rotation needs an even d")
    return st.integers(lo, hi).map(lambda k: 2 * k)


@st.composite
def cp_configs(draw, lim: Limits, cp: Optional[bool] = None):
    """(cp_size, cp_rank): no context parallelism, or a rank of a 2..max_cp group."""
    use = draw(st.booleans()) if cp is None else cp
    if not use:
        return 1, 0
    size = draw(st.integers(2, lim.max_cp))
    return size, draw(st.integers(0, size - 1))


@st.composite
def packed_seqlens(draw, lim: Limits, cp_size: int, min_seqs: int = 0):
    """Global sequence lengths for thd: empty and one-token sequences included.

    With context parallelism every length is a multiple of 2 * cp_size (two chunks per rank).
    """
    unit = 2 * cp_size if cp_size > 1 else 1
    budget = lim.max_tokens  # local tokens
    n = draw(st.integers(min_seqs, lim.max_seqs))
    lengths = []
    for _ in range(n):
        k = draw(st.integers(0, max(0, budget) * cp_size // unit))
        lengths.append(k * unit)
        budget -= k * unit // cp_size
    return tuple(lengths)


def angle_kinds(rotation: Optional[bool]):
    if rotation is True:
        return st.just("rotation")
    if rotation is False:
        return st.just("random")
    return st.sampled_from(["random", "rotation"])


@st.composite
def rope_specs(draw, formats=FORMATS, dtypes_=None, cp: Optional[bool] = None, start: Optional[bool] = None,
               rotation: Optional[bool] = None, partial: Optional[bool] = None, min_seqs: int = 0,
               min_b: int = 1, layouts=LAYOUTS, grad_layouts=GRAD_LAYOUTS,
               values=("normal", "normal", "normal", "near_max"), lim: Optional[Limits] = None):
    """A Spec within the profile's limits (or `lim`); each keyword narrows one dimension of the draw."""
    lim = limits() if lim is None else lim
    fmt = draw(st.sampled_from(formats))
    dtype = draw(dtypes_ if dtypes_ is not None else dtypes())
    d = draw(head_dims(lim).filter(lambda d: partial is not True or d >= 3))
    if partial is False and d % 2:
        d -= 1
    d = max(d, 2)
    if lim.head_dims and partial is not False:  # realistic widths: full, or half (rotary_percent 0.5)
        rot_dim = draw(st.sampled_from([d // 2 - d // 2 % 2] if partial else [d, d // 2 - d // 2 % 2]))
    else:
        rot_dim = draw(rot_dims(d, partial))
    interleaved = draw(st.booleans())
    cp_size, cp_rank = draw(cp_configs(lim, cp))
    use_start = draw(st.booleans()) if start is None else start
    rows_cap = max(1, min(lim.max_rows, lim.max_elements // d))
    if fmt == "thd":
        seqlens = draw(packed_seqlens(lim._replace(max_tokens=min(lim.max_tokens, rows_cap)), cp_size, min_seqs))
        s, b = sum(seqlens) // cp_size, 1
    else:
        seqlens = ()
        unit = 2 if cp_size > 1 else 1
        s = unit * draw(st.integers(1, max(1, min(lim.max_s, rows_cap) // unit)))
        b = draw(st.integers(min(min_b, rows_cap // s), max(1, min(lim.max_b, rows_cap // s))))
    h = draw(st.integers(1, max(1, min(lim.max_h, rows_cap // max(1, s * b)))))
    max_start = draw(st.integers(0, lim.max_start)) if use_start else None
    extra = draw(st.integers(0, lim.max_extra_freqs))
    angles = draw(angle_kinds(rotation))
    # 2^17 rad ~ 1.3e5 rad: long-context angles, where approximate sin/cos fall apart
    angle_log2 = draw(st.sampled_from([3, 1, 7, 17]))
    value_kind = draw(st.sampled_from(values))
    layout = draw(st.sampled_from(layouts))
    grad_layout = draw(st.sampled_from(grad_layouts))
    freqs_layout = draw(st.sampled_from(["contiguous", "sliced"]))
    seed = draw(st.integers(0, 2**32 - 1))
    return Spec(fmt, dtype, s, b, h, d, rot_dim, interleaved, cp_size, cp_rank, seqlens, max_start, extra,
                angles, angle_log2, value_kind, layout, grad_layout, freqs_layout, seed)


# ----------------------------------------------------------------------------------------------
# From structure to tensors
# ----------------------------------------------------------------------------------------------

@dataclass
class Case:
    """Tensors of one call. `t` may be a view of `t_base` (a layout); `view` rebuilds it from a base."""

    spec: Spec
    t: torch.Tensor
    t_base: torch.Tensor
    view: Callable
    freqs: torch.Tensor
    g: torch.Tensor
    start_positions: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None
    extra: dict = field(default_factory=dict)

    @property
    def rot_dim(self):
        return self.freqs.shape[-1]

    @property
    def interleaved(self):
        return self.spec.interleaved

    def kwargs(self, **override) -> dict:
        """Keyword arguments of the call; only the non-default ones, so older TE signatures work."""
        sp = self.spec
        kw = dict(tensor_format=sp.tensor_format)
        if self.start_positions is not None:
            kw["start_positions"] = self.start_positions
        if sp.interleaved:
            kw["interleaved"] = True
        if self.cu_seqlens is not None:
            kw["cu_seqlens"] = self.cu_seqlens
        if sp.cp_size > 1:
            kw["cp_size"] = sp.cp_size
            kw["cp_rank"] = sp.cp_rank
        kw.update(override)
        return {k: v for k, v in kw.items() if v is not None}


def random_values(shape, dtype, kind, gen) -> torch.Tensor:
    """CPU tensor of `dtype`. near_max: |v| <= max(dtype)/2, so a rotated element, bounded by
    |x_i| + |x_pi(i)| <= max(dtype), stays finite (max/2 is representable, so rounding cannot push
    a value past it)."""
    if kind == "normal":
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    if kind == "near_max":
        half = torch.finfo(dtype).max / 2
        u = torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1
        return (u * half).to(dtype)
    raise ValueError(kind)


def layout_tensor(shape, dtype, layout, kind, gen, device=DEVICE):
    """(view, base, view_fn): values of `shape` in the requested memory layout."""
    shape = tuple(shape)
    d = shape[-1]
    if layout == "contiguous":
        base_shape, fn = shape, (lambda x: x)
    elif layout == "transposed":  # the (0, 1)-swapped memory of the other format
        base_shape, fn = (shape[1], shape[0]) + shape[2:], (lambda x: x.transpose(0, 1))
    elif layout == "sliced":  # q out of a fused projection: a window of a wider last dim
        base_shape, fn = shape[:-1] + (d + 24,), (lambda x: x[..., 8:8 + d])
    elif layout == "strided_last":  # last-dim stride 2
        base_shape, fn = shape[:-1] + (2 * d,), (lambda x: x[..., ::2])
    elif layout == "expanded":  # one row broadcast over every token (stride 0), as autograd passes
        # the gradient of a broadcast
        base_shape = (1,) * (len(shape) - 2) + shape[-2:]

        def fn(x):
            return x.expand(shape)
    else:
        raise ValueError(layout)
    base = random_values(base_shape, dtype, kind, gen).to(device)
    return fn(base), base, fn


def rotation_angles(n_pos, rot_dim, interleaved, angle_log2, gen, device=DEVICE):
    """theta[p, k] = p * omega_k, laid out as RotaryPositionEmbedding does (pairs share an angle).

    omega_k = m_k * 2^e with m_k < 2^10 (fewer bits for very long sequences), so every product
    p * m_k has at most 23 significant bits: the float32 angles are exact, theta[m] - theta[n] is
    exactly (m - n) * omega, and the relative-position identity holds for the exact rotation.
    """
    p_bits = max(0, math.ceil(math.log2(max(n_pos, 1))))
    m_bits = min(10, 23 - p_bits)
    m = torch.randint(1, 2**m_bits, (rot_dim // 2,), generator=gen, dtype=torch.int64)
    e = angle_log2 - m_bits - p_bits
    omega = m.double() * 2.0**e
    theta = torch.arange(n_pos, dtype=torch.float64)[:, None] * omega[None, :]
    if interleaved:
        full = theta.repeat_interleave(2, dim=-1)
    else:
        full = torch.cat([theta, theta], dim=-1)
    f = full.float()
    assert torch.equal(f.double(), full), "rotation angles must be exact in float32"
    return f.reshape(n_pos, 1, 1, rot_dim).to(device)


def make_angles(spec: Spec, n_pos: int, gen, device=DEVICE):
    if spec.angles == "zero":
        f = torch.zeros(n_pos, 1, 1, spec.rot_dim, device=device)
    elif spec.angles == "rotation":
        f = rotation_angles(n_pos, spec.rot_dim, spec.interleaved, spec.angle_log2, gen, device)
    else:
        # independent angles per element: the two halves differ, as the elementwise contract allows
        f = torch.rand((n_pos, 1, 1, spec.rot_dim), generator=gen, dtype=torch.float64) * 2.0**spec.angle_log2
        f = f.float().to(device)
    if spec.freqs_layout == "sliced":
        wide = torch.full((n_pos, 1, 1, spec.rot_dim + 6), float("nan"), device=device)
        wide[..., 2:2 + spec.rot_dim] = f
        f = wide[..., 2:2 + spec.rot_dim]  # NaN around it: a read outside the window shows
    return f


def cu_seqlens_of(lengths, dtype=torch.int32, device=DEVICE):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=dtype, device=device)


def build(spec: Spec, device=DEVICE) -> Case:
    gen = torch.Generator().manual_seed(spec.seed)
    t, t_base, view = layout_tensor(spec.shape, spec.dtype, spec.layout, spec.values, gen, device)
    freqs = make_angles(spec, spec.freqs_len, gen, device)
    g, _, _ = layout_tensor(spec.shape, spec.dtype, spec.grad_layout, spec.values, gen, device)
    start = None
    if spec.max_start is not None:
        start = torch.randint(0, spec.max_start + 1, (spec.n_seqs,), generator=gen)
        lengths = spec.local_lengths
        if any(lengths):  # the longest sequence starts at max_start: it reaches the last needed row
            start[max(range(len(lengths)), key=lengths.__getitem__)] = spec.max_start
        start = start.to(device)
    cu = None
    if spec.tensor_format == "thd":
        # int32 and int64 both allowed; alternate by seed
        cu = cu_seqlens_of(spec.seqlens, torch.int64 if spec.seed % 2 else torch.int32, device)
    return Case(spec, t, t_base, view, freqs, g, start, cu)


def with_(spec: Spec, **kw) -> Spec:
    return replace(spec, **kw)
