"""The back end under the conventions (rope/_backend.py): one decision between kernel, reference and trace, memo keys
derived from the arguments, and one registry of conventions that the custom op reads."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import rope
import rope._backend as backend
from rope import _memo

from .cases import DEVICE

ROPE = pathlib.Path(rope.__file__).parent
FRONT_ENDS = ["hf.py", "vllm.py", "meta.py", "flash.py", "mrope.py", "torchtitan.py", "qknorm.py", "qknorm_te.py",
              "cache.py", "functional.py", "embedding.py", "serving.py"]
# what deciding between the kernel and the reference takes: the rule, the trace question, and the launcher
DECIDING = {"kernel_runs", "on_kernel_device", "is_compiling", "rotate", "rotate_qk", "record", "norm_rotate",
            "rotate_op"}


def _names(path) -> set:
    """Every name a module reads or imports from rope's back end and launcher (and torch.compiler's is_compiling)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("_backend", "_launch"):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.Attribute) and node.attr in ("kernel_runs", "on_kernel_device", "is_compiling"):
            found.add(node.attr)
        elif isinstance(node, ast.Name) and node.id in ("kernel_runs", "on_kernel_device"):
            found.add(node.id)
    return found


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_front_ends_leave_the_decision_to_the_back_end(front):
    """No convention file asks where the kernel runs or whether code is traced, nor calls the launcher or the autograd
    nodes itself: it checks its arguments and hands `rope._backend.dispatch` its tensors, flags and reference."""
    assert not _names(ROPE / front) & DECIDING, f"{front}: {sorted(_names(ROPE / front) & DECIDING)}"


# the records a front end builds, and how many leading arguments each may pass by position (Call: the layout)
RECORDS = {"Call": 1, "Layout": 0, "Angles": 0, "Request": 0}


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_front_ends_build_records_by_name(front):
    """A front end names every field of the records it builds (no `Call(layout, "bshd", flags[0], None, None, 1, 0)`):
    a positional record read wrong is a wrong kernel."""
    positional = [f"line {node.lineno}: {node.func.id}" for node in ast.walk(ast.parse((ROPE / front).read_text()))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in RECORDS
                  and len(node.args) > RECORDS[node.func.id]]
    assert not positional, f"{front}: fields passed by position: {positional}"


def _hf(cos):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 8, generator=gen).to(DEVICE)
    k = torch.randn(1, 1, 5, 8, generator=gen).to(DEVICE)
    return rope.hf.apply_rotary_pos_emb(q, k, cos, cos)


def test_memo_keys_are_derived_from_every_tensor(monkeypatch):
    """Every memo entry is keyed by `rope._backend.signature` under a registered convention's name, over every tensor
    the call reads; a table at another 16-byte alignment (which Triton specializes on) gets a launch plan of its own
    under the same call, and each result is the reference's."""
    if not backend.on_kernel_device(torch.empty(0, device=DEVICE)):
        pytest.skip("the reference path keeps no memo")
    monkeypatch.setattr(backend, "_CALLS", _memo.Memo("calls of this test", 4096))
    monkeypatch.setattr(backend, "_SEEN", _memo.Memo("signatures of this test", 4096))
    wide = torch.rand(1, 5, 9, device=DEVICE)
    aligned, shifted = wide[..., :8], wide[..., 1:]
    assert aligned.data_ptr() % 16 != shifted.data_ptr() % 16
    for cos in (aligned.contiguous(), shifted.contiguous(), aligned, shifted):
        q, k = (_hf(cos)[i] for i in (0, 1))
        gen = torch.Generator().manual_seed(0)
        q0 = torch.randn(1, 2, 5, 8, generator=gen).to(DEVICE)
        k0 = torch.randn(1, 1, 5, 8, generator=gen).to(DEVICE)
        want = [x * cos.unsqueeze(1) + torch.cat([-x[..., 4:], x[..., :4]], -1) * cos.unsqueeze(1) for x in (q0, k0)]
        torch.testing.assert_close((q, k), tuple(want))
    keys = list(backend._CALLS)
    assert all(key[0] in backend.CONVENTIONS for key in keys), keys
    assert len(keys) == 2, keys  # the contiguous tables' call, the strided tables' call
    plans = sorted(len(call.plans) for call in backend._CALLS.values())
    assert plans == [1, 2], plans  # the strided call: a plan for each alignment of its table


def test_signature_lists_what_checks_and_calls_read():
    """For each tensor: shape, strides, dtype, device; for each flag its type and value (True and 1 differ); None
    stays None."""
    x = torch.zeros(2, 3)
    assert backend.signature("c", (x, None), (True, 1, "sbhd")) == (
        "c", (True, 1, "sbhd"), bool, int, str, x.shape, x.stride(), x.dtype, x.device, None)
    assert backend.signature("c", (), (True,)) != backend.signature("c", (), (1,))
    # the CPU and the meta device differ (their get_device() is -1 alike): a meta tensor never finds a CPU call's memo
    meta = torch.empty(2, 3, device="meta")
    assert backend.signature("c", (meta,), ()) != backend.signature("c", (x,), ())


