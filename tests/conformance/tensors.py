"""Tensors in any layout, drawn as structure and built from a seed.

A drawn `Layout` says how a tensor lies in memory: the order of its leading dims (the last stays innermost,
stride 1, as every projection produces it) and padding per dim, so that the tensor is a view into a larger
buffer (a head slice of a packed qkv, a transposed projection, a slice of a wider table). The padding is NaN:
an implementation that reads outside its view gets NaN, and one that writes there is caught by the
side-effect check (contract.py). Values are N(0, 1), never zeros; angles span several turns.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import strategies as st

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Layout(NamedTuple):
    order: tuple  # the dims, outermost first, as they lie in memory (the last dim always last)
    pad: tuple  # extra elements per dim (logical order); the view sits after pad // 2 of them
    # > 0: the view's size-1 dims take this stride. PyTorch leaves a size-1 dim's stride free (such a tensor is
    # still contiguous), so an implementation must never let it address anything; one that takes a row stride
    # from it (Liger's decode launcher) rotates the wrong rows.
    unit_stride: int = 0
    # > 1: the last dim takes every step-th element of its buffer (an index tensor sliced from a wider one, as
    # `positions = ids[:, 0]` gives): an implementation that reads it from its data pointer as dense reads others.
    step: int = 1


def contiguous(ndim: int) -> Layout:
    return Layout(tuple(range(ndim)), (0,) * ndim)



class Wide(NamedTuple):
    """A layout of a tensor of heads: each head's channels a slice of a wider row, `before` NaN channels ahead of it
    and `after` behind (q's heads in a projection's output that holds more); `order`, the dims outermost first as
    they lie in memory (the last always last), as Layout's."""
    order: tuple
    before: int
    after: int


def place_heads(arena, shape, dtype, layout):
    """N(0, 1) values of `shape` laid out as `layout` (a Layout or a Wide) says; a Wide one within NaN-filled wider
    rows (a read or a write past the rows shows as NaN in the result, or as a side effect)."""
    if not isinstance(layout, Wide):
        return arena.randn(shape, dtype, layout)
    values = torch.randn(shape, generator=arena.gen, dtype=torch.float64).to(dtype)
    nan = float("nan")
    full = torch.cat([torch.full((*shape[:-1], layout.before), nan, dtype=dtype), values,
                      torch.full((*shape[:-1], layout.after), nan, dtype=dtype)], dim=-1)
    return arena.place(full, Layout(layout.order, (0,) * len(shape)))[..., layout.before:layout.before + shape[-1]]

@st.composite
def layouts(draw, ndim: int, padded_dims=None, permute: bool = True, spaced: bool = False) -> Layout:
    """Contiguous half the time; else leading dims permuted and/or padded (`padded_dims`: which may be). `spaced`,
    for arguments whose last dim may have any stride: half the time first, the last dim every other element (and
    the rest as above). Either way, size-1 dims get a stride no dense layout gives them half the time."""
    if ndim == 0:
        return contiguous(ndim)
    step = 2 if spaced and draw(st.booleans()) else 1
    unit = draw(st.sampled_from((0, 5)))
    if step == 1 and draw(st.booleans()):
        return contiguous(ndim)._replace(unit_stride=unit)
    lead = list(range(ndim - 1))
    order = tuple(draw(st.permutations(lead))) + (ndim - 1,) if permute else tuple(range(ndim))
    dims = range(ndim) if padded_dims is None else padded_dims
    pad = tuple(draw(st.sampled_from((0, 0, 1, 3))) if i in dims else 0 for i in range(ndim))
    return Layout(order, pad, unit, step)


def channel_layouts(ndim: int) -> st.SearchStrategy:
    """`layouts` for a tensor of heads whose channels may be strided too (an expression that takes any tensor): a
    quarter of the time the last dim every other element, the rest as `layouts` draws."""
    return st.one_of(layouts(ndim), layouts(ndim, spaced=True))


class Arena:
    """Builds a case's tensors from one seed, and remembers every buffer (for the side-effect check)."""

    def __init__(self, seed: int, device=DEVICE):
        self.gen = torch.Generator().manual_seed(seed)
        self.device = device
        self.buffers: list = []

    def place(self, values: torch.Tensor, layout: Layout = None, fill=float("nan")) -> torch.Tensor:
        """`values` (on the CPU) as a view with `layout` into a new buffer on the device, `fill` around it."""
        layout = layout or contiguous(values.dim())
        shape = [n + p for n, p in zip(values.shape, layout.pad, strict=True)]
        if values.dim():
            shape[-1] = layout.step * values.shape[-1] + layout.pad[-1]
        buffer = torch.full([shape[i] for i in layout.order], fill, dtype=values.dtype) if values.is_floating_point() \
            else torch.zeros([shape[i] for i in layout.order], dtype=values.dtype)
        buffer = buffer.to(self.device)
        inverse = [layout.order.index(i) for i in range(values.dim())]
        full = buffer.permute(inverse)
        view = full[tuple(slice(p // 2, p // 2 + n) for n, p in zip(values.shape, layout.pad, strict=True))[:-1]
                    + (slice(layout.pad[-1] // 2, layout.pad[-1] // 2 + layout.step * values.shape[-1],
                             layout.step),)] if values.dim() else full
        view.copy_(values.to(self.device))
        if layout.step > 1 and not values.is_floating_point() and values.numel():
            # the gaps of a spaced index tensor hold other valid values, each element's own again (a, a, b, b, ...),
            # so that a reader that takes the gaps for elements reads wrong but in-range entries rather than zeros,
            # and wrong from the second element on (values rolled by one would put b after a: a dense read of two
            # elements would come out right)
            gaps = full[..., layout.pad[-1] // 2 + 1::layout.step][..., :values.shape[-1]]
            gaps.copy_(values.to(self.device))
        if layout.unit_stride and 1 in view.shape:
            strides = [layout.unit_stride if n == 1 else st_ for n, st_ in zip(view.shape, view.stride(), strict=True)]
            view = view.as_strided(view.shape, strides, view.storage_offset())
        self.buffers.append(buffer)
        return view

    def randn(self, shape, dtype, layout: Layout = None) -> torch.Tensor:
        return self.place(torch.randn(tuple(shape), generator=self.gen, dtype=torch.float64).to(dtype), layout)

    def angles(self, shape, turns: float = 4.0) -> torch.Tensor:
        """float64 angles in [-turns * 2 pi, turns * 2 pi] (on the CPU; tables are built from them)."""
        return (torch.rand(tuple(shape), generator=self.gen, dtype=torch.float64) * 2 - 1) * turns * 2 * torch.pi

    def integers(self, low, high, shape, dtype=torch.int64) -> torch.Tensor:
        return torch.randint(low, high, tuple(shape), generator=self.gen, dtype=torch.int64).to(dtype)


def seeds():
    return st.integers(0, 2**31 - 1)
