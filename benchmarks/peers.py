"""Adapters: every implementation behind one interface, each fed the case in its own layout.

`bind(inputs, t, g)` takes an input set t and upstream gradient g in the case's layout (tensors, or
(q, k)) and returns a `Bound`: the tensors to differentiate (`xs`, in the implementation's layout),
`fn(*xs) -> [outputs]`, the gradients in the outputs' layout, and maps from outputs and input
gradients back to the case's layout for the float64 check. Conversions happen in `bind`, untimed.

ours: `rope.apply_rotary_pos_emb`; on q/k cases ours_qk (one `apply_rotary_pos_emb_qk` call) and
ours_2x (two calls); ours_inplace: `inplace=True` on a copy made once, rotated again by every call.
reference: `rope.reference`, eager; compile: the same under `torch.compile` (not thd: it reads
cu_seqlens on the host). te: TransformerEngine's fused kernel, same API. flash: flash-attention's
Triton `apply_rotary_emb`, x as (b, s, h, d) (sbhd: the transposed view of the same memory) or (total,
h, d) with cu_seqlens, cos/sin [s, d2/2] in x's dtype. liger: `liger_rotary_pos_emb` in place on the
heads split in halves as q and k (same bytes), each contiguous [b, s, h/2, d] seen as [b, h/2, s, d]
as a projection gives them (sbhd runs as bshd), cos/sin [1 or b, s, d] in x's dtype.
Peers are the named implementations of tests/conformance/registry.py (the one list of their import paths), imported
lazily; one that is not installed is reported and not run.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from cases import CaseInputs, parts

import rope
from rope import reference
from tests.conformance.registry import NAMED


@dataclass
class Bound:
    xs: list
    fn: Callable
    gs: list | None
    out_canon: Callable = list  # outputs -> [tensors in the canonical layout]
    grad_canon: Callable = list


class Impl:
    name = ""
    kinds = frozenset({"t"})  # the Case.kind values it runs
    backward = True  # False: forward only, checked and timed under no_grad
    inplace = False  # its outputs are its inputs' memory (the check verifies it)
    ours = False  # rope's launcher allocates the outputs: the check starts them as NaN
    registered: tuple = ()  # peers: (named implementation, convention) in tests/conformance/registry.py
    _fn = _why = None

    @property
    def candidates(self) -> tuple:
        """The registry's "module:attr" paths of the peer, imported lazily: the first that imports."""
        if not self.registered:
            return ()
        name, convention = self.registered
        return NAMED.get(name, {}).get(convention, ((), {}))[0]

    def load(self):
        """The peer's function, imported on first use; None (the reasons in `_why`) if no candidate imports."""
        for spec in self.candidates if self._fn is None and self._why is None else ():
            module, attr = spec.split(":")
            try:
                self._fn = getattr(importlib.import_module(module), attr)
                break
            except Exception as exc:  # not installed (ImportError), or a broken install raising anything
                self._why = (self._why + "; " if self._why else "cannot import ") + f"{module}.{attr}: {exc!r:.80}"
        return self._fn

    def missing(self) -> str | None:
        """Why it cannot run here at all (a peer that is not installed, or not in the registry), or None."""
        if self.registered and not self.candidates:
            return f"tests/conformance/registry.py has no {self.registered[1]} call of {self.registered[0]}"
        return self._why if self.candidates and self.load() is None else None

    def unsupported(self, case) -> str | None:
        return None

    def capturable(self, case) -> bool:
        """Whether its calls can be captured in a CUDA graph (they read no device values on the host)."""
        return True

    def call(self, inputs: CaseInputs) -> Callable:
        """TransformerEngine's signature: one call per tensor (q and k: two)."""
        raise NotImplementedError

    def bind(self, inputs, t, g=None) -> Bound:
        call = self.call(inputs)
        return Bound(parts(t), lambda *xs: [call(x) for x in xs], None if g is None else parts(g))


class Ours(Impl):
    name, ours = "ours", True

    def call(self, inputs):
        return lambda x: rope.apply_rotary_pos_emb(x, *inputs.args, cu_seqlens=inputs.cu_seqlens)


class OursTwice(Ours):
    name, kinds = "ours_2x", frozenset({"qk"})