def test_every_convention_is_registered_once():
    """The custom op finds each convention by its name: one registry, names distinct, every front end's there."""
    assert {"hf", "vllm", "meta", "flash", "mrope", "torchtitan", "torchtitan-positions", "qknorm", "qknorm-cache",
            "qknorm-te", "te", "kv-cache"} <= set(backend.CONVENTIONS)
    assert all(name == conv.name for name, conv in backend.CONVENTIONS.items())


def _hf_args(gen, dtype=torch.float32):
    q = torch.randn(2, 3, 5, 8, generator=gen).to(DEVICE, dtype)
    k = torch.randn(2, 1, 5, 8, generator=gen).to(DEVICE, dtype)
    cos = torch.randn(2, 5, 8, generator=gen).to(DEVICE, dtype)
    sin = torch.randn(2, 5, 8, generator=gen).to(DEVICE, dtype)
    return q, k, cos, sin


def test_static_checks_run_once_per_signature(monkeypatch):
    """`check_once`: a front end's static checks run on the first sight of a signature only; another dtype, shape or
    flag value is another signature, checked again (and refused where it is wrong)."""
    import rope.hf as hf
    monkeypatch.setattr(backend, "_SEEN", _memo.Memo("signatures of this test", 4096))
    calls = []
    checks = hf._check_pair
    monkeypatch.setattr(hf, "_check_pair", lambda *a: (calls.append(a), checks(*a))[1])
    gen = torch.Generator().manual_seed(3)
    q, k, cos, sin = _hf_args(gen)
    for _ in range(3):
        hf.apply_rotary_pos_emb(q, k, cos, sin)
    assert len(calls) == 1
    hf.apply_rotary_pos_emb(*_hf_args(gen))  # new tensors, the same signature
    assert len(calls) == 1
    hf.apply_rotary_pos_emb(*_hf_args(gen, torch.float16))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)
    with pytest.raises(ValueError, match="cos"):
        hf.apply_rotary_pos_emb(q, k, cos[:, :4], sin[:, :4])
    assert len(calls) == 4


def test_a_seen_signature_keeps_its_own_call():
    """Two front ends with the same arguments (transformers' half-split and GLM's interleaved forms) each keep the
    `Call` their own checked signature made: the second is not given the first one's pairing."""
    gen = torch.Generator().manual_seed(4)
    q, k, cos, sin = _hf_args(gen)
    for _ in range(2):
        half = rope.hf.apply_rotary_pos_emb(q, k, cos, sin)
        glm = rope.hf.apply_rotary_pos_emb_glm(q, k, cos, sin)
        cos_i = cos[..., :4].repeat_interleave(2, -1).unsqueeze(1)
        sin_i = sin[..., :4].repeat_interleave(2, -1).unsqueeze(1)
        for x, got_half, got_glm in ((q, half[0], glm[0]), (k, half[1], glm[1])):
            x64 = x.double()
            rot_half = torch.cat([-x64[..., 4:], x64[..., :4]], -1)
            pairs = torch.stack([-x64[..., 1::2], x64[..., ::2]], -1).flatten(-2)
            torch.testing.assert_close(got_half.double(), x64 * cos.double().unsqueeze(1) +
                                       rot_half * sin.double().unsqueeze(1), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got_glm.double(), x64 * cos_i.double() + pairs * sin_i.double(),
                                       atol=1e-5, rtol=1e-5)


def test_per_call_checks_after_a_seen_signature(monkeypatch):
    """What a static check cannot know stays checked on every call: vLLM's in-place query, once a leaf that requires
    grad, is refused under a signature already seen (its requires_grad is part of the signature's tensor, so the
    signature is the one of a plain tensor here: the check is autograd's state)."""
    monkeypatch.setattr(backend, "_SEEN", _memo.Memo("signatures of this test", 4096))
    gen = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 16, (4,), generator=gen).to(DEVICE)
    cache = torch.randn(16, 8, generator=gen).to(DEVICE)
    query = torch.randn(4, 2 * 8, generator=gen).to(DEVICE)
    key = torch.randn(4, 8, generator=gen).to(DEVICE)
    rope.vllm.rotary_embedding(positions, query, key, 8, cache, True)
    leaf = torch.randn(4, 2 * 8, generator=gen).to(DEVICE).requires_grad_()
    with pytest.raises(ValueError, match="query: in-place rotation of a"):
        rope.vllm.rotary_embedding(positions, leaf, key, 8, cache, True)
    with pytest.raises(ValueError, match="key"):  # key overlapping query
        rope.vllm.rotary_embedding(positions, query, query[:, :8], 8, cache, True)
