"""The benchmarks' host clock (importable without a GPU: the benchmark modules skip, their collection does not)."""
from __future__ import annotations

import time

import torch


def cuda_sync_clock() -> float:
    """pytest-benchmark's timer: waits for the GPU, then reads the host clock."""
    torch.cuda.synchronize()
    return time.perf_counter()
