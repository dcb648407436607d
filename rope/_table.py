"""Tables derived once per input tensor and read by the kernel (docs/design.md, "The tables").

- cos/sin of `freqs`: `[2, freqs_len, rot_dim]` float32, cos(freqs) then sin(freqs), read as two tables,
  computed by PyTorch (CUDA's cosf/sinf, the functions the kernel would evaluate). Reading it removes the
  dependent chain (angles, sin/cos, a shared-memory move) in front of each program's first load of `t`.
- positions of `thd` tokens: `[T]` int64, each token's position in its sequence (context-parallel mapping
  included), from `cu_seqlens`; one load replaces each program's search of `cu_seqlens`, so it is built
  only where that search takes several rounds and there are no `start_positions`.

A table is reused while it provably describes its source: the same live tensor (a weak reference),
storage address and version counter. Another stream than the builder's waits on the device for the
build, and the table's memory is tied to it (`record_stream`). No table during CUDA-graph capture
(replays must follow the source's values), for inference tensors (no version counter), or when off.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from . import _memo
from ._cuda import capturing, raw_stream

_ENABLED = [True]
_TABLES = _memo.memo("cos/sin and position tables", 32)  # distinct live sources kept; more than a model has at once


def set_angle_table(enabled: bool) -> None:
    """Read cos/sin from a table cached per `freqs` tensor and `thd` positions from a table cached per
    `cu_seqlens` tensor (default), or evaluate sin/cos and search `cu_seqlens` in the kernel: the same
    results on a GPU. Turn tables off if `freqs` or `cu_seqlens` is written behind PyTorch's version
    counter, or to save their memory (2 x `freqs` in float32, 8 bytes per token of `cu_seqlens`)."""
    if not isinstance(enabled, bool):  # a string or a number is not read as true or false
        raise TypeError(f"enabled: expected a bool, got {type(enabled).__name__}")
    _ENABLED[0] = enabled
    if not enabled:
        _TABLES.clear()


@contextlib.contextmanager
def evaluated():
    """Within it, calls evaluate sin/cos in the kernel (the path a CUDA graph capture takes);
    existing tables are kept."""
    saved = _ENABLED[0]
    _ENABLED[0] = False
    try:
        yield
    finally:
        _ENABLED[0] = saved


def _build(freqs: torch.Tensor, freqs_len: int, rot_dim: int, as_read):
    """(memory, as_read(cos, sin)): the two tables are views of one allocation."""
    # The kernel's angles get no gradient (as in TransformerEngine's fused path): the table is built outside autograd.
    angles = freqs.detach().reshape(freqs_len, rot_dim).float()
    table = torch.empty((2, freqs_len, rot_dim), dtype=torch.float32, device=freqs.device)
    torch.cos(angles, out=table[0])
    torch.sin(angles, out=table[1])
    return table, as_read(table[0], table[1])


class _Entry:
    """A built table and what proves it still describes its source; on a GPU also the stream that
    built it, an event recorded there after the build, and the other streams that have read it."""

    __slots__ = ("ref", "ptr", "version", "memory", "table", "stream", "ready", "readers")

    def __init__(self, ref, src, memory, table, stream):
        self.ref, self.ptr, self.version, self.stream = ref, src.data_ptr(), src._version, stream
        self.memory, self.table = memory, table  # the allocation, and what the kernel reads of it
        self.ready = None
        self.readers = set()
        if stream is not None:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(src.device))

    def order_after_build(self, raw_stream, device):
        """Make the current stream (`raw_stream`, not the builder's) read the table only after it is
        written, and keep its memory from reuse while that stream may read it (the caching allocator
        learns of other streams only through `record_stream`)."""
        current = torch.cuda.current_stream(device)
        current.wait_event(self.ready)
        if raw_stream not in self.readers:
            self.memory.record_stream(current)
            self.readers.add(raw_stream)


def _cached(src: torch.Tensor, key, build, *args):
    """build(src, *args) -> (memory, table) once per `key` (it starts with id(src)) while `src` provably holds the same
    values, or None where no table may be used (see above); safe to read on any stream."""
    if not _ENABLED[0]:
        return None
    stream = None
    if src.is_cuda:
        stream = raw_stream(src.get_device())
        if capturing(stream):
            return None
    entry = _TABLES.get(key)
    # An entry is only ever made for a tensor that is not an inference tensor (below), so one that
    # is still `src` needs no is_inference() check.
    if entry is not None and entry.ref() is src and entry.ptr == src.data_ptr() and entry.version == src._version:
        if stream != entry.stream:
            entry.order_after_build(stream, src.device)
        return entry.table
    if src.is_inference():
        return None
    memory, table = build(src, *args)
    # The entry goes when `src` does, so a table never outlives its source in memory.
    ref = weakref.ref(src, lambda _, key=key: _TABLES.pop(key, None))
    _TABLES.put(key, _Entry(ref, src, memory, table, stream))
    return table


def cos_sin_table(freqs: torch.Tensor, freqs_len: int, rot_dim: int, as_read):
    """as_read(cos, sin) of the tables for `freqs` (built on first use, kept with them: what the kernel reads of
    them), or None where none may be used (see above)."""
    return _cached(freqs, id(freqs), _build, freqs_len, rot_dim, as_read)


def _build_positions(cu_seqlens: torch.Tensor, n_tokens: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Position of each local token (docs/contract.md section 3): its offset j in the sequence whose local
    range holds it (the last such sequence: empty ones are skipped), mapped to the global position under
    context parallelism. No host-device synchronization."""
    cu = cu_seqlens.to(torch.int64) // cp_size
    n_seqs = cu.shape[0] - 1
    tokens = torch.arange(n_tokens, dtype=torch.int64, device=cu.device)
    seq = (torch.searchsorted(cu, tokens, right=True) - 1).clamp_(0, n_seqs)
    start = cu[seq]
    pos = tokens - start
    if cp_size > 1:
        c = (cu[(seq + 1).clamp_(max=n_seqs)] - start) // 2
        pos = torch.where(pos < c, pos + cp_rank * c, pos - c + (2 * cp_size - 1 - cp_rank) * c)
    # A token past the last sequence (value checks off) has no position: NaN in the kernel.
    return torch.where(seq < n_seqs, pos, -1)


def token_positions(cu_seqlens: torch.Tensor, n_tokens: int, cp_size: int, cp_rank: int):
    """The position table for `cu_seqlens` (built on first use), or None where none may be used."""
    return _cached(cu_seqlens, (id(cu_seqlens), n_tokens, cp_size, cp_rank), _position_entry, n_tokens, cp_size,
                   cp_rank)


def _position_entry(*args):
    table = _build_positions(*args)
    return table, table  # (memory, what the kernel reads): the same tensor
