"""Adapters: every implementation behind one interface, each fed the case in its own layout.

`bind(inputs, t, g)` takes the case's canonical tensors (t and upstream gradient g, contiguous in
the case's format) and returns a `Bound`: the tensors to differentiate (`xs`, in the
implementation's layout), a call `fn(*xs) -> [outputs]`, the upstream gradients in the outputs'
layout, and the maps that bring outputs and input gradients back to the canonical layout for the
float64 check. Conversions (views, splits, cos/sin tables) happen in `bind`, outside any timed
region, as they would once per step in a model.

Peers are imported lazily; one that is not installed is reported as skipped with the reason.

Each implementation runs the kinds of case it is meant for (`kinds`); the others get no row.

- ours       `rope.apply_rotary_pos_emb`, any format, float32 angles [s, 1, 1, d2].
- ours_graph the same, with sin/cos evaluated in the kernel: what a user's CUDA graph capture
             runs (`ours` reads a cos/sin table cached per `freqs`, which a capture may not).
- ours_qk    `rope.apply_rotary_pos_emb_qk` on a qk case: q and k in one call (one launch each way).
- ours_2x    the same qk case as two calls of `rope.apply_rotary_pos_emb`, q then k.
- ours_inplace  `rope.apply_rotary_pos_emb(..., inplace=True)`, forward only under no_grad. `bind`
             copies the set once into a working buffer, and every timed call rotates that buffer
             again: its values change from call to call, the work does not, and no copy is timed.
- reference  the pure-PyTorch `rope.reference`, eager (about 10 kernels forward, 7 backward); on a
             qk case two calls, q then k.
- compile    the same reference under `torch.compile`, default mode and default dynamic-shape
             policy (after the first shape, dynamo compiles shape-generic kernels, as a model would
             get); compilation and warm-up happen before timing. Not for thd: the reference reads
             cu_seqlens on the host and loops over sequences in Python. On a qk case two calls.
- ours_compiled  `rope.apply_rotary_pos_emb` under `torch.compile(fullgraph=True)`: the kernel as
             the custom op `rope::rotate`, as a compiled model calls it. Same GPU work as `ours`;
             its host cost per call is what a compiled model's eager-mode fallbacks would not see.
             On a qk case two calls.
- te         TransformerEngine's fused kernel: its API is ours, so it gets the same arguments.
- flash      flash-attention's Triton `apply_rotary_emb`: x as (b, s, h, d) — for sbhd the
             (0, 1)-transposed view of the same memory, no copy (it takes strides); thd as
             (total, h, d) with int32 cu_seqlens and max_seqlen; decode through seqlen_offsets.
             cos/sin [s, d2/2] in x's dtype (it requires that), built from the same angles.
- liger      Liger-Kernel's `liger_rotary_pos_emb`: q and k [b, h, s, d] as (1, 2)-transposed
             views of contiguous [b, s, h, d] tensors, which is how they come out of a
             projection; it rotates both in one launch, so the case's heads are split in two
             halves as q and k (same bytes). sbhd cases run as bshd of the same sizes. cos/sin
             [1, s, d] (per batch [b, s, d] for decode) in x's dtype, as Hugging Face models pass
             them. It writes in place. Half-split with rot_dim == d only.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import reference
from .inputs import CaseInputs


@dataclass
class Bound:
    xs: list
    fn: Callable
    gs: list | None
    out_canon: Callable
    grad_canon: Callable
    graph_safe: bool = True


def _first(v):
    return v[0]


class Impl:
    name = ""
    title = ""
    layout = ""
    kinds = frozenset({"t"})  # Case.kind values this implementation runs
    backward = True  # False: forward only (checked and timed under no_grad)
    inplace = False  # the outputs are the inputs' memory (the check verifies it)
    launched_here = False  # rope's own launcher allocates the outputs, so they can start as NaN

    def note_for(self, case) -> str:
        """What the table's note column must say about this implementation on `case`."""
        return ""

    def missing(self) -> str | None:
        """Why this implementation cannot run at all here (not installed), or None."""
        return None

    def unsupported(self, case) -> str | None:
        return None

    def bind(self, inputs: CaseInputs, t: torch.Tensor, g: torch.Tensor | None = None) -> Bound:
        raise NotImplementedError

    def timing_context(self):
        """Context around this implementation's timed calls."""
        return contextlib.nullcontext()

    def poison(self):
        """Context in which this implementation's outputs start as NaN (if it allows that)."""
        if self.launched_here:
            from .. import _launch

            return _launch.nan_outputs()
        return contextlib.nullcontext()


