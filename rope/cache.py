"""`RoPECache`: cos/sin tables owned by the caller, read in place of evaluating sin/cos.

rope keeps its own tables per `freqs` tensor (`rope._table`), but never makes one inside a CUDA-graph
capture, where a table built at capture time would not follow `freqs` at replay. A `RoPECache` is
built before capture by the caller, who keeps it: captures and eager calls read its rows.
"""
from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES
from ._cuda import capturing_on


class RoPECache:
    """cos and sin of the angles, [s2, d2] each (row p: position p; one column per rotary channel,
    laid out as `freqs` is: cat(theta, theta) half-split, or pairs for interleaved).

    Pass it where `rope.apply_rotary_pos_emb` or `rope.apply_rotary_pos_emb_qk` take `freqs`. The
    tables are complete on every stream once the constructor returns (it waits for the build), and
    their memory lives as long as the object. `update_` rewrites them in place, so a captured graph
    that reads them follows the new values at its next replay; order that write before the replay's
    reads, as for any input a graph reads.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        for name, x in (("cos", cos), ("sin", sin)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
            if x.dtype not in FLOAT_DTYPES:
                raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16, got {x.dtype}")
            if x.dim() != 2 or x.shape[1] < 2 or x.shape[1] % 2:
                raise ValueError(f"{name}: expected shape [s2, d2] with d2 even, got {tuple(x.shape)}")
        if sin.shape != cos.shape or sin.dtype != cos.dtype or sin.device != cos.device:
            raise ValueError(f"sin: expected the shape, dtype and device of cos ({tuple(cos.shape)}, {cos.dtype}, "
                             f"{cos.device}), got {tuple(sin.shape)}, {sin.dtype}, {sin.device}")
        if cos.is_cuda and capturing_on(cos.get_device()):
            raise RuntimeError("RoPECache: build it before CUDA-graph capture (its tables must exist at replay)")
        self.cos = cos.contiguous().clone()
        self.sin = sin.contiguous().clone()
        # shape [s2, 1, 1, d2] for the checks that `freqs` gets
        self.as_freqs = self.cos.view(cos.shape[0], 1, 1, cos.shape[1])
        if self.cos.is_cuda:
            torch.cuda.current_stream(self.cos.device).synchronize()

    @classmethod
    def from_freqs(cls, freqs: torch.Tensor, dtype: torch.dtype = torch.float32) -> RoPECache:
        """The tables of TransformerEngine-style angles `freqs` [s2, 1, 1, d2], computed in float32 and
        stored in `dtype`."""
        angles = _angles(freqs)
        return cls(torch.cos(angles).to(dtype), torch.sin(angles).to(dtype))

    def update_(self, freqs: torch.Tensor) -> RoPECache:
        """Recompute the tables from `freqs` of the same shape, in place (allowed during capture)."""
        angles = _angles(freqs)
        if tuple(angles.shape) != tuple(self.cos.shape) or angles.device != self.cos.device:
            raise ValueError(f"freqs: expected shape [{self.cos.shape[0]}, 1, 1, {self.cos.shape[1]}] on "
                             f"{self.cos.device}, got {tuple(freqs.shape)} on {freqs.device}")
        self.cos.copy_(torch.cos(angles))
        self.sin.copy_(torch.sin(angles))
        return self

    def __repr__(self):
        s2, d2 = self.cos.shape
        return f"RoPECache(s2={s2}, d2={d2}, dtype={self.cos.dtype}, device={self.cos.device})"


def _angles(freqs) -> torch.Tensor:
    if not isinstance(freqs, torch.Tensor):
        raise TypeError(f"freqs: expected a torch.Tensor, got {type(freqs).__name__}")
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1 or not freqs.is_floating_point():
        raise ValueError(f"freqs: expected floating-point angles of shape [s2, 1, 1, d2], got {tuple(freqs.shape)} "
                         f"{freqs.dtype}")
    return freqs[:, 0, 0, :].float()
