"""The CUDA runtime questions the library asks per call, answered without a CUDA call where possible."""
from __future__ import annotations

import torch

raw_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None


def capturing_on(device_index) -> bool:
    """Whether the current stream of that GPU is capturing a CUDA graph."""
    return capturing(raw_stream(device_index))


def capturing(stream) -> bool:
    """Whether the stream whose raw handle this is captures a CUDA graph (it must be the current stream)."""
    # CUDA refuses to capture on the legacy default stream, where eager code runs: there the answer
    # is known without asking CUDA, whose query has a host cost of its own per call (docs/design.md).
    return stream != 0 and torch.cuda.is_current_stream_capturing()