class _TEStyle(Impl):
    """Implementations with TransformerEngine's signature: they take the case as it is."""

    graph_safe_thd = True

    def _call(self, inputs: CaseInputs):
        raise NotImplementedError

    def bind(self, inputs, t, g=None):
        call = self._call(inputs)
        safe = self.graph_safe_thd or inputs.case.fmt != "thd"
        if inputs.case.hk:  # q and k: two calls with the same arguments
            return Bound(list(t), lambda q, k: [call(q), call(k)], None if g is None else list(g), list, list, safe)
        return Bound([t], lambda x: [call(x)], None if g is None else [g], _first, _first, safe)


class _OursEager:
    """rope's eager path reads the cos/sin table cached per `freqs` (built by the warm-up). A user's
    CUDA graph capture would evaluate sin/cos in the kernel instead (`ours_graph`); here the
    capture that times the calls may read the prebuilt table, so replay times the eager kernel."""

    def timing_context(self):
        from .. import _table

        return _table.prebuilt_in_capture()


class Ours(_OursEager, _TEStyle):
    name, title = "ours", "rope (Triton)"
    launched_here = True
    layout = "the case as given; float32 angles [s, 1, 1, d2] (cos/sin table cached per freqs tensor)"

    def _call(self, inputs):
        from .. import apply_rotary_pos_emb

        c = inputs.case
        freqs, start, cu = inputs.freqs, inputs.start_positions, inputs.cu_seqlens
        return lambda x: apply_rotary_pos_emb(x, freqs, c.fmt, start, c.interleaved, cu_seqlens=cu)


class OursGraph(Ours):
    name, title = "ours_graph", "rope (Triton), as captured in a CUDA graph"
    layout = "the case as given; sin/cos evaluated in the kernel, as under a user's graph capture"

    def timing_context(self):
        return contextlib.nullcontext()

    def _call(self, inputs):
        from .. import _table

        call = super()._call(inputs)

        def fn(x):
            with _table.evaluated():
                return call(x)

        return fn


class OursTwice(Ours):
    name, title = "ours_2x", "rope (Triton), two calls"
    layout = "q and k as given, one apply_rotary_pos_emb call each"
    kinds = frozenset({"qk"})


class OursQK(_OursEager, Impl):
    name, title = "ours_qk", "rope (Triton), q and k in one call"
    launched_here = True
    layout = "q and k as given, one apply_rotary_pos_emb_qk call"
    kinds = frozenset({"qk"})

    def bind(self, inputs, t, g=None):
        from .. import apply_rotary_pos_emb_qk

        c = inputs.case
        freqs, start, cu = inputs.freqs, inputs.start_positions, inputs.cu_seqlens

        def fn(q, k):
            return list(apply_rotary_pos_emb_qk(q, k, freqs, c.fmt, start, c.interleaved, cu_seqlens=cu))

        return Bound(list(t), fn, None if g is None else list(g), list, list)


class OursInplace(_OursEager, Impl):
    name, title = "ours_inplace", "rope (Triton), in place"
    layout = "the case as given, rotated in its own memory (a working copy of the input set)"
    kinds = frozenset({"inplace"})
    backward = False
    inplace = True

    def note_for(self, case):
        return "in place, forward only: repeated rotations of one buffer (values change, work does not)"

    def bind(self, inputs, t, g=None):
        from .. import apply_rotary_pos_emb

        c = inputs.case
        freqs, start, cu = inputs.freqs, inputs.start_positions, inputs.cu_seqlens
        # Copied once here, outside any timed region: the shared input set stays as it is, and the
        # timed calls rotate this buffer again and again.
        work = t.detach().clone()

        def fn(x):
            return [apply_rotary_pos_emb(x, freqs, c.fmt, start, c.interleaved, cu_seqlens=cu, inplace=True)]

        return Bound([work], fn, None, _first, _first)


class Reference(_TEStyle):
    name, title = "reference", "PyTorch reference, eager"
    layout = "the case as given; q and k: two calls"
    kinds = frozenset({"t", "qk"})
    graph_safe_thd = False  # reads cu_seqlens on the host: cannot be captured

    def note_for(self, case):
        return "two calls, q then k" if case.hk else ""

    def _call(self, inputs):
        c = inputs.case
        freqs, start, cu = inputs.freqs, inputs.start_positions, inputs.cu_seqlens
        fn = reference.apply_rotary_pos_emb
        return lambda x: fn(x, freqs, c.fmt, start, c.interleaved, False, cu)


