"""The multimodal RoPE adapters (tests/adapters: hf_mrope.py, vllm_mrope.py, mrope.py) on the CPU: the --rope-impl
specs, each adapter with this package's functions behind it against the float64 reference (TE's call through three
equal position streams, and the canonical mRoPE call on three distinct streams), broken implementations caught
through each adapter, the capability gate of `target.mrope`, named implementations that are not installed, and the
report's mRoPE rows.

Tolerance everywhere: the contract's one rounding of the float64 reference (tests/numerics.py
`assert_within_rounding`), the bound the whole suite holds every float32 result to; the adapters pass float32
cos/sin tables, whose rounding that bound covers (it is why the suite checks those conventions in float32).
"""
from __future__ import annotations

import sys

import pytest
import torch

import rope.hf
import rope.mrope
import rope.vllm
from rope import reference
from tests import adapters
from tests.adapters import MRoPECapabilities, SpecError, Unavailable, even_sections, parse, report
from tests.adapters.conformance import DEFAULT_IMPLS
from tests.target import load_target

from .cases import DEVICE
from .numerics import assert_within_rounding
from .test_conventions import randn

HF = "hf-mrope:rope.hf:apply_multimodal_rotary_pos_emb"
VLLM = "vllm-mrope:rope.vllm:mrotary_embedding"
CANONICAL = "mrope:rope.mrope:apply_multimodal_rotary_pos_emb"
OURS = (HF, VLLM, "rope-mrope")
HERE = "tests.test_mrope_adapters"


# ----------------------------------------------------------------------------------------------
# Stand-ins: transformers' definition, and one bug per convention
# ----------------------------------------------------------------------------------------------

def qwen2_vl_apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """transformers' Qwen2-VL function, from its definition (no `mrope_interleaved` keyword)."""
    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)

    doubled = list(mrope_section) * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(doubled, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(doubled, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def broken_hf_stream0(q, k, cos, sin, mrope_section, unsqueeze_dim=1, mrope_interleaved=False):
    """Every pair reads the temporal stream's table."""
    return rope.hf.apply_multimodal_rotary_pos_emb(q, k, cos[:1].expand_as(cos), sin[:1].expand_as(sin),
                                                   mrope_section, unsqueeze_dim, mrope_interleaved)


def broken_vllm_streams_swapped(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox=True,
                                mrope_interleaved=False):
    """The height and width sections read each other's stream."""
    if positions.dim() == 2:
        positions = positions[[0, 2, 1]]
    return rope.vllm.mrotary_embedding(positions, query, key, head_size, cos_sin_cache, mrope_section, is_neox,
                                       mrope_interleaved)


def broken_mrope_sections_reversed(t, freqs, positions, mrope_section, tensor_format="thd", interleaved=False,
                                   mrope_interleaved=False):
    """The section sizes taken in reverse order (temporal gets the width's count)."""
    return rope.mrope.apply_multimodal_rotary_pos_emb(t, freqs, positions, list(mrope_section)[::-1],
                                                      tensor_format, interleaved, mrope_interleaved)


BROKEN = {f"hf-mrope:{HERE}:broken_hf_stream0": "every pair reads stream 0",
          f"vllm-mrope:{HERE}:broken_vllm_streams_swapped": "streams 1 and 2 swapped",
          f"mrope:{HERE}:broken_mrope_sections_reversed": "sections reversed"}


# ----------------------------------------------------------------------------------------------
# The specs
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,want", [
    ("hf-mrope", ("hf-mrope", None, "hf-mrope")),
    ("liger-mrope", ("hf-mrope", None, "liger-mrope")),
    ("vllm-mrope", ("vllm-mrope", None, "vllm-mrope")),
    ("rope-mrope", ("mrope", None, "rope-mrope")),
    (HF, ("hf-mrope", "rope.hf:apply_multimodal_rotary_pos_emb", None)),
    (VLLM, ("vllm-mrope", "rope.vllm:mrotary_embedding", None)),
    (CANONICAL, ("mrope", "rope.mrope:apply_multimodal_rotary_pos_emb", None)),
])
def test_mrope_specs_parse(spec, want):
    assert parse(spec) == want


