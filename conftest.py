"""Top-level pytest configuration.

Without a CUDA device the Triton kernels run in Triton's interpreter on CPU tensors. The
interpreter is chosen by TRITON_INTERPRET=1, which Triton reads when it is first imported, so it
is set here, before any test module imports `rope` (and with it, `triton`).
"""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
