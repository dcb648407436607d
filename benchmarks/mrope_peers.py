"""Multimodal RoPE (Qwen2-VL's mRoPE) for bench_mrope.py: the case, its inputs, the float64 oracle and the
implementations, behind peers.py's interface (`Impl.bind(inputs, t, g) -> Bound`, checked by checks.check_impl).

The case: one attention step of a Qwen2-VL-7B-like model, batch 1, T tokens. q [1, T, 28, 128] and k [1, T, 4, 128]
bf16 as a projection leaves them (contiguous [b, s, h, d] memory), which is also the canonical layout of the
check: the transformers-signature implementations see [b, h, s, d] views of it (`q.transpose(1, 2)`), the packed
one [T, h, d] views (`q[0]`). Positions: three streams laid out as Qwen2-VL's `get_rope_index` lays out text
interleaved with images (`positions_for`); cos/sin [3, 1, T, 128] bf16 as its rotary module computes them.

Implementations: rope-hf (`rope.hf.apply_multimodal_rotary_pos_emb`, q and k in one launch), rope-packed
(`rope.mrope.apply_multimodal_rotary_pos_emb_qk` on the [T, h, d] views with positions [3, T] and a
`rope.RoPECache`, what packed training calls), liger (Liger-Kernel's `liger_multimodal_rotary_pos_emb`), hf-eager
(transformers' `apply_multimodal_rotary_pos_emb`: imported where transformers has it, else written out) and
hf-compiled (the same under `torch.compile`). Peers are imported lazily; Liger, if it does not import, is
skipped with the reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from peers import Bound, Impl, _to_case

import rope
import rope.mrope

HQ, HK, D = 28, 4, 128  # Qwen2-VL-7B: 28 query heads, 4 key/value heads, head dim 128
SECTION = [16, 24, 24]  # rotary pairs per stream (temporal, height, width): its rope_scaling.mrope_section
THETA = 1e6  # its rope_theta
MAX_POSITIONS = 32768  # its max_position_embeddings: the rows of rope-packed's RoPECache
TOKENS = (1, 16, 64, 512, 4096, 16384, 32768)
DTYPE = torch.bfloat16
KIND = "mrope"  # the Case.kind of these cases (peers.Impl.kinds)


@dataclass(frozen=True)
class MropeCase:
    tokens: int

    kind = KIND

    @property
    def name(self) -> str:
        return f"mrope_T{self.tokens}"

    @property
    def shapes(self) -> list:
        """q and k in memory ([b, s, h, d], b = 1)."""
        return [(1, self.tokens, HQ, D), (1, self.tokens, HK, D)]

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def elem_bytes(self) -> int:
        return DTYPE.itemsize

    @property
    def bytes_fwd(self) -> int:
        """q and k read once and written once, plus per token one cos and one sin per channel in bf16 (each
        channel's own stream: what a kernel must read of transformers' [3, b, s, d] tables at least). The same
        for every implementation, and as cases.py counts angle rows (d float32 per token)."""
        return 2 * self.numel * self.elem_bytes + self.tokens * D * 4

    @property
    def label(self) -> str:
        return f"q 1x{self.tokens}x{HQ}x{D} / k 1x{self.tokens}x{HK}x{D} bf16, mrope {SECTION}"


CASES = [MropeCase(t) for t in TOKENS]


def positions_for(tokens: int, seed: int = 0) -> torch.Tensor:
    """int64 [3, tokens] (temporal, height, width), as Qwen2-VL's get_rope_index gives them for text and images
    in turn: 2 text tokens, an image of gh x gw merged patches (gh, gw in [4, 48], random), then 8..255 text
    tokens, another image, and so on. Text: the three streams equal and consecutive. An image: temporal constant,
    height and width its grid, all offset by the position reached; the text after it starts at that position +
    max(gh, gw). Each segment advances the position by at most its token count, so every value is < tokens."""
    gen = torch.Generator().manual_seed(seed)
    segments, start, count, text = [], 0, 0, 2
    while count < tokens:
        if text:
            segment = torch.arange(start, start + text).expand(3, text)
            start += text
            text = 0  # an image next
        else:
            gh, gw = torch.randint(4, 49, (2,), generator=gen).tolist()
            hh, ww = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
            segment = start + torch.stack([torch.zeros(gh * gw, dtype=torch.int64), hh.flatten(), ww.flatten()])
            start += max(gh, gw)
            text = int(torch.randint(8, 256, (1,), generator=gen))
        segments.append(segment)
        count += segment.shape[1]
    return torch.cat(segments, dim=1)[:, :tokens].contiguous()


def inv_freq() -> torch.Tensor:
    """float32 [D / 2]: Qwen2-VL's default rope parameters, computed on the host once so that every device
    tensor below holds the same angles."""
    return 1.0 / (THETA ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))


@dataclass
class MropeInputs:
    case: MropeCase
    positions: torch.Tensor  # int64 [3, T]
    angles: torch.Tensor  # float32 [3, 1, T, D]: Qwen2-VL's emb = cat(freqs, freqs), the oracle's angles
    cos: torch.Tensor  # bf16 [3, 1, T, D]: its rotary module's output, emb.cos() in the model's dtype
    sin: torch.Tensor
    cache: rope.RoPECache  # float32 cos/sin of positions 0 .. MAX_POSITIONS - 1, the same float32 angles
    ts: list  # input sets (q, k), each contiguous [1, T, h, D]
    gs: list  # one upstream gradient (gq, gk) per set, the same form


def make_inputs(case: MropeCase, device, n_sets: int = 1, seed: int = 0) -> MropeInputs:
    """N(0, 1) q, k and upstream gradients (never zeros or ones: they hide unwritten outputs and can run faster)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    inv = inv_freq().to(device)
    positions = positions_for(case.tokens, seed).to(device)
    freqs = positions[:, None, :, None].float() * inv  # [3, 1, T, D / 2]: the module's float32 product
    angles = torch.cat([freqs, freqs], dim=-1)
    table = torch.arange(MAX_POSITIONS, device=device)[:, None].float() * inv  # the same products per position
    cache = rope.RoPECache.from_freqs(torch.cat([table, table], dim=-1)[:, None, None, :])

    def one_set():
        return tuple(torch.randn(shape, generator=gen, device=device).to(DTYPE) for shape in case.shapes)

    return MropeInputs(case, positions, angles, angles.cos().to(DTYPE), angles.sin().to(DTYPE), cache,
                       [one_set() for _ in range(n_sets)], [one_set() for _ in range(n_sets)])


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_formula(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """transformers' `apply_multimodal_rotary_pos_emb` (Qwen2-VL), written out: the specification the oracle
    evaluates, independent of transformers being installed and of rope's own reference."""
    mrope_section = mrope_section * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def reference64(inputs: MropeInputs, t, g) -> tuple[list, list]:
    """float64 outputs and input gradients [q, k] (canonical layout [1, T, h, D]) of the set t with upstream
    gradient g: transformers' formula on the inputs upcast, cos/sin of the float32 angles evaluated in float64,
    and autograd through it."""
    angles = inputs.angles.double()
    cos, sin = angles.cos(), angles.sin()
    xs = [x.detach().double().requires_grad_() for x in t]
    outs = [o.transpose(1, 2) for o in hf_formula(*(x.transpose(1, 2) for x in xs), cos, sin, SECTION)]
    grads = torch.autograd.grad(outs, xs, [x.double() for x in g])
    return [o.detach() for o in outs], list(grads)


def _hf_bound(inputs, t, g, fn) -> Bound:
    """A call of transformers' signature on [b, h, s, d] views of the set's [b, s, h, d] memory, as attention
    layers pass q and k (projection, view, transpose), with the bf16 cos/sin [3, 1, T, D]."""
    xs, gs = _to_case(t), None if g is None else _to_case(g)
    return Bound(xs, lambda q, k: list(fn(q, k, inputs.cos, inputs.sin, SECTION)), gs, _to_case, _to_case)


class RopeHF(Impl):
    name, kinds, ours = "rope-hf", frozenset({KIND}), True

    def bind(self, inputs, t, g=None):
        return _hf_bound(inputs, t, g, rope.hf.apply_multimodal_rotary_pos_emb)


def _unsqueeze(xs):
    return [x[None] for x in xs]


class RopePacked(Impl):
    """Packed (thd) training's call: [T, h, D] views, positions [3, T], the RoPECache read in place of sin/cos."""
    name, kinds, ours = "rope-packed", frozenset({KIND}), True

    def bind(self, inputs, t, g=None):
        def fn(q, k):
            return list(rope.mrope.apply_multimodal_rotary_pos_emb_qk(q, k, inputs.cache, inputs.positions, SECTION,
                                                                      tensor_format="thd"))

        return Bound([x[0] for x in t], fn, None if g is None else [x[0] for x in g], _unsqueeze, _unsqueeze)


class Liger(Impl):
    """Liger-Kernel's mRoPE. It rotates q and k in place when their [b, s, h, d] memory is contiguous (as here),
    and in backward the upstream gradients too: each bind works on copies of the set and of the gradients, made
    once and untimed, so the shared sets stay as they are; every call rotates the copies again (the same bytes),
    as peers.LigerHF does for Liger's plain RoPE. In a model q and k are fresh projections each step."""
    name, kinds, registered = "liger", frozenset({KIND}), ("liger-mrope", "hf-mrope")
    note = "writes q and k (backward: the upstream gradients) in place; timed on copies made once per bind"

    def bind(self, inputs, t, g=None):
        t = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in t)
        g = None if g is None else tuple(x.clone() for x in g)
        return _hf_bound(inputs, t, g, self.load())


