"""README's Python examples run as written: on a GPU through the kernel, on the CPU as a user's CPU runs them,
through the PyTorch reference (the interpreter would take seconds at the examples' sizes).

A ```python block that starts with an import is a complete example and is run; the others list signatures."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import rope._backend
import rope.functional

from .cases import DEVICE

README = Path(__file__).resolve().parents[2] / "README.md"


def _examples():
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    return [b for b in blocks if b.startswith(("import ", "from "))]


EXAMPLES = _examples()


def test_the_examples_are_found():
    assert len(EXAMPLES) >= 2
    assert any("RoPECache" in b for b in EXAMPLES), "the RoPECache example is not a complete one"


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs(code, monkeypatch, capsys):
    if DEVICE == "cpu":  # as without TRITON_INTERPRET=1
        monkeypatch.setattr(rope._backend, "INTERPRET", False)
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})  # noqa: S102 - README's own code
