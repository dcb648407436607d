"""The Triton kernels, one family per module: rotation (`rope`), QK-RMSNorm with rotation (`qknorm`) and rotation
fused with the KV-cache write (`cache_write`), over the shared helpers of `_common` (docs/design.md)."""
from .cache_write import rope_cache_kernel
from .qknorm import rope_qknorm_kernel
from .rope import rope_kernel, rope_qk_kernel

__all__ = ["rope_cache_kernel", "rope_kernel", "rope_qk_kernel", "rope_qknorm_kernel"]
