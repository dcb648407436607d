"""cos/sin of `freqs`, evaluated once per `freqs` tensor and read by the kernel as a table.

Every layer of a step (and q and k) passes the same `freqs`. Evaluating accurate float32 sin/cos
inside the kernel puts a dependent chain (load angles, tens of instructions, a shared-memory move)
in front of each program's first load of `t`; reading them from a table does not, and lets the
kernel use wider tiles (BENCHMARKS.md, note 11). The table is `[freqs_len, 2, rot_dim]` float32:
row p holds cos(freqs[p]) then sin(freqs[p]), computed by PyTorch (CUDA's cosf/sinf, the same
functions the kernel would evaluate).

A table is reused while it provably describes `freqs`: the same live tensor (identity, checked
through a weak reference, so a new tensor at a recycled address never matches), the same storage
address, and the same version counter (PyTorch bumps it on every in-place write it performs). A
write PyTorch does not see (through `.data`, DLPack, or a foreign kernel) would leave a stale
table: `set_angle_table(False)` turns tables off for code that writes `freqs` that way.

No table, and the kernel evaluates sin/cos itself, when:
- a CUDA graph is being captured: replays read whatever `freqs` then holds, which a table
  computed before the capture would not follow;
- `freqs` is an inference tensor (no version counter), which serving code creates per call;
- tables are switched off.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

_ENABLED = [True]
_PREBUILT_IN_CAPTURE = [False]
_TABLES: dict = {}
_MAX_TABLES = 32  # distinct live `freqs` tensors kept; more than a model has at once


def set_angle_table(enabled: bool) -> None:
    """Read cos/sin from a table cached per `freqs` tensor (default), or evaluate them in the kernel.

    Both give the same values on a GPU (the same float32 functions). Turn tables off if `freqs` is
    modified in place in ways PyTorch's version counter does not see, or to save their memory
    (2 x the float32 size of `freqs` per live `freqs` tensor).
    """
    _ENABLED[0] = bool(enabled)
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


@contextlib.contextmanager
def prebuilt_in_capture():
    """Benchmarks only: within it, a capture may read a table built before it (none is built while
    capturing). Sound only if `freqs` is not written between replays, which the benchmark ensures;
    it lets graph replay time the kernel that eager calls run."""
    saved = _PREBUILT_IN_CAPTURE[0]
    _PREBUILT_IN_CAPTURE[0] = True
    try:
        yield
    finally:
        _PREBUILT_IN_CAPTURE[0] = saved


def capturing_on(device_index) -> bool:
    """Whether the current stream of that GPU is capturing a CUDA graph. CUDA refuses to capture on
    the legacy default stream, where eager code runs: there the answer is known without asking
    CUDA (which costs about 10 µs per call on that stream)."""
    if torch._C._cuda_getCurrentRawStream(device_index) == 0:
        return False
    return torch.cuda.is_current_stream_capturing()


def _build(freqs: torch.Tensor, freqs_len: int, rot_dim: int) -> torch.Tensor:
    angles = freqs.reshape(freqs_len, rot_dim).float()
    table = torch.empty((freqs_len, 2, rot_dim), dtype=torch.float32, device=freqs.device)
    torch.cos(angles, out=table[:, 0])
    torch.sin(angles, out=table[:, 1])
    return table


def cos_sin_table(freqs: torch.Tensor, freqs_len: int, rot_dim: int):
    """The table for `freqs` (built on first use), or None where none may be used (see above)."""
    if not _ENABLED[0] or freqs.is_inference():
        return None
    capturing = freqs.is_cuda and capturing_on(freqs.get_device())
    if capturing and not _PREBUILT_IN_CAPTURE[0]:
        return None
    key = id(freqs)
    entry = _TABLES.get(key)
    if entry is not None:
        ref, ptr, version, table = entry
        if ref() is freqs and ptr == freqs.data_ptr() and version == freqs._version:
            return table
    if capturing:
        return None
    table = _build(freqs, freqs_len, rot_dim)
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.clear()
    # The entry goes when `freqs` does, so a table never outlives its angles in memory.
    ref = weakref.ref(freqs, lambda _, key=key: _TABLES.pop(key, None))
    _TABLES[key] = (ref, freqs.data_ptr(), freqs._version, table)
    return table
