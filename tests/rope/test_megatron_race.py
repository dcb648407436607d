"""Megatron-LM's MLA form permutes in place (pairs read interleaved, written half-split), the step whose in-place
write raced in Megatron's own kernel. On the GPU, at sizes where thousands of programs run at once: packed thd of
uneven sequences and sbhd, bf16, both permutation directions (forward, and the backward's transpose), with and
without remove_interleaving. Every call is checked against a float64 oracle of the definition, and every repeat is
bitwise equal to the first: a tile that stored before all of its pairs were loaded, or a program that wrote a
neighbour's channels, gives values from the wrong channel on some call."""
from __future__ import annotations

import pytest
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the planted kernel needs Triton; the tests using it need a GPU
    triton = None

import rope

from .cases import gpu_only

NOPE, EMB, HEADS, REPEATS = 128, 64, 128, 40


def _oracle(t, cos, sin, positions, remove_interleaving):
    """float64: the trailing EMB channels read as pairs (2i, 2i + 1), rotated by columns i and i + EMB/2 of the
    token's table row, written half-split, or interleaved again with remove_interleaving."""
    x = t.double()
    pairs = x[..., NOPE:]
    a, b = pairs[..., 0::2], pairs[..., 1::2]
    half = EMB // 2
    c, s = cos.double()[positions], sin.double()[positions]
    shape = (-1,) + (1,) * (x.dim() - 2) + (half,)
    c1, c2 = c[:, :half].reshape(shape), c[:, half:].reshape(shape)
    s1, s2 = s[:, :half].reshape(shape), s[:, half:].reshape(shape)
    out_a, out_b = a * c1 - b * s1, b * c2 + a * s2
    rot = torch.stack((out_a, out_b), -1).flatten(-2) if remove_interleaving else torch.cat((out_a, out_b), -1)
    return torch.cat((x[..., :NOPE], rot), -1)


def _oracle_grad(g, cos, sin, positions, remove_interleaving):
    """float64, the forward's transpose applied to g: g's rotated channels read where the forward wrote them, taken
    through the transposed rotation, written back to the pairs (2i, 2i + 1); the leading channels as they are."""
    y = g.double()
    rot = y[..., NOPE:]
    half = EMB // 2
    g_a, g_b = (rot[..., 0::2], rot[..., 1::2]) if remove_interleaving else (rot[..., :half], rot[..., half:])
    c, s = cos.double()[positions], sin.double()[positions]
    shape = (-1,) + (1,) * (y.dim() - 2) + (half,)
    c1, c2 = c[:, :half].reshape(shape), c[:, half:].reshape(shape)
    s1, s2 = s[:, :half].reshape(shape), s[:, half:].reshape(shape)
    grad_a, grad_b = g_a * c1 + g_b * s2, g_b * c2 - g_a * s1
    return torch.cat((y[..., :NOPE], torch.stack((grad_a, grad_b), -1).flatten(-2)), -1)


def _case(form, gen):
    if form == "thd":
        lengths = torch.randint(1, 1500, (12,), generator=gen)
        cu = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))).to(torch.int32)
        positions = torch.cat([torch.arange(int(n)) for n in lengths])
        t = torch.randn(int(cu[-1]), HEADS, NOPE + EMB, generator=gen)
        rows = int(lengths.max())
        return t, rows, positions, {"cu_seqlens_q": cu.cuda()}
    s, b, h = {"sbhd": (2048, 3, HEADS), "decode": (1, 64, HEADS), "one_head": (5, 1, 1)}[form]
    return torch.randn(s, b, h, NOPE + EMB, generator=gen), s, torch.arange(s), {}


def _verdict(rotate, form, remove_interleaving, backward=True):
    """None, or what went wrong: `rotate(t, cos, sin, keywords)` (t's trailing channels in place, returning a
    tensor over t) against the oracle on its first call, then bitwise against that first call on every repeat."""
    gen = torch.Generator().manual_seed(7)
    t_cpu, rows, positions, kw = _case(form, gen)
    kw["remove_interleaving"] = remove_interleaving
    t0 = t_cpu.to(torch.bfloat16).cuda()
    angles = torch.rand(rows, EMB, generator=gen) * 50
    cos, sin = angles.cos().cuda(), angles.sin().cuda()
    g = torch.randn(t0.shape, generator=gen).to(torch.bfloat16).cuda()
    want = [_oracle(t0, cos, sin, positions.cuda(), remove_interleaving)]
    if backward:
        want.append(_oracle_grad(g, cos, sin, positions.cuda(), remove_interleaving))
    first = None
    for repeat in range(REPEATS):
        t = t0.clone().requires_grad_(backward)
        out = rotate(t, cos, sin, kw)
        if backward:
            out.backward(g)
        got = [out.detach().clone()] + ([t.grad] if backward else [])
        if first is None:
            # one rounding to bf16 of float32 math: within 2**-8 of each value's magnitude, plus float32's own
            # error on products of values below 8 (2**-18 covers it); a value from the wrong channel is off by
            # about its own size
            for value, ref, what in zip(got, want, ("forward", "backward")[:len(got)], strict=True):
                excess = ((value.double() - ref).abs() - 2**-8 * ref.abs() - 2**-18).max().item()
                if excess > 0:
                    return f"{what} off the float64 oracle by {excess} beyond one bf16 rounding"
            first = got
        for value, ref, what in zip(got, first, ("forward", "backward")[:len(got)], strict=True):
            if not torch.equal(value, ref):
                return f"repeat {repeat}: the {what} differs from the first call's"
    return None