class OursQK(Impl):
    name, kinds, ours = "ours_qk", frozenset({"qk"}), True

    def bind(self, inputs, t, g=None):
        def fn(q, k):
            return list(rope.apply_rotary_pos_emb_qk(q, k, *inputs.args, cu_seqlens=inputs.cu_seqlens))

        return Bound(list(t), fn, None if g is None else list(g))


class OursInplace(Impl):
    name, kinds, ours = "ours_inplace", frozenset({"inplace"}), True
    backward, inplace = False, True

    def bind(self, inputs, t, g=None):
        work = t.detach().clone()  # once, untimed: the shared set stays as it is

        def fn(x):
            return [rope.apply_rotary_pos_emb(x, *inputs.args, cu_seqlens=inputs.cu_seqlens, inplace=True)]

        return Bound([work], fn, None)


class OursCache(Ours):
    """`freqs` replaced by a `rope.RoPECache` of it: the table path, also inside a capture."""
    name = "ours_cache"

    def call(self, inputs):
        cache = rope.RoPECache.from_freqs(inputs.freqs)
        return lambda x: rope.apply_rotary_pos_emb(x, cache, *inputs.args[1:], cu_seqlens=inputs.cu_seqlens)


class Reference(Impl):
    name, kinds = "reference", frozenset({"t", "qk"})

    def capturable(self, case):
        return case.fmt != "thd"  # its thd path reads cu_seqlens on the host

    def call(self, inputs):
        fn = self.target()
        return lambda x: fn(x, *inputs.args, False, inputs.cu_seqlens)

    def target(self):
        return reference.apply_rotary_pos_emb


class Compiled(Reference):
    name, backend = "compile", "inductor"  # the CPU tests use "aot_eager" (no C++ toolchain needed)
    _compiled = None

    def unsupported(self, case):
        return "the reference's thd path reads cu_seqlens on the host" if case.fmt == "thd" else None

    def target(self):
        if self._compiled is None:
            # Every case is a new shape signature: without headroom dynamo would stop compiling after a few.
            for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 1024))
            # The backward is timed by replaying one recorded forward (retain_graph=True), which
            # AOTAutograd's donated buffers forbid; the kernels are the same without them.
            if hasattr(torch._functorch.config, "donated_buffer"):
                torch._functorch.config.donated_buffer = False
            self._compiled = torch.compile(reference.apply_rotary_pos_emb, backend=self.backend)
        return self._compiled


class TransformerEngine(Impl):
    name, registered = "te", ("te", "te")

    def unsupported(self, case):
        params = inspect.signature(self.load()).parameters
        if case.interleaved and "interleaved" not in params:
            return "this TransformerEngine version has no interleaved mode"
        if case.start_max and "start_positions" not in params:
            return "this TransformerEngine version has no start_positions"
        return None

    def call(self, inputs):
        fn = self.load()
        # Only what the case uses: older releases lack some of these parameters.
        kw = dict(interleaved=inputs.case.interleaved or None, cu_seqlens=inputs.cu_seqlens,
                  start_positions=inputs.start_positions)
        kw = {key: value for key, value in kw.items() if value is not None}
        return lambda x: fn(x, inputs.freqs, tensor_format=inputs.case.fmt, fused=True, **kw)


