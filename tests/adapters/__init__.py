"""Any rotary-embedding implementation behind one interface: the suite's, TransformerEngine's (TE).

The suite calls its target with TE's signature
    fn(t, freqs, tensor_format=..., start_positions=..., interleaved=..., cu_seqlens=..., cp_size=..., cp_rank=...)
with angles `freqs` [s2, 1, 1, d2] (docs/contract.md). An adapter maps such a call onto another convention
(cos/sin tables, position ids, in-place writes, other layouts) and declares what that convention can express
(`Capabilities`); a call outside them is not a verdict: the example is rejected (Hypothesis) or the test skipped,
with the reason.

`--rope-impl` takes
    te | flash | liger | hf | vllm | rope       a named implementation (the library's own function)
    liger-mrope | hf-mrope | vllm-mrope | rope-mrope
                                                a named multimodal RoPE (mRoPE, Qwen2-VL) implementation
    module:callable                             a callable in TE's convention (as always)
    CONVENTION:module:callable                  a callable in one of the conventions above, e.g.
                                                hf:mypkg.rope:apply_rotary_pos_emb
One file per convention (te.py, flash.py, liger.py, hf.py, vllm.py; hf_mrope.py, vllm_mrope.py and mrope.py for
the mRoPE conventions `hf-mrope`, `vllm-mrope` and `mrope`) holds its conversion, capabilities, the named
implementation's import path and how to install it. A named implementation that is not installed raises
`Unavailable` (one line, with the install command); conftest.py turns it into a skipped run.

Multimodal RoPE: a target may also have a canonical mRoPE call, `rope.mrope.apply_multimodal_rotary_pos_emb`'s
signature (`Loaded.mrope`, with `MRoPECapabilities`), which tests/test_mrope.py checks. An mRoPE convention gives
both: `wrap_mrope` maps the canonical call onto the convention, and `wrap` maps TE's call onto the canonical one
with three equal position streams (plain RoPE, `te_via_mrope`), so that the whole TE suite runs against it too.
This package's own default target gets `rope.mrope.apply_multimodal_rotary_pos_emb` itself; TE-convention
targets and the plain conventions have none.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import NamedTuple, Optional

import torch

from tests.conformance.positions import token_positions  # noqa: F401 - the adapters' positions

FORMATS = ("sbhd", "bshd", "thd")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CONVENTIONS = ("te", "flash", "liger", "hf", "vllm")
NAMES = CONVENTIONS + ("rope",)
# mRoPE: `mrope` is the canonical convention (rope.mrope's signature); named implementations -> their convention
MROPE_CONVENTIONS = ("hf-mrope", "vllm-mrope", "mrope")
MROPE_NAMES = {"liger-mrope": "hf-mrope", "hf-mrope": "hf-mrope", "vllm-mrope": "vllm-mrope", "rope-mrope": "mrope"}
ALL_CONVENTIONS = CONVENTIONS + MROPE_CONVENTIONS
ALL_NAMES = NAMES + tuple(MROPE_NAMES)
DEFAULT = "rope:apply_rotary_pos_emb"
# The canonical mRoPE call's arguments, in order (rope.mrope.apply_multimodal_rotary_pos_emb)
MROPE_ARGS = ("t", "freqs", "positions", "mrope_section", "tensor_format", "interleaved", "mrope_interleaved")


class Unavailable(Exception):
    """A named implementation that is not installed here: the message is one line naming how to install it."""


class SpecError(ValueError):
    """A --rope-impl value that names nothing the registry knows."""


# ----------------------------------------------------------------------------------------------
# Capabilities
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Capabilities:
    """What a convention can express. A string field says how ("native", or what the adapter does); empty: no.

    dtypes: the dtypes checked. Conventions that take cos/sin in t's dtype round them before the math, so a 16-bit
    result is not within one rounding of the float64 reference (docs/contract.md section 4) by design: they are
    checked in float32 only, with `dtypes_why` as the reason.
    elementwise_freqs: False where the convention takes cos/sin of half width (one angle per pair), so only angles
    whose pair halves are equal (RotaryPositionEmbedding's, the strategies' "rotation" kind) are expressible.
    in_place: the convention writes its inputs; the adapter passes copies ("input not modified" still checks the
    caller's t, freqs and upstream gradient, which the backward must not write either).
    """

    formats: tuple = FORMATS
    interleaved: bool = True
    partial: str = "native"
    start_positions: str = "native"
    context_parallel: str = "native"
    dtypes: tuple = DTYPES
    dtypes_why: str = ""
    backward: str = "native"
    in_place: bool = False
    elementwise_freqs: bool = True
    bad_input: str = "native"
    notes: str = ""

    @property
    def full(self) -> bool:
        """Everything TE's convention expresses (the fast path: nothing to check per call)."""
        return all(getattr(self, f.name) == f.default for f in fields(self) if f.name not in ("notes", "backward"))

    def lacks(self, t, freqs, kw: dict) -> Optional[str]:
        """Why this call is outside the capabilities, or None. Malformed calls (bad-input rules) pass through."""
        if self.full:
            return None
        try:
            fmt = kw.get("tensor_format", "sbhd")
            if fmt not in self.formats:
                return f"no {fmt} format"
            interleaved = bool(kw.get("interleaved", False))
            if interleaved and not self.interleaved:
                return "no interleaved (GPT-J) pairs"
            if kw.get("start_positions") is not None and not self.start_positions:
                return "no start_positions (offsets)"
            if kw.get("cp_size", 1) != 1 and not self.context_parallel:
                return "no context parallelism"
            if t.dtype not in self.dtypes:
                return f"{str(t.dtype).replace('torch.', '')} not checked: {self.dtypes_why}"
            if freqs.shape[-1] < t.shape[-1] and not self.partial:
                return "no partial rotary (d2 < d)"
            if not self.elementwise_freqs and not equal_halves(freqs, interleaved):
                return "angles must be equal within each pair (cos/sin of half width)"
        except Exception:  # noqa: BLE001 - a malformed call: the implementation's own answer is what counts
            return None
        return None

    def missing_for(self, prop: str) -> Optional[str]:
        """Why a whole property test does not apply to this convention, or None (see NEEDS)."""
        for prefix, need in NEEDS.items():
            if prop == prefix or prop.startswith(prefix + ":") or prop.startswith(prefix + "["):
                return need(self)
        return None

    def table(self) -> dict:
        """Human-readable cells for docs and reports."""
        def yes(v):
            return v if isinstance(v, str) and v else ("yes" if v is True else "no")

        return {
            "formats": ", ".join(self.formats),
            "interleaved": yes(self.interleaved),
            "partial rotary": yes(self.partial),
            "start positions": yes(self.start_positions),
            "context parallel": yes(self.context_parallel),
            "dtypes": ", ".join(str(d).replace("torch.", "") for d in self.dtypes),
            "backward": self.backward,
            "in place": "yes (adapter passes copies)" if self.in_place else "no",
            "angles": "any (elementwise)" if self.elementwise_freqs else "equal pair halves only",
            "bad-input errors": yes(self.bad_input),
        }


def _need(flag: str, reason: str):
    return lambda caps: None if getattr(caps, flag) else reason


# Property tests (names as tests/adapters/report.py derives them) that need a capability as a whole.
NEEDS: dict[str, Callable] = {
    "pass_through_bitwise": _need("partial", "no partial rotary"),
    "formats_agree": lambda c: None if set(c.formats) == set(FORMATS) else
    f"compares sbhd, bshd and thd; has {', '.join(c.formats)}",
    "cp_shards_reassemble": _need("context_parallel", "no context parallelism"),
    "relative_position": _need("start_positions", "no start_positions (offsets)"),
    "interleaved_is_permuted_half_split": _need("interleaved", "no interleaved (GPT-J) pairs"),
    "bad_input": lambda c: None if c.bad_input else "no argument checks of TE's kind (ValueError/TypeError)",
    # the distributed test runs fixed cases with every feature and random angles in all three dtypes
    "context_parallel_matches_unsharded": lambda c: None if c.full else
    "its fixed cases use every feature of TE's convention",
}


def equal_halves(freqs: torch.Tensor, interleaved: bool) -> bool:
    """Whether every pair (i, pi(i)) has one angle: cat(theta, theta), or theta repeated pairwise."""
    if interleaved:
        return bool(torch.equal(freqs[..., 0::2], freqs[..., 1::2]))
    h = freqs.shape[-1] // 2
    return bool(torch.equal(freqs[..., :h], freqs[..., h:]))


@dataclass(frozen=True)
class MRoPECapabilities:
    """What a convention's multimodal RoPE can express, for the canonical call
    fn(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False, mrope_interleaved=False).

    Fields as in Capabilities; interleaved: GPT-J pairs (2i, 2i + 1); mrope_interleaved: Qwen3-VL's layout of
    the sections (pair k reads stream k % 3 below 3 * mrope_section[k % 3]); backward: "" where there is none
    (tests/test_mrope.py then checks the forward only).
    """

    formats: tuple = FORMATS
    interleaved: bool = True
    mrope_interleaved: bool = True
    partial: str = "native"
    dtypes: tuple = DTYPES
    dtypes_why: str = ""
    backward: str = "native"
    in_place: bool = False
    elementwise_freqs: bool = True
    bad_input: str = "native"
    notes: str = ""

    @property
    def full(self) -> bool:
        return all(getattr(self, f.name) == f.default for f in fields(self) if f.name not in ("notes", "backward"))

    def lacks(self, t, freqs, positions, kw: dict) -> Optional[str]:
        """Why this canonical call is outside the capabilities, or None. `kw`: the call's other arguments by
        name (MROPE_ARGS). Malformed calls pass through, as in Capabilities.lacks."""
        if self.full:
            return None
        try:
            fmt = kw.get("tensor_format", "thd")
            if fmt not in self.formats:
                return f"no {fmt} format"
            interleaved = bool(kw.get("interleaved", False))
            if interleaved and not self.interleaved:
                return "no interleaved (GPT-J) pairs"
            if kw.get("mrope_interleaved") and not self.mrope_interleaved:
                return "no interleaved sections (Qwen3-VL's mrope_interleaved)"
            if t.dtype not in self.dtypes:
                return f"{str(t.dtype).replace('torch.', '')} not checked: {self.dtypes_why}"
            if table_width(freqs) < t.shape[-1] and not self.partial:
                return "no partial rotary (d2 < d)"
            if not self.elementwise_freqs and not all(equal_halves(x, interleaved) for x in freq_tables(freqs)):
                return "angles must be equal within each pair (cos/sin of half width)"
        except Exception:  # noqa: BLE001 - a malformed call: the implementation's own answer is what counts
            return None
        return None

    def table(self) -> dict:
        def yes(v):
            return v if isinstance(v, str) and v else ("yes" if v is True else "no")

        return {
            "formats": ", ".join(self.formats),
            "interleaved pairs": yes(self.interleaved),
            "interleaved sections": yes(self.mrope_interleaved),
            "partial rotary": yes(self.partial),
            "dtypes": ", ".join(str(d).replace("torch.", "") for d in self.dtypes),
            "backward": self.backward or "none",
            "in place": "yes (adapter passes copies)" if self.in_place else "no",
            "angles": "any (elementwise)" if self.elementwise_freqs else "equal pair halves only",
            "bad-input errors": yes(self.bad_input),
        }


# ----------------------------------------------------------------------------------------------
# Multimodal RoPE: helpers of the mRoPE conventions
# ----------------------------------------------------------------------------------------------

def even_sections(pairs: int) -> list:
    """A fixed split of `pairs` rotary pairs into three sections (temporal gets the remainder): [1, 0, 0] for one
    pair, [1, 1, 1] for three, [22, 21, 21] for 64. With three equal streams any split gives plain RoPE; this one
    exercises all three sections wherever there are pairs enough."""
    third = pairs // 3
    return [pairs - 2 * third, third, third]


def table_width(freqs) -> int:
    """d2 of `freqs` [s2, 1, 1, d2] or of a rope.RoPECache (its tables [s2, d2])."""
    return (freqs.cos if hasattr(freqs, "as_freqs") else freqs).shape[-1]


def freq_tables(freqs) -> tuple:
    """What has to be equal within pairs: the angles, or a RoPECache's cos and sin."""
    return (freqs.cos, freqs.sin) if hasattr(freqs, "as_freqs") else (freqs,)


def cos_sin(freqs) -> tuple:
    """float32 cos and sin [s2, d2], one column per channel: of the angles `freqs` [s2, 1, 1, d2], or a
    rope.RoPECache's tables (read, as the canonical call does)."""
    if hasattr(freqs, "as_freqs"):
        return freqs.cos.float(), freqs.sin.float()
    theta = angles(freqs)
    return theta.cos(), theta.sin()


def three_streams(positions, lead) -> torch.Tensor:
    """The canonical call's positions, [3, *lead] or one stream [*lead], as int64 [3, *lead] (contiguous, as a
    model's position ids are)."""
    if positions.dim() == len(lead):
        positions = positions.expand(3, *positions.shape)
    return positions.long().contiguous()


def accepts(fn, name: str) -> bool:
    """Whether `fn` takes the keyword `name` (True when its signature cannot be read: the call answers)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def te_via_mrope(mrope_fn: Callable) -> Callable:
    """TE's call -> the canonical mRoPE call with three equal position streams (every token's position as
    `token_positions` gives it, docs/contract.md section 3) and the fixed sections `even_sections`: plain RoPE,
    so TE's whole suite checks an mRoPE implementation through it."""

    @functools.wraps(mrope_fn)
    def mrope_as_te(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, cu_seqlens=None,
                    cp_size=1, cp_rank=0, **_):
        pos = token_positions(t.shape, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank, t.device)
        if tensor_format == "sbhd":
            pos = pos.t()  # the canonical call's sbhd positions are [s, b]
        pos = pos.expand(3, *pos.shape).contiguous()
        return mrope_fn(t, freqs, pos, even_sections(table_width(freqs) // 2), tensor_format, interleaved)

    return mrope_as_te


# ----------------------------------------------------------------------------------------------
# Positions (docs/contract.md section 3), for conventions that take cos/sin per token
# ----------------------------------------------------------------------------------------------

def angles(freqs: torch.Tensor) -> torch.Tensor:
    """[s2, d2] float32 angles out of TE's [s2, 1, 1, d2]."""
    return freqs[:, 0, 0, :].float()


def half_angles(freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[s2, d2/2]: one angle per pair (the first of each pair), for half-width cos/sin tables."""
    f = angles(freqs)
    return f[:, 0::2] if interleaved else f[:, : f.shape[-1] // 2]


def local_lengths(cu_seqlens: torch.Tensor, cp_size: int = 1) -> list:
    cu = [int(v) // cp_size for v in cu_seqlens.detach().cpu().tolist()]
    return [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]


# ----------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------

class Parsed(NamedTuple):
    convention: str  # one of ALL_CONVENTIONS
    callable_spec: Optional[str]  # "module:attr"; None for a named implementation
    named: Optional[str]  # one of ALL_NAMES, or None


def parse(spec: str) -> Parsed:
    """--rope-impl value -> (convention, module:callable or None, name or None); no import yet."""
    spec = (spec or "").strip()
    if spec in NAMES:
        return Parsed("te" if spec == "rope" else spec, None, spec)
    if spec in MROPE_NAMES:
        return Parsed(MROPE_NAMES[spec], None, spec)
    parts = spec.split(":")
    if len(parts) == 2 and all(parts):
        return Parsed("te", spec, None)
    if len(parts) == 3 and all(parts):
        if parts[0] not in ALL_CONVENTIONS:
            raise SpecError(f"unknown convention {parts[0]!r} in {spec!r}; conventions: "
                            f"{', '.join(ALL_CONVENTIONS)}")
        return Parsed(parts[0], f"{parts[1]}:{parts[2]}", None)
    raise SpecError(f"expected one of {', '.join(ALL_NAMES)}, 'module:callable' (TE's convention) or "
                    f"'CONVENTION:module:callable', got {spec!r}")


def import_callable(spec: str) -> Callable:
    """`package.module:attr.attr` -> the object; ImportError/AttributeError name what is missing."""
    module_name, _, attr = spec.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise TypeError(f"{spec!r} is not callable")
    return obj


def convention_module(name: str):
    """The module of a convention (hf-mrope: hf_mrope.py)."""
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}")


class Loaded(NamedTuple):
    fn: Callable  # TE's signature
    caps: Capabilities
    convention: str
    raw: Callable  # the implementation itself
    mrope: Optional[Callable] = None  # the canonical mRoPE call (MROPE_ARGS), None where there is none
    mrope_caps: Optional[MRoPECapabilities] = None


def load(spec: str) -> Loaded:
    """Resolve and wrap. Raises Unavailable (named, not installed), SpecError, or the import's own error."""
    parsed = parse(spec)
    conv = convention_module(parsed.convention)
    if parsed.named is not None:
        raw = conv.load_named(parsed.named)
    else:
        raw = import_callable(parsed.callable_spec)
    if parsed.convention == "te" and parsed.named is None:
        fn, caps = raw, conv.CAPABILITIES  # TE's convention: the callable itself, as always
    else:
        fn, caps = conv.wrap(raw, named=parsed.named)
    if parsed.convention == "te":
        return Loaded(fn, caps, "te", raw, *_ours_mrope(raw))
    if hasattr(conv, "wrap_mrope"):
        return Loaded(fn, caps, parsed.convention, raw, *conv.wrap_mrope(raw, named=parsed.named))
    return Loaded(fn, caps, parsed.convention, raw)


def _ours_mrope(raw) -> tuple:
    """(rope.mrope.apply_multimodal_rotary_pos_emb, full capabilities) when `raw` is this package's
    apply_rotary_pos_emb (then `rope` is imported already), else (None, None)."""
    ours = sys.modules.get("rope")
    if ours is None or raw is not getattr(ours, "apply_rotary_pos_emb", None):
        return None, None
    from rope.mrope import apply_multimodal_rotary_pos_emb

    return apply_multimodal_rotary_pos_emb, MRoPECapabilities()


def first_importable(candidates, install: str, what: str) -> Callable:
    """The first of `module:attr` candidates that imports; Unavailable (one line) when none does."""
    errors = []
    for cand in candidates:
        try:
            return import_callable(cand)
        except Exception as e:  # noqa: BLE001 - not installed, or an install that fails to import
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120])
    raise Unavailable(f"{what} is not installed here ({errors[0] if errors else 'no candidate'}); "
                      f"install it with: {install}")