def _rope(t, cos, sin, kw):
    return rope.megatron.fused_mla_rope_inplace(t, cos, sin, NOPE, EMB, **kw)


@gpu_only
@pytest.mark.parametrize("remove_interleaving", [False, True])
@pytest.mark.parametrize("form", ["thd", "sbhd", "decode", "one_head"])
def test_in_place_permutation_is_race_free(form, remove_interleaving):
    verdict = _verdict(_rope, form, remove_interleaving)
    assert verdict is None, verdict


if triton is not None:
    @triton.jit
    def _overlapping_tiles_kernel(x_ptr, cos_ptr, sin_ptr, positions_ptr, n_rows, row_stride, ROWS: tl.constexpr,
                                  HALF: tl.constexpr, INTERLEAVED_OUT: tl.constexpr):
        """The planted race: program p rotates, in place, its own tile of ROWS rows and then the next program's, so
        every tile but the first is rotated by two programs at once; the result depends on which one loads first."""
        i = tl.arange(0, HALF)[None, :]
        for tile in range(2):
            r = (tl.program_id(0) + tile) * ROWS + tl.arange(0, ROWS)
            ok = (r < n_rows)[:, None]
            row = x_ptr + r[:, None] * row_stride
            a = tl.load(row + 2 * i, mask=ok).to(tl.float32)
            b = tl.load(row + 2 * i + 1, mask=ok).to(tl.float32)
            table = tl.load(positions_ptr + r, mask=r < n_rows)[:, None] * (2 * HALF)
            c1, c2 = tl.load(cos_ptr + table + i, mask=ok), tl.load(cos_ptr + table + HALF + i, mask=ok)
            s1, s2 = tl.load(sin_ptr + table + i, mask=ok), tl.load(sin_ptr + table + HALF + i, mask=ok)
            out_a, out_b = (a * c1 - b * s1).to(x_ptr.dtype.element_ty), (b * c2 + a * s2).to(x_ptr.dtype.element_ty)
            if INTERLEAVED_OUT:
                tl.store(row + 2 * i, out_a, mask=ok)
                tl.store(row + 2 * i + 1, out_b, mask=ok)
            else:
                tl.store(row + i, out_a, mask=ok)
                tl.store(row + HALF + i, out_b, mask=ok)


def _overlapping_tiles(t, cos, sin, kw):
    """t contiguous; each row's table row: its token's position (thd: within its sequence)."""
    tokens = t.shape[0] * (t.shape[1] if t.dim() == 4 else 1)
    heads = t.shape[-2]
    if "cu_seqlens_q" in kw:
        cu = kw["cu_seqlens_q"].long()
        token_positions = torch.arange(tokens, device=t.device) - cu[:-1].repeat_interleave(cu.diff())
    else:
        token_positions = torch.arange(t.shape[0], device=t.device).repeat_interleave(tokens // t.shape[0])
    rows = token_positions.repeat_interleave(heads).to(torch.int32)
    rows_per_program = 4
    grid = (triton.cdiv(rows.numel(), rows_per_program),)
    _overlapping_tiles_kernel[grid](t[..., NOPE:], cos, sin, rows, rows.numel(), t.shape[-1], ROWS=rows_per_program,
                                    HALF=EMB // 2, INTERLEAVED_OUT=kw["remove_interleaving"])
    return t


@gpu_only
@pytest.mark.parametrize("form", ["thd", "sbhd", "decode"])
def test_a_planted_race_is_caught(form):
    """The same check on an in-place kernel whose programs' tiles overlap: a row rotated by a program after its
    neighbour wrote it comes out rotated twice."""
    assert _verdict(_overlapping_tiles, form, remove_interleaving=False, backward=False) is not None