class HFEager(Impl):
    """transformers' `apply_multimodal_rotary_pos_emb` eagerly (bf16 arithmetic, as the model ran it): imported
    where transformers has it (4.x), else `hf_formula`, the same definition written out (transformers 5 selects
    the sections in its rotary module instead and has no such function). `source()` says which."""
    name, kinds = "hf-eager", frozenset({KIND})
    # not a call of a named implementation in tests/conformance/registry.py (transformers 5 has no such function):
    # its path is listed here, and the written-out definition stands in where it does not import
    candidates = ("transformers.models.qwen2_vl.modeling_qwen2_vl:apply_multimodal_rotary_pos_emb",)

    def missing(self):
        return None  # the written-out definition stands in

    def source(self) -> str:
        if self.load() is not None:
            return "transformers.models.qwen2_vl.modeling_qwen2_vl.apply_multimodal_rotary_pos_emb"
        return f"mrope_peers.hf_formula (written out: {self._why})"

    def bind(self, inputs, t, g=None):
        return _hf_bound(inputs, t, g, self.target())

    def target(self):
        return self.load() or hf_formula


class HFCompiled(HFEager):
    """transformers' function under `torch.compile` (inductor), one static-shape graph per T and grad mode,
    compiled by the first call (the benchmark's warm-up, never a timed one)."""
    name = "hf-compiled"
    _compiled = None

    def target(self):
        if self._compiled is None:
            # 7 token counts x (no_grad, grad) graphs: dynamo's default limit of 8 recompilations would fall
            # back to eager part-way through.
            for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 1024))
            # The backward is timed by replaying one recorded forward (retain_graph=True), which
            # AOTAutograd's donated buffers forbid; the kernels are the same without them.
            if hasattr(torch._functorch.config, "donated_buffer"):
                torch._functorch.config.donated_buffer = False
            self._compiled = torch.compile(super().target(), dynamic=False)
        return self._compiled


IMPLS = {i.name: i for i in (RopeHF, RopePacked, Liger, HFEager, HFCompiled)}