class FlashAttention(Impl):
    name, registered = "flash", ("flash", "flash")

    def unsupported(self, case):
        return "flash-attn's rotary supports head_dim <= 256" if case.d > 256 else None

    def bind(self, inputs, t, g=None):
        c, fn, f = inputs.case, self.load(), inputs.freqs[:, 0, 0, :]
        theta = f[:, 0::2] if c.interleaved else f[:, : c.d2 // 2]  # the angles once, not duplicated
        cos, sin = torch.cos(theta).to(t.dtype).contiguous(), torch.sin(theta).to(t.dtype).contiguous()
        kw = dict(interleaved=c.interleaved, inplace=False)
        if inputs.start_positions is not None:
            kw["seqlen_offsets"] = inputs.start_positions
        if c.fmt == "thd":
            kw.update(cu_seqlens=inputs.cu_seqlens, max_seqlen=c.seq_len)

        def native(v):  # (b, s, h, d), as a view of the same memory
            return v.transpose(0, 1) if c.fmt == "sbhd" else v

        return Bound([native(t)], lambda x: [fn(x, cos, sin, **kw)], None if g is None else [native(g)],
                     lambda outs: [native(outs[0])], lambda grads: [native(grads[0])])


class OursFlash(FlashAttention):
    """`rope.flash.apply_rotary_emb`, fed exactly as flash-attention is."""
    name, registered, ours = "ours_flash", (), True

    def unsupported(self, case):
        return None

    def load(self):
        return rope.flash.apply_rotary_emb


def hf_inputs(inputs, t, g):
    """q, k as transformers has them: [b, h, s, d] views of [b, s, h, d] memory (a projection, viewed and
    transposed), and cos/sin [1 or b, s, d] in the tensors' dtype, gathered at the case's positions."""
    c, f = inputs.case, inputs.freqs[:, 0, 0, :]
    if inputs.start_positions is not None:
        angles = f[inputs.start_positions.long()[:, None] + torch.arange(c.s, device=f.device)]  # [b, s, d]
    else:
        angles = f[None, : c.s]
    dtype = t[0].dtype
    cos, sin = torch.cos(angles).to(dtype).contiguous(), torch.sin(angles).to(dtype).contiguous()
    return cos, sin, [x.transpose(1, 2) for x in t], None if g is None else [x.transpose(1, 2) for x in g]


def _to_case(xs):
    return [x.transpose(1, 2) for x in xs]


class OursHF(Impl):
    name, kinds, ours = "ours_hf", frozenset({"hf"}), True

    def bind(self, inputs, t, g=None):
        cos, sin, xs, gs = hf_inputs(inputs, t, g)
        return Bound(xs, lambda q, k: list(rope.hf.apply_rotary_pos_emb(q, k, cos, sin)), gs, _to_case, _to_case)


class LigerHF(Impl):
    """Liger-Kernel's `liger_rotary_pos_emb` in its own layout; it writes q and k in place, so each call
    rotates copies made once (untimed), as in a model where q and k are fresh projections."""
    name, kinds, registered = "liger_hf", frozenset({"hf"}), ("liger", "liger")

    def bind(self, inputs, t, g=None):
        cos, sin, xs, gs = hf_inputs(inputs, t, g)
        xs = [x.detach().transpose(1, 2).clone().transpose(1, 2).requires_grad_(x.requires_grad) for x in xs]
        fn = self.load()
        return Bound(xs, lambda q, k: list(fn(q, k, cos, sin)), gs, _to_case, _to_case)


class Liger(Impl):
    name, registered = "liger", ("liger", "liger")

    def unsupported(self, case):
        if case.fmt == "thd":
            return "Liger takes padded [b, h, s, d] only (no packed sequences)"
        if case.interleaved or case.d2 != case.d:
            return "Liger has no interleaved mode and no partial rotary"
        return "needs an even head count to split into q and k" if case.h % 2 else None

    def bind(self, inputs, t, g=None):
        c, fn, hq, sbhd = inputs.case, self.load(), inputs.case.h // 2, inputs.case.fmt == "sbhd"
        f = inputs.freqs[:, 0, 0, :]
        if inputs.start_positions is not None:
            angles = f[inputs.start_positions.long()[:, None] + torch.arange(c.s, device=t.device)]  # [b, s, d]
        else:
            angles = f[None, : c.s]  # [1, s, d]
        cos, sin = torch.cos(angles).to(t.dtype).contiguous(), torch.sin(angles).to(t.dtype).contiguous()

        def split(v, requires_grad=False):  # copies, never views of the caller's tensor: Liger writes in place
            v = v.detach().transpose(0, 1) if sbhd else v.detach()  # [b, s, h, d]
            return [v[:, :, i].clone(memory_format=torch.contiguous_format).requires_grad_(requires_grad)
                    for i in (slice(None, hq), slice(hq, None))]

        def canon(halves):  # [b, s, h/2, d] x 2 -> the case's layout
            full = torch.cat(halves, dim=2)
            return [full.transpose(0, 1) if sbhd else full]

        return Bound(split(t, t.requires_grad), lambda q, k: list(fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)),
                     None if g is None else [p.transpose(1, 2) for p in split(g)],
                     lambda outs: canon([o.transpose(1, 2) for o in outs]), canon)


IMPLS = {i.name: i for i in (Ours, OursCache, OursQK, OursTwice, OursInplace, OursHF, OursFlash, Reference, Compiled,
                             TransformerEngine, FlashAttention, Liger, LigerHF)}
