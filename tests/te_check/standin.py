"""A `transformer_engine` for TE's test_fused_rope.py: TE's own rope module, with its fused path on `rope`.

Importing this module puts four modules into sys.modules:

    transformer_engine, transformer_engine.pytorch, transformer_engine.pytorch.attention
        empty packages (the real TransformerEngine is never imported, installed or not);
    transformer_engine.pytorch.attention.rope
        TransformerEngine's own source, $TE_SOURCE/transformer_engine/pytorch/attention/rope.py, read
        from a checkout (nothing of TE is kept in this repository) and executed with its C-extension
        imports stubbed, then patched:
          apply_rotary_pos_emb(fused=True)  -> rope.apply_rotary_pos_emb (Triton);
          apply_rotary_pos_emb(fused=False) -> TE's own function, unchanged (the tests' reference);
          apply_fused_qkv_rotary_pos_emb    -> q, k, v split as TE's fused QKV kernel splits them,
                                               q and k rotated by rope, v copied;
          RotaryPositionEmbedding           -> TE's own class, unchanged.

run.sh loads it as a pytest plugin (`-p tests.te_check.standin`), so that the import happens before
TE's test file is collected; smoke.py imports it directly. Anything else fails with one line
(`TESourceError`) naming what was expected.
"""
from __future__ import annotations

import inspect
import os
import sys
import types
from pathlib import Path

import torch

import rope

TE_ROPE = "transformer_engine/pytorch/attention/rope.py"  # relative to TE_SOURCE
PACKAGES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.attention")
MODULE = "transformer_engine.pytorch.attention.rope"
WRITTEN_FOR = "TransformerEngine commit d0067d0 (d0067d0da6cb01811b8072a7d304f0e00344ce2b)"

# The public functions as TE declares them; TE's source is checked against these before it is patched.
TE_SIGNATURES = {
    "apply_rotary_pos_emb": (
        ("t", inspect.Parameter.empty), ("freqs", inspect.Parameter.empty), ("tensor_format", "sbhd"),
        ("start_positions", None), ("interleaved", False), ("fused", False), ("cu_seqlens", None),
        ("cp_size", 1), ("cp_rank", 0)),
    "apply_fused_qkv_rotary_pos_emb": (
        ("qkv", inspect.Parameter.empty), ("q_freqs", inspect.Parameter.empty),
        ("k_freqs", inspect.Parameter.empty), ("qkv_split_arg_list", inspect.Parameter.empty),
        ("tensor_format", "sbhd"), ("start_positions", None), ("interleaved", False), ("cu_seqlens", None),
        ("cp_size", 1), ("cp_rank", 0)),
}


class TESourceError(RuntimeError):
    """TE_SOURCE is unset, or its rope module is not what this stand-in was written for."""


class _CExtensionOnly:
    """Stands for TE's C extension and its QKVFormat enum: TE's module imports them at the top but
    uses them only inside its fused autograd functions, which the patch below replaces. Any use
    fails loudly rather than silently doing something else."""

    def __init__(self, name: str):
        self._name = name

    def _fail(self, what: str):
        return AttributeError(f"te_check stand-in: TE's {self._name}{what} was reached; it is not available here "
                              "(the fused path should go to `rope`)")

    def __getattr__(self, attr):
        if attr.startswith("_"):
            raise AttributeError(attr)
        raise self._fail(f".{attr}")

    def __getitem__(self, key):
        raise self._fail(f"[{key!r}]")


def _package(name: str) -> types.ModuleType:
    mod = types.ModuleType(name, f"te_check stand-in for {name} (see tests/te_check/standin.py)")
    mod.__path__ = []  # a package: submodules come from sys.modules only
    return mod


def _install_stubs() -> None:
    """Put the stand-in packages and the stubs TE's module imports into sys.modules, replacing any
    real TransformerEngine already there."""
    for name in list(sys.modules):
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            del sys.modules[name]
    for name in PACKAGES:
        sys.modules[name] = _package(name)
    tex = types.ModuleType("transformer_engine_torch", "te_check stub for TE's C extension")
    tex.__getattr__ = _CExtensionOnly("C extension (transformer_engine_torch)").__getattr__
    sys.modules["transformer_engine_torch"] = tex
    cpp = _package("transformer_engine.pytorch.cpp_extensions")
    fused_attn = types.ModuleType("transformer_engine.pytorch.cpp_extensions.fused_attn")
    fused_attn.QKVFormat = _CExtensionOnly("QKVFormat")
    cpp.fused_attn = fused_attn
    sys.modules[cpp.__name__] = cpp
    sys.modules[fused_attn.__name__] = fused_attn
    sys.modules["transformer_engine.pytorch"].cpp_extensions = cpp
    sys.modules["transformer_engine"].pytorch = sys.modules["transformer_engine.pytorch"]
    sys.modules["transformer_engine.pytorch"].attention = sys.modules["transformer_engine.pytorch.attention"]


def _te_rope_path() -> Path:
    root = os.environ.get("TE_SOURCE")
    if not root:
        raise TESourceError("te_check: set TE_SOURCE to the root of a TransformerEngine checkout "
                            f"(it must hold {TE_ROPE}; see tests/te_check/README.md)")
    path = Path(root).expanduser().resolve() / TE_ROPE
    if not path.is_file():
        raise TESourceError(f"te_check: {path} not found (TE_SOURCE={root}); the stand-in expects TE's layout, "
                            f"{TE_ROPE}, as at {WRITTEN_FOR}")
    return path