@pytest.mark.parametrize("spec,names", [
    ("hf_mrope:rope.hf:apply_multimodal_rotary_pos_emb", ["hf_mrope", "hf-mrope", "vllm-mrope"]),
    ("mrope-hf", ["mrope-hf", "liger-mrope", "rope-mrope"]),
    ("hf-mrope:", ["hf-mrope:"]),
    ("vllm-mrope:rope.vllm:no_such_function", ["no_such_function"]),
    ("hf-mrope:no_such_module_xyz:f", ["no_such_module_xyz"]),
])
def test_bad_mrope_specs_name_what_is_wrong(spec, names):
    with pytest.raises((SpecError, ImportError, AttributeError)) as info:
        load_target(spec)
    msg = str(info.value)
    assert all(n in msg for n in names), msg
    assert len(msg.splitlines()) <= 5


def test_which_targets_have_an_mrope_call():
    """This package's default target: rope.mrope's function itself, full capabilities; the mRoPE conventions:
    their adapters; TE-convention callables and the plain conventions: none, and mrope_call skips."""
    for spec in (adapters.DEFAULT, "rope", "rope-mrope", CANONICAL):
        target = load_target(spec)
        assert target.mrope is rope.mrope.apply_multimodal_rotary_pos_emb, spec
        assert target.mrope_caps.full, spec
    assert load_target("rope-mrope").caps.start_positions == "adapter (positions)"  # TE's call: via positions
    for spec in OURS[:2]:
        target = load_target(spec)
        assert target.mrope is not None and not target.mrope_caps.full and target.mrope_caps.mrope_interleaved
    for spec in ("rope.reference:apply_rotary_pos_emb", "hf:rope.hf:apply_rotary_pos_emb",
                 "vllm:rope.vllm:rotary_embedding", "flash:rope.flash:apply_rotary_emb"):
        target = load_target(spec)
        assert target.mrope is None and target.mrope_caps is None, spec
        with pytest.raises(pytest.skip.Exception, match="has no multimodal RoPE"):
            target.mrope_call()


@pytest.mark.parametrize("pairs,want", [(1, [1, 0, 0]), (2, [2, 0, 0]), (3, [1, 1, 1]), (5, [3, 1, 1]),
                                        (64, [22, 21, 21])])
def test_even_sections_cover_the_pairs(pairs, want):
    assert even_sections(pairs) == want


# ----------------------------------------------------------------------------------------------
# TE's call through three equal streams
# ----------------------------------------------------------------------------------------------

def halves(theta, interleaved):
    """Angles with one value per pair (what the cos/sin-of-half-width conventions express)."""
    return theta.repeat_interleave(2, -1) if interleaved else torch.cat([theta, theta], -1)


