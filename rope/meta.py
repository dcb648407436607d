"""Meta's Llama convention: `apply_rotary_emb(xq, xk, freqs_cis)` (the reference code of Llama 2, 3 and 4 in
meta-llama/llama and meta-llama/llama-models; transformers' Llama 4 with freqs_cis gathered per token).

xq [b, s, h_q, d], xk [b, s, h_k, d], d even; freqs_cis complex64 [s, d/2] (one row per position, broadcast over
batch and heads as `reshape_for_broadcast` does) or [b or 1, s, d/2] (a row per token, gathered from
position ids). Channels (2i, 2i + 1) are the complex number x_2i + i x_2i+1 that `view_as_complex` gives; the
result is that number times freqs_cis[.., i], in float32, rounded once to each input's dtype (`type_as`).
"""
from __future__ import annotations

from . import reference
from ._backend import Call, convention, dispatch
from ._checks import Layout, check_heads_pair, complex_tables
from ._launch import table_angles


def apply_rotary_emb(xq, xk, freqs_cis):
    """Meta's `apply_rotary_emb`: new tensors (xq's and xk's dtypes); the gradient flows to xq and xk, none to
    freqs_cis. complex128 freqs_cis is refused, as float64 is everywhere in rope."""
    check_heads_pair(xq, xk, ("xq", "xk"), 4, "[b, s, h, d]")
    b, s, _, d = xq.shape
    cos, sin = complex_tables(freqs_cis, xq, "xq")
    if cos.shape not in ((s, d // 2), (1, s, d // 2), (b, s, d // 2)):
        raise ValueError(f"freqs_cis: expected shape [s, d/2] = [{s}, {d // 2}] or [b or 1, s, d/2] = "
                         f"[{b} or 1, {s}, {d // 2}], got {tuple(freqs_cis.shape)}")
    return dispatch(META, (xq, xk), (cos, sin))


def _call(ts, reads, flags) -> Call:
    b, s, h, d = ts[0].shape
    return Call(Layout(s=s, b=b, h=h, d=d, rot_dim=d, freqs_len=s), tensor_format="bshd", interleaved=True)


def _reads(call, reads, flags) -> tuple:
    cos, sin = reads
    per_batch = cos.dim() == 3 and cos.shape[0] == call.layout.b and call.layout.b > 1
    return table_angles(cos, sin, half=True, per_batch=per_batch), None, None, False


def _reference(ts, reads, flags, backward) -> tuple:
    full = [reference.full_width(t, True) for t in reads]
    return tuple(reference.rotate(x, full[0].unsqueeze(-2), full[1].unsqueeze(-2), True) for x in ts)


META = convention("meta", _call, _reads, _reference)
