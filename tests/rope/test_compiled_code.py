"""Facts about the kernels' compiled code for Hopper (sm_90), checked without a GPU.

Triton cross-compiles the kernels to PTX on any machine (`tests/ptx.py`). The facts that the
bandwidth depends on are properties of that code, not of a run: every access to `t` is 16 bytes
wide per thread, sin/cos are evaluated once per angle (or not at all where the table is read),
never with approximate instructions, and the loads that many programs share are marked to stay
in L2 (docs/design.md).
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

VARIANTS = {
    "table-sbhd-bf16": dict(table=True, split=True, num_warps=1),
    "table-thd-bf16": dict(table=True, thd=True, split=True, num_warps=1),
    "table-thd-positions-bf16": dict(table=True, thd=True, pos_table=True, split=True, num_warps=1),
    "table-thd-mrope-bf16": dict(table=True, thd=True, pos_table=True, split=True, num_warps=1, mrope=1,
                                 sections=[16, 24, 24]),
    "table-fp32-d256": dict(table=True, d=256, d2=256, dtype="fp32", split=True, num_warps=4),
    "evaluated-bf16": dict(),
    # DeepSeek-V4's head: the trailing 64 of 512 channels rotated (interleaved pairs, a half-width table), the 448
    # before them copied in the same pass, the row pointers moved to the rotated channels; and the same widths with
    # the rotated channels first
    "tail-first-bf16": dict(table=True, d=512, d2=64, interleaved=True, rot_start=448, split=True, num_warps=4),
    "tail-last-bf16": dict(table=True, d=512, d2=64, interleaved=True, split=True, num_warps=4),
}

# The CPU suite runs under Triton's interpreter, whose kernels cannot be compiled: the PTX comes
# from a child process without it (a few seconds for all variants).
_SCRIPT = """
import json, sys
from rope import kernels
from tests import ptx
out = {}
for name, kw in json.loads(sys.argv[1]).items():
    out[name] = ptx.compile_variant(kernels.rope_kernel, **kw).asm["ptx"]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(VARIANTS)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    if done.returncode != 0 and "backend" in done.stderr.lower() and "nvidia" in done.stderr.lower():
        pytest.skip(f"this Triton build cannot cross-compile for sm_90: {done.stderr.splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _accesses(ptx, op):
    return re.findall(rf"{op}\.global[\.\w:]*", ptx)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.startswith("table")])
def test_table_kernel_code(ptx, variant):
    ptx = ptx[variant]
    loads, stores = _accesses(ptx, "ld"), _accesses(ptx, "st")
    # t's loads and every store: 16-byte vectors (the table's own rows may be narrower per thread).
    t_loads = [a for a in loads if "evict_last" not in a]
    assert t_loads and all(a.endswith(".v4.b32") for a in t_loads), loads
    assert stores and all(a.endswith(".v4.b32") for a in stores), stores
    # Everything else (table rows, cu_seqlens) is a shared read marked to stay in L2.
    shared = [a for a in loads if "evict_last" in a]
    assert len(shared) >= 4, loads
    # Reading the table means no sin/cos in the kernel at all.
    assert "__nv_sinf" not in ptx and "__nv_cosf" not in ptx and "sin.approx" not in ptx


def test_evaluating_kernel_code(ptx):
    ptx = ptx["evaluated-bf16"]  # bf16 d = 128, sin/cos evaluated from the angles
    # Once per angle: one thread holds 2 of the 64 angle pairs (a and its partner b) -> 2 + 2.
    assert ptx.count("__nv_sinf.exit") == 2 and ptx.count("__nv_cosf.exit") == 2
    assert "sin.approx" not in ptx and "cos.approx" not in ptx
    assert all(a.endswith(".v4.b32") for a in _accesses(ptx, "st"))
    assert any("evict_last" in a for a in _accesses(ptx, "ld"))


def test_every_kernel_variant_compiles_for_hopper():
    """Every kernel's representative variants (`tests/ptx.py`: rope, q+k, QK norm, cache write) compile for sm_90.
    The CPU suite runs kernels in Triton's interpreter, which never compiles the branch a constexpr leaves out; the
    GPU compiler still generates code after a `return` taken in a static branch, so a helper there that does not
    compile for the arguments it is given fails only on a GPU. This compiles them all without one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.ptx"], env=env, capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    if done.returncode != 0 and "backend" in done.stderr.lower() and "nvidia" in done.stderr.lower():
        pytest.skip(f"this Triton build cannot cross-compile for sm_90: {done.stderr.splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    from tests import ptx
    assert len(done.stdout.splitlines()) == sum(len(v) for v in ptx.KERNELS.values())


def test_rotated_channels_last_keep_the_accesses(ptx):
    """Moving the row pointers to the trailing rotated channels (448 channels, 896 bytes: a multiple of 16) keeps
    every access as wide as with the rotated channels first: the same loads and stores, most 16 bytes per thread
    (the 64-channel slice in a tile laid out for the 448-channel tail takes some 8-byte ones either way)."""
    first, last = ptx["tail-first-bf16"], ptx["tail-last-bf16"]
    for op in ("ld", "st"):
        assert sorted(_accesses(first, op)) == sorted(_accesses(last, op)), (op, _accesses(first, op))
    stores = _accesses(first, "st")
    assert sum(a.endswith(".v4.b32") for a in stores) > len(stores) / 2, stores
