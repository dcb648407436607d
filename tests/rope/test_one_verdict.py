"""One verdict on every path, and failure atomicity, as properties of every entry point (docs/contract.md
sections 1, 5, 7a and 7b).

A drawn call (an entry point, a valid call of it, then one bad or edge change: a dtype, a flag of the
wrong type, a tensor argument that is none, a position outside the table with value checks on or off,
in place on a leaf, on views of a tensor that requires grad, on split outputs, on aliased or expanded
tensors) runs on the kernel path (CUDA, or Triton's interpreter on the CPU) and on the CPU reference
path, each on fresh inputs. Both give the same result within rounding (and the same gradients), or the
same exception type naming the same argument first; a bad input raises ValueError or TypeError before
anything is written: every input, and the tensor that views share, keeps its values.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rope
import rope._backend
import rope._launch
import rope.functional

from .cases import DEVICE, reference_path

S, B, H, D, T, ROWS = 4, 2, 2, 8, 5, 8  # sequence, batch, heads, head dim, tokens, table rows
MAX_EXAMPLES = 12  # per entry point: the CPU interpreter runs two paths per example


class Entry(NamedTuple):
    fn: Callable
    tensors: tuple  # the rotated tensors' argument names (one, or two: q and k)
    shapes: tuple  # their shapes
    tables: Callable  # gen -> the other arguments (angles, positions, flags)
    positions: str | None  # the argument holding positions or start offsets
    table: str | None  # the argument a position past the end is blamed on (value checks)
    flags: tuple  # bool flags
    inplace: str | None  # "kw": inplace=True asks for it; "always": the convention writes in place


def _rand(gen, *shape):
    return torch.randn(*shape, generator=gen).to(DEVICE)


def _freqs(gen):
    return (torch.rand(ROWS, 1, 1, D, generator=gen) * 6).to(DEVICE)


def _half(gen):
    return (torch.rand(ROWS, D // 2, generator=gen) * 6).to(DEVICE)


def _te(gen):
    return dict(freqs=_freqs(gen), start_positions=torch.randint(0, ROWS - S + 1, (B,), generator=gen).to(DEVICE))


def _hf(gen, streams=False, width=D):
    ang = (torch.rand(*((3,) if streams else ()), B, S, width // 2, generator=gen) * 6).to(DEVICE)
    ang = torch.cat([ang, ang], dim=-1)
    kw = dict(cos=ang.cos(), sin=ang.sin())
    if streams:
        kw["mrope_section"] = [2, 1, 1]
    return kw


def _flash(gen):
    half = _half(gen)
    return dict(cos=half.cos(), sin=half.sin(),
                seqlen_offsets=torch.randint(0, ROWS - S + 1, (B,), generator=gen).to(DEVICE))


def _vllm(gen, streams=False):
    half = _half(gen)
    kw = dict(positions=torch.randint(0, ROWS, (3, T) if streams else (T,), generator=gen).to(DEVICE), head_size=D,
              cos_sin_cache=torch.cat([half.cos(), half.sin()], dim=-1))
    if streams:
        kw["mrope_section"] = [2, 1, 1]
    else:
        kw["is_neox"] = True
    return kw


def _mrope(gen):
    return dict(freqs=_freqs(gen), positions=torch.randint(0, ROWS, (3, T), generator=gen).to(DEVICE),
                mrope_section=[2, 1, 1], tensor_format="thd")


ENTRIES = {
    "te": Entry(rope.apply_rotary_pos_emb, ("t",), ((S, B, H, D),), _te, "start_positions", "freqs",
                ("interleaved", "fused", "inplace"), "kw"),
    "te-qk": Entry(rope.apply_rotary_pos_emb_qk, ("q", "k"), ((S, B, H, D), (S, B, 1, D)), _te, "start_positions",
                   "freqs", ("interleaved", "inplace"), "kw"),
    "hf": Entry(rope.hf.apply_rotary_pos_emb, ("q", "k"), ((B, H, S, D), (B, 1, S, D)), _hf, None, None, (), None),
    # partial rotary (tables of half the head) through the one-tensor and GLM's forms
    "hf-single": Entry(rope.hf.apply_rotary_pos_emb_single, ("x",), ((B, H, S, D),), lambda gen: _hf(gen, width=D // 2),
                       None, None, (), None),
    "hf-glm": Entry(rope.hf.apply_rotary_pos_emb_glm, ("q", "k"), ((B, H, S, D), (B, 1, S, D)),
                    lambda gen: _hf(gen, width=D // 2), None, None, (), None),
    "hf-mrope": Entry(rope.hf.apply_multimodal_rotary_pos_emb, ("q", "k"), ((B, H, S, D), (B, 1, S, D)),
                      lambda gen: _hf(gen, True), None, None, ("mrope_interleaved",), None),
    "flash": Entry(rope.flash.apply_rotary_emb, ("x",), ((B, S, H, D),), _flash, "seqlen_offsets", "cos",
                   ("interleaved", "inplace"), "kw"),
    "vllm": Entry(rope.vllm.rotary_embedding, ("query", "key"), ((T, H * D), (T, D)), _vllm, "positions",
                  "positions", ("is_neox",), "always"),
    "vllm-mrope": Entry(rope.vllm.mrotary_embedding, ("query", "key"), ((T, H * D), (T, D)),
                        lambda gen: _vllm(gen, True), "positions", "positions", ("is_neox", "mrope_interleaved"),
                        "always"),
    "mrope": Entry(rope.mrope.apply_multimodal_rotary_pos_emb, ("t",), ((T, H, D),), _mrope, "positions",
                   "positions", ("interleaved", "mrope_interleaved"), None),
    "mrope-qk": Entry(rope.mrope.apply_multimodal_rotary_pos_emb_qk, ("q", "k"), ((T, H, D), (T, 1, D)), _mrope,
                      "positions", "positions", ("interleaved", "mrope_interleaved"), None),
}

# The changes: each (entry) -> whether it applies
CHANGES = ("none", "float64", "int64", "not_a_tensor", "flag_not_bool", "past_the_table", "negative_position",
           "views_of_grad_tensor", "leaf_requires_grad", "split_outputs", "aliased", "expanded")


def _applies(change: str, entry: Entry) -> bool:
    if change in ("past_the_table", "negative_position"):
        return entry.positions is not None
    if change == "flag_not_bool":
        return bool(entry.flags)
    if change in ("leaf_requires_grad", "split_outputs", "expanded"):
        return entry.inplace is not None
    if change == "aliased":
        return entry.inplace is not None and len(entry.tensors) == 2
    return True


class Built(NamedTuple):
    kwargs: dict
    watched: list  # every tensor whose values a failing call must leave as they were
    leaves: list  # tensors whose gradients the two paths must agree on
    expect: tuple | None  # (exception type, argument named), None: a result, or "either" for no rule


def build(name: str, change: str, seed: int, flag_value, checks: bool) -> Built:
    """The call of entry `name` with `change`, built from `seed` (the same inputs on both paths)."""
    entry = ENTRIES[name]
    gen = torch.Generator().manual_seed(seed)
    kw = entry.tables(gen)
    leaves, watched = [], []
    names, shapes = entry.tensors, entry.shapes
    if change == "views_of_grad_tensor":  # slices of one fused projection that requires grad (a non-leaf)
        w, y, views = _projection_views(name, gen)
        leaves.append(w)
        watched.append(y)
        kw.update(zip(names, views, strict=True))
    elif change == "split_outputs":
        base = _rand(gen, *shapes[0][:-2], shapes[0][-2] + 1, D).requires_grad_()
        y = base * 1
        watched.append(y)
        kw[names[0]] = y.split([shapes[0][-2], 1], dim=-2)[0].flatten(-2) if name.startswith("vllm") else \
            y.split([shapes[0][-2], 1], dim=-2)[0]
        for n, s in zip(names[1:], shapes[1:], strict=False):
            kw[n] = _rand(gen, *s)
    else:
        for n, s in zip(names, shapes, strict=True):
            kw[n] = _rand(gen, *s)
    main = names[0]
    expect = None
    if change == "float64":
        for n in names:
            kw[n] = kw[n].double()
        expect = "either" if name.startswith("hf") else (TypeError, main)  # transformers promotes q with cos
    elif change == "int64":
        for n in names:
            kw[n] = (kw[n] * 4).long()
        expect = "either" if name.startswith("hf") else (TypeError, main)
    elif change == "not_a_tensor":
        kw[main] = None
        expect = (TypeError, main)
    elif change == "flag_not_bool":
        flag = entry.flags[seed % len(entry.flags)]
        kw[flag] = flag_value
        expect = (TypeError, flag)
    elif change in ("past_the_table", "negative_position"):
        pos = kw[entry.positions].clone()
        pos.view(-1)[seed % pos.numel()] = ROWS if change == "past_the_table" else -1
        kw[entry.positions] = pos
        if checks:
            expect = (ValueError, entry.table if change == "past_the_table" else entry.positions)
    elif change == "leaf_requires_grad":
        kw[main].requires_grad_()
        leaves.append(kw[main])
        # flash-attention writes a leaf in place and returns it as a new tensor with the rotation's backward
        # (docs/contract.md, 7a); the others refuse it, as autograd does
        expect = None if name == "flash" else (ValueError, main)
    elif change == "split_outputs":
        expect = (ValueError, main)
    elif change == "aliased":
        kw[names[1]] = kw[main][..., :shapes[1][-1]] if name.startswith("vllm") else kw[main][:, :, :1]
        expect = (ValueError, names[1])
    elif change == "expanded":
        one = _rand(gen, 1, *shapes[0][1:])
        kw[main] = one.expand(shapes[0])
        expect = (ValueError, main)
    if entry.inplace == "kw" and change in ("views_of_grad_tensor", "leaf_requires_grad", "split_outputs", "aliased",
                                            "expanded"):
        kw["inplace"] = True
    watched += [v for v in kw.values() if isinstance(v, torch.Tensor)]
    return Built(kw, watched, leaves, expect)


def _projection_views(name, gen):
    """(w, y = x @ w, views of y shaped as the entry's tensors): q, k (and a v left over) sliced per token
    from one fused projection, as attention layers do, so that q and k have the same strides."""
    shapes = ENTRIES[name].shapes
    if name.startswith("vllm"):  # [T, heads * head_size]: column slices
        widths = [s[1] for s in shapes]
        w = _rand(gen, 16, sum(widths) + D).requires_grad_()
        y = _rand(gen, T, 16) @ w
        return w, y, [y[:, sum(widths[:i]):sum(widths[:i + 1])] for i in range(len(widths))]
    hf = name.startswith("hf")  # [b, h, s, d]: the heads of a [b, s, h, d] projection, transposed
    lead = (B, S) if hf else shapes[0][:-2]
    heads = [s[1] if hf else s[-2] for s in shapes]
    w = _rand(gen, 16, (sum(heads) + 1) * D).requires_grad_()
    y = _rand(gen, *lead, 16) @ w
    qkv = y.view(*lead, sum(heads) + 1, D)
    views = [qkv[..., sum(heads[:i]):sum(heads[:i + 1]), :] for i in range(len(heads))]
    return w, y, [v.transpose(1, 2) for v in views] if hf else views


class Verdict(NamedTuple):
    outputs: list | None
    grads: list | None
    error: tuple | None  # (type, the argument named first)


def run(name: str, built: Built, on_reference: bool, checks: bool) -> Verdict:
    entry = ENTRIES[name]
    before = [x.detach().clone() for x in built.watched]
    rope.set_value_checks(checks)
    try:
        with reference_path(on_reference):
            result = entry.fn(**built.kwargs)
    except (ValueError, TypeError) as e:
        for x, was in zip(built.watched, before, strict=True):
            assert torch.equal(x.detach(), was), f"{name}: an input was written before {type(e).__name__}: {e}"
        return Verdict(None, None, (type(e), str(e).split(":")[0]))
    finally:
        rope.set_value_checks(True)
    if result is None:  # vLLM's op: query and key written in place
        result = [built.kwargs[n] for n in entry.tensors if built.kwargs[n] is not None]
    outs = [result] if isinstance(result, torch.Tensor) else list(result)
    outs += built.watched[:1] if built.leaves and built.watched[0].requires_grad else []
    grads = None
    if built.leaves:
        gen = torch.Generator().manual_seed(99)
        torch.autograd.backward([o for o in outs if o.requires_grad],
                                [torch.randn(o.shape, generator=gen).to(o) for o in outs if o.requires_grad])
        grads = [leaf.grad for leaf in built.leaves]
    return Verdict([o.detach() for o in outs], grads, None)


def _close(a, b, what):
    for x, y in zip(a, b, strict=True):
        tol = {torch.float32: 2.0**-18, torch.float64: 2.0**-18}.get(x.dtype, 2.0**-7)
        torch.testing.assert_close(x, y, rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def check_one_verdict(name, change, seed, flag_value, checks):
    kernel = run(name, build(name, change, seed, flag_value, checks), False, checks)
    ref = run(name, build(name, change, seed, flag_value, checks), True, checks)
    expect = build(name, change, seed, flag_value, checks).expect
    assert kernel.error == ref.error, f"{name}, {change}: kernel path {kernel.error}, reference path {ref.error}"
    if expect not in (None, "either"):
        assert kernel.error == expect, f"{name}, {change}: expected {expect}, got {kernel.error or 'a result'}"
    elif expect is None:
        assert kernel.error is None, f"{name}, {change}: expected a result, got {kernel.error}"
    if kernel.error is None:
        _close(kernel.outputs, ref.outputs, f"{name}, {change}: outputs")
        if kernel.grads is not None:
            _close(kernel.grads, ref.grads, f"{name}, {change}: gradients")


def _changes(name):
    return st.sampled_from([c for c in CHANGES if _applies(c, ENTRIES[name])])


@pytest.mark.parametrize("name", list(ENTRIES))
@settings(max_examples=MAX_EXAMPLES)
@given(data=st.data())
def test_one_verdict_on_every_path(name, data):
    change = data.draw(_changes(name), label="change")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    flag_value = data.draw(st.sampled_from(["no", 1, 0, None, 1.0]), label="flag value")
    checks = data.draw(st.booleans(), label="value checks") if change in ("past_the_table", "negative_position") \
        else True
    check_one_verdict(name, change, seed, flag_value, checks)


# Every change once per entry point that takes it: the cases the issue found, fixed examples beside the draws.
EXAMPLES = [(n, c, checks) for n in ENTRIES for c in CHANGES if _applies(c, ENTRIES[n])
            for checks in ((True, False) if c in ("past_the_table", "negative_position") else (True,))]


@pytest.mark.parametrize("name,change,checks", EXAMPLES, ids=[f"{n}-{c}-{'checks' if k else 'nochecks'}"
                                                               for n, c, k in EXAMPLES])
def test_one_verdict_examples(name, change, checks):
    check_one_verdict(name, change, 7, "no", checks)


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the kernel path is the only one")
@pytest.mark.parametrize("name", list(ENTRIES))
@pytest.mark.parametrize("on_reference", [True, False])
def test_one_switch_decides_every_entry_point(name, on_reference):
    """One rule (rope._backend.on_kernel_device) decides kernel or reference for every entry point: with it saying
    reference, no entry point launches; with it saying kernel, each one does."""
    built = build(name, "none", 3, None, True)
    with reference_path(on_reference), mock.patch.object(rope._launch, "run", wraps=rope._launch.run) as launches:
        ENTRIES[name].fn(**built.kwargs)
    assert bool(launches.call_count) is not on_reference, \
        f"{name}: {launches.call_count} launches with the reference path {'on' if on_reference else 'off'}"


ANGLE_ARGUMENTS = ("freqs", "cos", "sin", "cos_sin_cache")


@pytest.mark.parametrize("name", list(ENTRIES))
@pytest.mark.parametrize("on_reference", [True, False])
def test_angles_that_require_grad_get_no_gradient_on_every_path(name, on_reference):
    """Angles (freqs, cos/sin tables) that require grad: every entry point gives a result on both paths, and the
    gradient flows to the rotated tensors only, as in TransformerEngine's fused path (docs/contract.md, section 1):
    neither a refusal from inside PyTorch nor a gradient to the angles on one path only."""
    entry = ENTRIES[name]
    for rotated_require_grad in (False, True) if entry.inplace != "always" else (False,):
        kwargs = dict(build(name, "none", 3, None, True).kwargs)
        angles = [kwargs[n].requires_grad_() for n in ANGLE_ARGUMENTS if n in kwargs]
        assert angles, name
        rotated = [kwargs[n].requires_grad_(rotated_require_grad) for n in entry.tensors]
        with reference_path(on_reference):
            out = entry.fn(**kwargs)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
        if not rotated_require_grad:
            assert not any(o.requires_grad for o in outs), f"{name}: a result records the angles' history"
            continue
        sum(o.float().sum() for o in outs).backward()
        assert all(x.grad is not None for x in rotated), name
        assert all(a.grad is None for a in angles), f"{name}: the angles got a gradient"


@pytest.mark.parametrize("setter", [rope.set_value_checks, rope.set_angle_table], ids=lambda f: f.__name__)
@pytest.mark.parametrize("value", ["no", 1, 0, None])
def test_switches_take_only_bools(setter, value):
    """A switch refuses a string or a number (read as true or false, "no" would turn it on), naming its argument,
    and keeps its state."""
    with pytest.raises(TypeError, match="^enabled: expected a bool"):
        setter(value)
    assert rope._checks._VALUE_CHECKS[0] is True and rope._table._ENABLED[0] is True


@pytest.mark.parametrize("argument,value,error", [
    ("rotary_base", 0.0, ValueError), ("rotary_base", -10000.0, ValueError), ("rotary_base", float("inf"), ValueError),
    ("rotary_base", float("nan"), ValueError), ("rotary_base", "10000", TypeError),
    ("rotary_percent", 0.0, ValueError), ("rotary_percent", float("nan"), ValueError),
    ("seq_len_interpolation_factor", 0.0, ValueError), ("pretrained_max_position_embeddings", 0, ValueError),
    ("dim", 64.0, TypeError),
])
def test_embedding_refuses_arguments_that_give_no_angles(argument, value, error):
    """RotaryPositionEmbedding's numbers would give NaN or inf angles (a base of 0: inf at every position past 0):
    refused when the module is built, naming the argument."""
    kwargs = dict(dim=64, pretrained_max_position_embeddings=None)
    kwargs[argument] = value
    with pytest.raises(error, match=f"^{argument}: "):
        rope.RotaryPositionEmbedding(**kwargs)


@pytest.mark.skipif(DEVICE != "cpu", reason="Triton's interpreter runs on the CPU only")
@pytest.mark.parametrize("processes", ["1", "2"])
def test_stress_refuses_threads_in_the_interpreter(processes, capsys):
    """Triton's interpreter is not thread-safe: the stress run refuses threads over rope's kernels there, before any
    call runs, saying why, rather than reporting wrong results (and then crashing)."""
    from tests.conformance import stress

    with mock.patch.object(stress, "draw_jobs", side_effect=AssertionError("calls drawn")):
        with pytest.raises(SystemExit) as refused:
            stress.main(["--impl", "rope", "--threads", "2", "--calls", "2", "--processes", processes])
    assert "not thread-safe" in str(refused.value.code), refused.value.code


@pytest.mark.parametrize("name", [n for n, e in ENTRIES.items() if e.positions is not None])
def test_positions_of_another_dtype_take_a_plan_of_their_own(name):
    """A kernel compiled for int32 positions reads int64 ones as pairs of int32: the same call with the other integer
    dtype of its positions (or start offsets) launches with a plan of its own, never the first one's."""
    entry = ENTRIES[name]
    plans = {}
    for dtype in (torch.int32, torch.int64):
        kwargs = dict(build(name, "none", 3, None, True).kwargs)
        kwargs[entry.positions] = kwargs[entry.positions].to(dtype)
        with mock.patch.object(rope._launch, "run", wraps=rope._launch.run) as launches:
            entry.fn(**kwargs)
        plans[dtype] = {id(c.args[0]) for c in launches.call_args_list}
        assert plans[dtype], f"{name}: no launch"
    assert not plans[torch.int32] & plans[torch.int64], f"{name}: int64 positions launched with int32's plan"


@pytest.mark.parametrize("fused", [False, True])
def test_float64_freqs_are_read_as_float32_on_the_reference_path(fused):
    """freqs are read as float32 on every path (docs/contract.md section 2): float64 angles give the result of their
    float32 rounding, bitwise, on the PyTorch path too (fused=False, and fused=True on a CPU tensor without the
    interpreter). Angles to 2^17 rad, where float32's spacing (2^-6 rad) changes every cos and sin."""
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(5, 2, 3, 8, generator=gen)
    freqs = (torch.rand(5, 1, 1, 8, generator=gen, dtype=torch.float64) * 2 - 1) * 2.0**17
    with mock.patch.object(rope._backend, "on_kernel_device", return_value=False):
        got = rope.apply_rotary_pos_emb(t, freqs, fused=fused)
        want = rope.apply_rotary_pos_emb(t, freqs.float(), fused=fused)
    assert torch.equal(got, want), (got - want).abs().max()
    mt = t.reshape(10, 3, 8)
    positions = torch.randint(0, 5, (3, 10), generator=gen)
    got = rope.reference.apply_multimodal_rotary_pos_emb(mt, freqs, positions, (2, 1, 1))
    want = rope.reference.apply_multimodal_rotary_pos_emb(mt, freqs.float(), positions, (2, 1, 1))
    assert torch.equal(got, want), (got - want).abs().max()