class Compiled(_TEStyle):
    name, title = "compile", "PyTorch reference, torch.compile"
    layout = "the case as given; compiled once per shape signature, warm-up excluded; q and k: two calls"
    kinds = frozenset({"t", "qk"})

    def note_for(self, case):
        return "two calls, q then k" if case.hk else ""

    def __init__(self, backend="inductor"):
        self.backend = backend
        self._fn = None

    def unsupported(self, case):
        if case.fmt == "thd":
            return "the reference's thd path reads cu_seqlens on the host and loops over sequences"
        return None

    def _compiled(self):
        if self._fn is None:
            cfg = torch._dynamo.config
            # Every case is a new shape signature: without headroom dynamo would stop compiling
            # after a few and silently run the reference eagerly.
            for knob, value in (("recompile_limit", 256), ("cache_size_limit", 256),
                                ("accumulated_recompile_limit", 4096), ("accumulated_cache_size_limit", 4096)):
                if hasattr(cfg, knob):
                    setattr(cfg, knob, max(getattr(cfg, knob), value))
            # Timing replays the backward of one recorded forward (retain_graph=True), which
            # AOTAutograd's donated buffers forbid. They only let the backward reuse saved
            # activations' memory; the kernels are the same without them.
            fcfg = getattr(torch, "_functorch", None) and torch._functorch.config
            if fcfg is not None and hasattr(fcfg, "donated_buffer"):
                fcfg.donated_buffer = False
            self._fn = torch.compile(self._target(), backend=self.backend, fullgraph=self.fullgraph)
        return self._fn

    fullgraph = False
    fused = False  # the reference's own `fused` argument: False, its PyTorch path

    def _target(self):
        return reference.apply_rotary_pos_emb

    def _call(self, inputs):
        c = inputs.case
        freqs, start, cu = inputs.freqs, inputs.start_positions, inputs.cu_seqlens
        fn = self._compiled()
        return lambda x: fn(x, freqs, c.fmt, start, c.interleaved, self.fused, cu)


class OursCompiled(Compiled):
    name, title = "ours_compiled", "rope under torch.compile (custom op)"
    launched_here = True
    layout = "the case as given; torch.compile(fullgraph=True) of rope.apply_rotary_pos_emb, warm-up excluded"
    fullgraph = True
    fused = True  # the Triton kernel, which under compile is the custom op

    def unsupported(self, case):
        return None  # the custom op takes thd like any other format: no host reads while traced

    def _target(self):
        from .. import apply_rotary_pos_emb

        return apply_rotary_pos_emb


def _installed(top: str) -> bool:
    if top in sys.modules:
        return True
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def _import_attr(candidates):
    """The first importable `module:attr` of `candidates`, or (None, reason)."""
    top = candidates[0].split(".")[0].split(":")[0]
    if not _installed(top):
        return None, f"not installed ({top})"
    errors = []
    for spec in candidates:
        mod, attr = spec.split(":")
        try:
            return getattr(importlib.import_module(mod), attr), None
        except Exception as exc:  # ImportError, or a broken install raising anything else
            errors.append(f"{mod}.{attr}: {type(exc).__name__}: {str(exc)[:80]}")
    return None, "cannot import " + "; ".join(errors)


class _Optional:
    """A peer imported lazily from the first of `_CANDIDATES` ("module:attr") that imports."""

    _CANDIDATES: tuple = ()
    _fn = _why = None

    def _load(self):
        if self._fn is None and self._why is None:
            self._fn, self._why = _import_attr(self._CANDIDATES)
        return self._fn

    def missing(self):
        self._load()
        return self._why


class TransformerEngine(_Optional, _TEStyle):
    name, title = "te", "TransformerEngine fused"
    layout = "the case as given (same API); int32 cu_seqlens"
    _CANDIDATES = (
        "transformer_engine.pytorch.attention.rope:apply_rotary_pos_emb",
        "transformer_engine.pytorch.attention:apply_rotary_pos_emb",
        "transformer_engine.pytorch.dot_product_attention.rope:apply_rotary_pos_emb",
    )

    def _params(self):
        try:
            return set(inspect.signature(self._load()).parameters)
        except (TypeError, ValueError):
            return set()

    def unsupported(self, case):
        params = self._params()
        if case.interleaved and "interleaved" not in params:
            return "this TransformerEngine version has no interleaved mode"
        if case.start_max and "start_positions" not in params:
            return "this TransformerEngine version has no start_positions"
        return None

    def _call(self, inputs):
        c = inputs.case
        fn, kw = self._load(), dict(tensor_format=c.fmt, fused=True)
        if c.interleaved:
            kw["interleaved"] = True
        if inputs.cu_seqlens is not None:
            kw["cu_seqlens"] = inputs.cu_seqlens
        if inputs.start_positions is not None:
            kw["start_positions"] = inputs.start_positions
        freqs = inputs.freqs
        return lambda x: fn(x, freqs, **kw)


