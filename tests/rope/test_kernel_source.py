"""The kernels' source keeps the form docs/design.md gives it ("Files and arguments"): every `@triton.jit` helper is
called by keyword, so that an argument cannot land in the wrong one of a helper's tens of parameters, and each
kernel's pointers are named for what they hold."""
import ast
from pathlib import Path

import pytest

from rope import _launch, kernels

KERNELS = Path(kernels.__file__).resolve().parent


def _is_jit(decorator) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def _sources() -> dict:
    return {path.name: ast.parse(path.read_text()) for path in sorted(KERNELS.glob("*.py"))}


def positional_helper_calls(trees: dict) -> list:
    """'file:line name' of every call of a jit function of the kernels that passes an argument by position."""
    jit = {node.name for tree in trees.values() for node in ast.walk(tree)
           if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list)}
    return [f"{name}:{node.lineno} {node.func.id}" for name, tree in trees.items() for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in jit and node.args]


def test_helpers_are_called_by_keyword():
    trees = _sources()
    assert len(trees) == 5 and all(trees.values())
    assert positional_helper_calls(trees) == []


def test_positional_call_is_found():
    planted = ast.parse("import triton\n@triton.jit\ndef f(a, b):\n    return a\n@triton.jit\ndef g(x):\n"
                        "    return f(x, b=x)\n")
    assert positional_helper_calls({"planted.py": planted}) == ["planted.py:7 f"]


def test_pointer_names_say_what_they_hold():
    """No pointer of a kernel bears a name that hides what it holds (a `freqs_ptr` holding a cos table, a `cu_ptr`
    holding positions) or abbreviates its role."""
    vague = {"freqs_ptr", "cu_ptr", "start_ptr", "pos_ptr", "slot_ptr", "kc_ptr", "vc_ptr", "ks_ptr", "vs_ptr",
             "wq_ptr", "wk_ptr", "sq_ptr", "sk_ptr", "part_ptr", "qo_ptr", "ko_ptr", "cos_ptr"}
    for name in kernels.__all__:
        pointers = [n for n in getattr(kernels, name).arg_names if n.endswith("_ptr")]
        assert pointers and not vague & set(pointers), (name, pointers)


def test_launch_names_every_pointer():
    """The launcher's pointer names are the kernels' own, in order, and a plan refuses any other order."""
    for kernel, pointers in ((kernels.rope_kernel, _launch.ROTATE_POINTERS),
                             (kernels.rope_qk_kernel, _launch.ROTATE_QK_POINTERS),
                             (kernels.rope_qknorm_kernel, _launch.NORM_POINTERS),
                             (kernels.rope_cache_kernel, _launch.CACHE_POINTERS)):
        assert tuple(n for n in kernel.arg_names if n.endswith("_ptr")) == pointers
    with pytest.raises(RuntimeError, match="pointer arguments"):
        _launch.kernel_args(kernels.rope_kernel, _launch.ROTATE_POINTERS[::-1], {})