def te_case(seed, tensor_format, interleaved):
    """Small TE calls that use the adapters' position work: start_positions, cu_seqlens, context parallelism,
    partial rotary. Random values and angles (never 0 or 1)."""
    gen = torch.Generator().manual_seed(seed)
    kw = dict(tensor_format=tensor_format, interleaved=interleaved)
    d, d2 = (10, 6) if tensor_format == "bshd" else (8, 8)
    if tensor_format == "thd":
        shape = (7, 2, d)
        kw.update(cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE),
                  start_positions=torch.tensor([4, 1], device=DEVICE))
    elif tensor_format == "sbhd":
        shape = (3, 2, 2, d)
        kw.update(start_positions=torch.tensor([5, 2], device=DEVICE))
    else:  # rank 1 of 2: positions from the dual-chunk layout
        shape = (2, 4, 1, d)
        kw.update(cp_size=2, cp_rank=1)
    theta = torch.rand(16, d2 // 2, generator=gen, dtype=torch.float64) * 20 - 10
    freqs = halves(theta, interleaved).float().reshape(16, 1, 1, d2).to(DEVICE)
    return randn(shape, torch.float32, gen), freqs, kw


def check_te(target, t, freqs, kw):
    """TE's call within one rounding of the float64 reference. Forward only: the backward is the canonical call's
    (te_via_mrope only computes positions), which check_mrope checks."""
    assert target.caps.lacks(t, freqs, kw) is None  # a case inside the capabilities: a verdict, not a skip
    out = target(t, freqs, **kw)
    ref = reference.apply_rotary_pos_emb(t.double(), freqs.double(), **kw)
    assert_within_rounding(out, ref, t, freqs.shape[-1], kw["interleaved"], "forward")


@pytest.mark.parametrize("spec", OURS)
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
def test_te_call_through_mrope_adapter_matches_reference(spec, tensor_format):
    target = load_target(spec)
    interleaved = target.caps.interleaved and tensor_format != "bshd"  # GPT-J pairs where the convention has them
    check_te(target, *te_case(len(spec) + len(tensor_format), tensor_format, interleaved))


# ----------------------------------------------------------------------------------------------
# The canonical mRoPE call on distinct streams
# ----------------------------------------------------------------------------------------------

LEAD = {"sbhd": (3, 2), "bshd": (2, 3), "thd": (5,)}
# (tensor_format, head dim, rotary width, sections, GPT-J pairs, Qwen3-VL's interleaved sections, one stream)
MROPE_CASES = [
    ("sbhd", 12, 12, [2, 3, 1], False, False, False),
    ("bshd", 16, 12, [2, 2, 2], True, True, False),  # partial rotary; interleaved sections: 1, 4 and 2, 5
    ("thd", 8, 8, [1, 2, 1], True, False, False),
    ("thd", 8, 6, [1, 1, 1], False, False, True),  # one stream for all three (text): the forward's positions
]


def mrope_case(seed, tensor_format, d, d2, sections, interleaved, mrope_interleaved, one_stream, caps):
    gen = torch.Generator().manual_seed(seed)
    lead, rows = LEAD[tensor_format], 24
    positions = torch.randint(0, rows, (3, *lead), generator=gen).to(DEVICE)
    assert all(not torch.equal(positions[a], positions[b]) for a, b in ((0, 1), (0, 2), (1, 2)))  # distinct
    if one_stream:
        positions = positions[1]
    theta = torch.rand(rows, d2 // 2, generator=gen, dtype=torch.float64) * 20 - 10
    interleaved = interleaved and caps.interleaved  # GPT-J pairs where the convention has them
    freqs = halves(theta, interleaved).float().reshape(rows, 1, 1, d2).to(DEVICE)
    kw = dict(tensor_format=tensor_format, interleaved=interleaved, mrope_interleaved=mrope_interleaved)
    t = randn((*lead, 2, d), torch.float32, gen)
    return t, freqs, positions, sections, kw, None if one_stream else randn(t.shape, torch.float32, gen)


def check_mrope(target, t, freqs, positions, sections, kw, g):
    """The canonical call (forward, and backward where there is one and g is given) within one rounding of the
    float64 reference, inputs unchanged."""
    assert target.mrope_caps.lacks(t, freqs, positions, kw) is None  # inside the capabilities: a verdict
    before = [x.clone() for x in (t, freqs, positions, t if g is None else g)]
    x = t.clone().requires_grad_()
    out = target.mrope(x, freqs, positions, sections, **kw)
    assert out.shape == t.shape and out.dtype == t.dtype
    x64 = t.double().requires_grad_()
    ref = reference.apply_multimodal_rotary_pos_emb(x64, freqs.double(), positions, sections, **kw)
    d2, interleaved = freqs.shape[-1], kw["interleaved"]
    assert_within_rounding(out, ref.detach(), t, d2, interleaved, "forward")
    if target.mrope_caps.backward and g is not None:
        out.backward(g)
        ref.backward(g.double())
        assert_within_rounding(x.grad, x64.grad, g, d2, interleaved, "backward")
    for x0, x1, name in zip(before, (t, freqs, positions, t if g is None else g), ("t", "freqs", "positions", "grad"),
                            strict=True):
        assert torch.equal(x0, x1), f"{name} changed"


@pytest.mark.parametrize("spec", OURS + (f"hf-mrope:{HERE}:qwen2_vl_apply_multimodal_rotary_pos_emb",))
@pytest.mark.parametrize("case", range(len(MROPE_CASES)))
def test_canonical_mrope_through_adapter_matches_reference(spec, case):
    target = load_target(spec)
    fmt, d, d2, sections, interleaved, mrope_interleaved, one = MROPE_CASES[case]
    mrope_interleaved = mrope_interleaved and target.mrope_caps.mrope_interleaved  # transformers' has none
    check_mrope(target, *mrope_case(case, fmt, d, d2, sections, interleaved, mrope_interleaved, one,
                                    target.mrope_caps))


@pytest.mark.parametrize("spec", list(BROKEN), ids=list(BROKEN.values()))
def test_broken_mrope_is_caught_through_its_adapter(spec):
    """One section bug per convention: the canonical check on distinct streams fails; TE's call, three equal
    streams, cannot see it (any sections give plain RoPE there), which is why tests/test_mrope.py exists."""
    target = load_target(spec)
    fmt, d, d2, sections, interleaved, mrope_interleaved, one = MROPE_CASES[0]
    case = mrope_case(0, fmt, d, d2, sections, interleaved, mrope_interleaved, one, target.mrope_caps)
    with pytest.raises(AssertionError, match="forward: .* outside one rounding"):
        check_mrope(target, *case)
    check_te(target, *te_case(1, "sbhd", False))


# ----------------------------------------------------------------------------------------------
# The capability gate, named implementations not installed, the report
# ----------------------------------------------------------------------------------------------

def test_calls_outside_the_mrope_capabilities_are_skipped_outside_hypothesis():
    hf, vllm = load_target(HF), load_target(VLLM)
    t, freqs, positions, sections, kw, _ = mrope_case(0, *MROPE_CASES[0], caps=MRoPECapabilities())
    with pytest.raises(pytest.skip.Exception, match="no interleaved \\(GPT-J\\) pairs"):
        hf.mrope(t, freqs, positions, sections, "sbhd", True)
    with pytest.raises(pytest.skip.Exception, match="float16 not checked"):
        vllm.mrope(t.half(), freqs, positions, sections, **kw)
    unequal = torch.rand(freqs.shape, generator=torch.Generator().manual_seed(3)) * 6 - 3
    with pytest.raises(pytest.skip.Exception, match="equal within each pair"):
        vllm.mrope(t, unequal, positions, sections, **kw)
    plain_transformers = load_target(f"hf-mrope:{HERE}:qwen2_vl_apply_multimodal_rotary_pos_emb")
    assert not plain_transformers.mrope_caps.mrope_interleaved
    with pytest.raises(pytest.skip.Exception, match="mrope_interleaved"):
        plain_transformers.mrope(t, freqs, positions, [2, 2, 2], "sbhd", mrope_interleaved=True)
    assert load_target("rope-mrope").mrope_caps.lacks(t.half(), unequal, positions, dict(interleaved=True)) is None


def test_named_mrope_not_installed_is_one_line_with_install_command(monkeypatch):
    for name, module, hint in (("hf-mrope", "transformers", "pip install transformers"),
                               ("liger-mrope", "liger_kernel", "pip install liger-kernel"),
                               ("vllm-mrope", "vllm", "pip install vllm")):
        for loaded in [m for m in sys.modules if m == module or m.startswith(module + ".")] or [module]:
            monkeypatch.setitem(sys.modules, loaded, None)  # import raises ImportError, as when not installed
        with pytest.raises(Unavailable) as info:
            load_target(name)
        msg = str(info.value)
        assert len(msg.splitlines()) == 1 and "install it with: " + hint in msg, msg


def test_report_lists_mrope_capabilities_and_implementations():
    ours = report.capability_rows(load_target("rope"))
    assert ours["mRoPE"] == "yes" and ours["mRoPE interleaved sections"] == "yes"
    hf = report.capability_rows(load_target(HF))
    assert hf["mRoPE"].startswith("yes (") and hf["mRoPE angles"] == "equal pair halves only"
    assert hf["mRoPE interleaved pairs"] == "no"
    assert report.capability_rows(load_target("hf:rope.hf:apply_rotary_pos_emb"))["mRoPE"] == "none"
    runs = [{"impl": name, "capabilities": rows, "results": {"mrope_matches_oracle": {"outcome": "pass"}}}
            for name, rows in (("hf", {"formats": "thd", "mRoPE": "none"}), ("rope", ours))]
    text = report.render(runs)
    assert "| mRoPE interleaved sections | - | yes |" in text and "| mrope_matches_oracle | pass | pass |" in text
    for spec in ("liger-mrope", "hf-mrope", "vllm-mrope", "rope-mrope", HF, VLLM, "hf:rope.hf:apply_rotary_pos_emb",
                 "flash:rope.flash:apply_rotary_emb", "vllm:rope.vllm:rotary_embedding", *adapters.NAMES):
        assert spec in DEFAULT_IMPLS, spec