def _half_angles(inputs: CaseInputs):
    """theta [s, d2/2] from duplicated angles: cat(theta, theta) or pairs (interleaved)."""
    f = inputs.freqs[:, 0, 0, :]
    return f[:, 0::2] if inputs.case.interleaved else f[:, : inputs.case.d2 // 2]


class FlashAttention(_Optional, Impl):
    name, title = "flash", "flash-attention Triton rotary"
    layout = ("x as (b, s, h, d): sbhd passed as its (0, 1)-transposed view (no copy), thd as (total, h, d) "
              "with cu_seqlens/max_seqlen; cos/sin [s, d2/2] in x's dtype")

    _CANDIDATES = ("flash_attn.layers.rotary:apply_rotary_emb",)

    def unsupported(self, case):
        if case.d > 256:
            return "flash-attn's rotary supports head_dim <= 256"
        return None

    def bind(self, inputs, t, g=None):
        c, fn = inputs.case, self._load()
        theta = _half_angles(inputs)
        cos, sin = torch.cos(theta).to(t.dtype).contiguous(), torch.sin(theta).to(t.dtype).contiguous()
        kw = dict(interleaved=c.interleaved, inplace=False)
        if inputs.start_positions is not None:
            kw["seqlen_offsets"] = inputs.start_positions
        if c.fmt == "thd":
            kw.update(cu_seqlens=inputs.cu_seqlens, max_seqlen=inputs.max_seqlen)
        sbhd = c.fmt == "sbhd"

        def native(v):
            return v.transpose(0, 1) if sbhd else v

        return Bound(
            [native(t)],
            lambda x: [fn(x, cos, sin, **kw)],
            None if g is None else [native(g)],
            lambda outs: native(outs[0]),
            lambda grads: native(grads[0]),
        )


class Liger(_Optional, Impl):
    name, title = "liger", "Liger-Kernel Triton rope"
    layout = ("q, k = the heads split in two halves, each contiguous [b, s, h/2, d] viewed as [b, h/2, s, d]; "
              "sbhd runs as bshd; cos/sin [1, s, d] in x's dtype; in place")

    _CANDIDATES = ("liger_kernel.transformers.rope:liger_rotary_pos_emb",)

    def unsupported(self, case):
        if case.fmt == "thd":
            return "Liger takes padded [b, h, s, d] only (no packed sequences)"
        if case.interleaved:
            return "Liger has no interleaved mode"
        if case.d2 != case.d:
            return "Liger rotates all of head_dim (no partial rotary)"
        if case.h < 2 or case.h % 2:
            return "needs an even head count to split into q and k"
        return None

    def bind(self, inputs, t, g=None):
        c, fn = inputs.case, self._load()
        hq = c.h // 2
        sbhd = c.fmt == "sbhd"
        if inputs.start_positions is not None:
            pos = inputs.start_positions.long()[:, None] + torch.arange(c.s, device=t.device)[None, :]
            angles = inputs.freqs[:, 0, 0, :][pos]  # [b, s, d]
        else:
            angles = inputs.freqs[: c.s, 0, 0, :][None]  # [1, s, d]
        cos, sin = torch.cos(angles).to(t.dtype).contiguous(), torch.sin(angles).to(t.dtype).contiguous()

        def split(v, requires_grad=False):
            v = v.detach()
            v = v.transpose(0, 1) if sbhd else v  # [b, s, h, d]
            # Copies (never views of the caller's tensor): Liger writes into them.
            q = v[:, :, :hq].clone(memory_format=torch.contiguous_format).requires_grad_(requires_grad)
            k = v[:, :, hq:].clone(memory_format=torch.contiguous_format).requires_grad_(requires_grad)
            return [q, k]

        def canon(parts):
            full = torch.cat(parts, dim=2)  # [b, s, h, d]
            return full.transpose(0, 1) if sbhd else full

        return Bound(
            split(t, t.requires_grad),
            lambda q, k: list(fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)),
            None if g is None else [p.transpose(1, 2) for p in split(g)],
            lambda outs: canon([o.transpose(1, 2) for o in outs]),
            canon,
        )


IMPL_NAMES = ("ours", "ours_graph", "ours_qk", "ours_2x", "ours_inplace", "ours_compiled", "reference", "compile",
              "te", "flash", "liger")
# Ours: a failed check or an error in one of these makes the CLI exit non-zero.
OURS = ("ours", "ours_graph", "ours_qk", "ours_2x", "ours_inplace", "ours_compiled")


def make_impls(names=None, compile_backend="inductor") -> list:
    names = list(names or IMPL_NAMES)
    unknown = [n for n in names if n not in IMPL_NAMES]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; known: {', '.join(IMPL_NAMES)}")
    makers = {
        "ours": Ours, "ours_graph": OursGraph, "ours_qk": OursQK, "ours_2x": OursTwice, "ours_inplace": OursInplace,
        "ours_compiled": lambda: OursCompiled(compile_backend),
        "reference": Reference, "compile": lambda: Compiled(compile_backend),
        "te": TransformerEngine, "flash": FlashAttention, "liger": Liger,
    }
    return [makers[n]() for n in names]