def _check_signature(te, name: str) -> None:
    fn = getattr(te, name, None)
    if fn is None:
        raise TESourceError(f"te_check: TE's {te.__file__} has no `{name}` (the stand-in follows {WRITTEN_FOR})")
    got = tuple((p.name, p.default) for p in inspect.signature(fn).parameters.values())
    if got != TE_SIGNATURES[name]:
        def show(params):
            return ", ".join(n if d is inspect.Parameter.empty else f"{n}={d!r}" for n, d in params)

        raise TESourceError(f"te_check: TE's {name}({show(got)}) in {te.__file__} differs from the stand-in's "
                            f"{name}({show(TE_SIGNATURES[name])}) (as at {WRITTEN_FOR}): "
                            "update tests/te_check/standin.py")


def _load_te_rope() -> types.ModuleType:
    path = _te_rope_path()
    _install_stubs()
    te = types.ModuleType(MODULE)
    te.__file__ = str(path)
    te.__package__ = MODULE.rpartition(".")[0]
    sys.modules[MODULE] = te
    try:
        exec(compile(path.read_text(), str(path), "exec"), te.__dict__)
    except ImportError as e:
        del sys.modules[MODULE]
        raise TESourceError(f"te_check: TE's {path} imports something the stand-in does not stub ({e}); it stubs "
                            f"what TE's module imports at {WRITTEN_FOR}: update tests/te_check/standin.py") from e
    if not isinstance(getattr(te, "RotaryPositionEmbedding", None), type):
        raise TESourceError(f"te_check: TE's {path} has no class RotaryPositionEmbedding (as at {WRITTEN_FOR})")
    for name in TE_SIGNATURES:
        _check_signature(te, name)
    sys.modules["transformer_engine.pytorch.attention"].rope = te
    return te


te_rope = _load_te_rope()
te_apply_rotary_pos_emb = te_rope.apply_rotary_pos_emb  # TE's own, kept for fused=False


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                         start_positions: torch.Tensor | None = None, interleaved: bool = False,
                         fused: bool = False, cu_seqlens: torch.Tensor | None = None,
                         cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """TE's signature. fused=False: TE's own function. fused=True: `rope`, after the one check that TE
    makes before it picks a path (thd needs cu_seqlens)."""
    if not fused:
        return te_apply_rotary_pos_emb(t, freqs, tensor_format=tensor_format, start_positions=start_positions,
                                       interleaved=interleaved, fused=False, cu_seqlens=cu_seqlens,
                                       cp_size=cp_size, cp_rank=cp_rank)
    assert tensor_format != "thd" or cu_seqlens is not None, "tensor_format 'thd' needs cu_seqlens"
    return rope.apply_rotary_pos_emb(t, freqs, tensor_format=tensor_format, start_positions=start_positions,
                                     interleaved=interleaved, fused=True, cu_seqlens=cu_seqlens,
                                     cp_size=cp_size, cp_rank=cp_rank)


def apply_fused_qkv_rotary_pos_emb(qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
                                   qkv_split_arg_list: list[int], tensor_format: str = "sbhd",
                                   start_positions: torch.Tensor | None = None, interleaved: bool = False,
                                   cu_seqlens: torch.Tensor | None = None, cp_size: int = 1,
                                   cp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TE's signature and checks (those of its function and of its autograd function's forward);
    `cu_seqlens` is accepted and ignored, as in TE.

    qkv [s, b, h, nq + nk + nv] (sbhd) or [b, s, h, ...] (bshd), contiguous, with
    (nq, nk, nv) = qkv_split_arg_list. As TE's kernel does, the last dimension is cut into q, k and v,
    and q's part of each head is read as nq / nk heads of width nk. Returns new contiguous tensors:
    q rotated [.., h * nq / nk, nk], k rotated [.., h, nk], v copied [.., h, nv]. The gradient
    reaches qkv through the split (autograd), where TE's backward writes it in one kernel.
    """
    assert not (cp_size > 1 and start_positions is not None), "start_positions needs cp_size == 1"
    assert tensor_format != "thd", "packed QKV supports sbhd and bshd only, not thd"
    assert tensor_format in ("sbhd", "bshd"), f"tensor_format {tensor_format!r} is not sbhd or bshd"
    assert qkv.is_contiguous(), "qkv must be contiguous"
    assert q_freqs.is_contiguous(), "q_freqs must be contiguous"
    assert k_freqs.is_contiguous(), "k_freqs must be contiguous"
    nq, nk, nv = (int(n) for n in qkv_split_arg_list)
    q, k, v = torch.split(qkv, [nq, nk, nv], dim=3)
    dim0, dim1, heads = qkv.shape[:3]
    q = q.reshape(dim0, dim1, heads * nq // nk, nk)
    common = dict(tensor_format=tensor_format, start_positions=start_positions, interleaved=interleaved,
                  fused=True, cp_size=cp_size, cp_rank=cp_rank)
    return (rope.apply_rotary_pos_emb(q, q_freqs, **common), rope.apply_rotary_pos_emb(k, k_freqs, **common),
            v.clone(memory_format=torch.contiguous_format))


for _fn in (apply_rotary_pos_emb, apply_fused_qkv_rotary_pos_emb):
    _fn.__module__ = MODULE
    setattr(te_rope, _fn.__name__, _fn)
te_rope.te_check_standin = __name__  # marks the patched module


def pytest_report_header(config):
    """Under pytest (run.sh's `-p tests.te_check.standin`): say what runs."""
    return [f"te_check: TE's {te_rope.__file__}, fused=True -> rope {rope.__file__}"]
