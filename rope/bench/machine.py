"""What a result was measured on: device, versions, date."""
from __future__ import annotations

import datetime
import platform
import sys

import torch


def machine_info(device) -> dict:
    import triton

    device = torch.device(device)
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device.type,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update({
            "gpu": p.name,
            "capability": f"{p.major}.{p.minor}",
            "sm_count": p.multi_processor_count,
            "gpu_memory_gib": round(p.total_memory / 2**30, 1),
            "l2_mib": round(getattr(p, "L2_cache_size", 0) / 2**20, 1),
            "cuda": torch.version.cuda,
        })
    else:
        info["gpu"] = "none (CPU, Triton interpreter)"
    return info


def describe(info: dict) -> str:
    gpu = info.get("gpu", "?")
    extra = f", CUDA {info['cuda']}" if info.get("cuda") else ""
    return f"{gpu}; torch {info['torch']}, triton {info['triton']}{extra}; {info['date']}"
