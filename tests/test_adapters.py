"""The adapter machinery (tests/adapters) on the CPU, without the libraries: the --rope-impl parser and its
errors, each convention's conversion against a pure-PyTorch stand-in of its library (tests/adapters/standins.py)
run through the suite's own checks (correct stand-ins pass, broken ones are caught), the capability gating, the
conformance report plugin on a small real run, and the merge command.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests import adapters
from tests.adapters import Capabilities, SpecError, Unavailable, conformance, parse, report
from tests.target import Target, load_target

from .strategies import LIMITS, build, limits_override, make_spec, rope_specs
from .test_invariants import CHECKS as INVARIANTS
from .test_properties import check_matches_reference

ROOT = Path(__file__).resolve().parents[1]
STANDINS = "tests.adapters.standins"
HF = f"hf:{STANDINS}:hf_apply_rotary_pos_emb"
FLASH = f"flash:{STANDINS}:flash_apply_rotary_emb"
LIGER = f"liger:{STANDINS}:liger_rotary_pos_emb"
VLLM = f"vllm:{STANDINS}:vllm_rotary_embedding"


# ----------------------------------------------------------------------------------------------
# The parser
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", adapters.NAMES)
def test_names_parse(name):
    parsed = parse(name)
    assert parsed.named == name and parsed.callable_spec is None
    assert parsed.convention == ("te" if name == "rope" else name)


def test_module_callable_is_te_convention_unchanged():
    """`module:callable` is called as it is (TE's convention), the default is ours, as before adapters."""
    from rope import apply_rotary_pos_emb, reference

    assert parse("rope.reference:apply_rotary_pos_emb") == ("te", "rope.reference:apply_rotary_pos_emb", None)
    t = load_target("rope.reference:apply_rotary_pos_emb")
    assert t.fn is reference.apply_rotary_pos_emb and t.caps.full and not t.is_ours
    default = load_target(adapters.DEFAULT)
    assert default.fn is apply_rotary_pos_emb and default.is_ours and default.caps.full
    assert load_target("rope").fn is apply_rotary_pos_emb and load_target("rope").is_ours


def test_convention_module_callable():
    t = load_target(HF)
    assert t.convention == "hf" and t.name == HF and not t.caps.interleaved and not t.caps.elementwise_freqs
    assert parse(VLLM) == ("vllm", f"{STANDINS}:vllm_rotary_embedding", None)


@pytest.mark.parametrize("spec,names", [
    ("nosuch:tests.adapters.standins:hf_apply_rotary_pos_emb", ["nosuch", "hf"]),
    ("hf:no_such_module_xyz:apply", ["no_such_module_xyz"]),
    ("hf:tests.adapters.standins:no_such_function", ["no_such_function"]),
    ("a:b:c:d", ["module:callable"]),
    ("liger-kernel", ["liger-kernel"]),
])
def test_bad_specs_name_what_is_wrong(spec, names):
    with pytest.raises((SpecError, ImportError, AttributeError)) as info:
        load_target(spec)
    msg = str(info.value)
    assert all(n in msg for n in names), msg
    assert len(msg.splitlines()) <= 5


def test_named_not_installed_is_one_line_with_install_command(monkeypatch):
    hints = {"flash": ("flash_attn", "pip install flash-attn"), "liger": ("liger_kernel", "pip install liger-kernel"),
             "hf": ("transformers", "pip install transformers"), "vllm": ("vllm", "pip install vllm"),
             "te": ("transformer_engine", "transformer_engine[pytorch]")}
    for name, (module, hint) in hints.items():
        for loaded in [m for m in sys.modules if m == module or m.startswith(module + ".")] or [module]:
            monkeypatch.setitem(sys.modules, loaded, None)  # import raises ImportError, as when not installed
        with pytest.raises(Unavailable) as info:
            load_target(name)
        msg = str(info.value)
        assert len(msg.splitlines()) == 1 and "install it with: pip install" in msg, msg
        assert hint in msg.replace("'", ""), msg


def _pytest(*args, env=None, timeout=120):
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=timeout)


class _Config:
    """The little of pytest's config that conftest.pytest_configure reads."""

    def __init__(self, spec):
        self.options = {"--rope-impl": spec, "--conformance-report": None}

    def getoption(self, name):
        return self.options[name]


def test_unknown_module_is_a_usage_error_naming_it(request):
    # the top-level conftest.py as pytest loaded it (`import conftest` may find benchmarks/conftest.py)
    (conftest,) = [p for p in request.config.pluginmanager.get_plugins()
                   if getattr(p, "__file__", None) == str(ROOT / "conftest.py")]
    with pytest.raises(pytest.UsageError) as info:
        conftest.pytest_configure(_Config("hf:no_such_module_xyz:f"))
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and "no_such_module_xyz" in msg and msg.startswith("--rope-impl hf:"), msg


def test_not_installed_fails_unless_a_skip_is_asked_for(tmp_path):
    """Through pytest itself: a named implementation that does not import (here a flash_attn whose CUDA extension
    is missing, as on a CPU-only install) ends the run before collection with one line naming how to install it:
    a failure (nothing was tested, so a CI job must not pass), or with --rope-allow-missing a skip (exit 0)."""
    fake = tmp_path / "flash_attn"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'flash_attn_2_cuda'\")\n")
    env = {"PYTHONPATH": str(tmp_path)}
    failed = _pytest("--rope-impl", "flash", "tests/test_invariants.py", env=env)
    assert failed.returncode == 4, failed.stdout + failed.stderr
    out = [ln for ln in (failed.stdout + failed.stderr).splitlines() if ln.strip()]
    assert len(out) == 1 and out[0].startswith("ERROR: --rope-impl flash:") and "nothing was tested" in out[0], out
    skipped = _pytest("--rope-impl", "flash", "--rope-allow-missing", "tests/test_invariants.py", env=env)
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    out = [ln for ln in (skipped.stdout + skipped.stderr).splitlines() if ln.strip()]
    assert len(out) == 1 and "SKIPPED --rope-impl flash" in out[0], out
    assert "pip install flash-attn" in out[0] and "flash_attn_2_cuda" in out[0], out


# ----------------------------------------------------------------------------------------------
# Conversions, against stand-ins of the libraries
# ----------------------------------------------------------------------------------------------

F32_ROTATION = rope_specs(rotation=True, dtypes_=st.just(torch.float32))
REFERENCE = (check_matches_reference, F32_ROTATION)


def falsify(impl, check, strategy, max_examples=12, name=b""):
    """The suite's check on `impl` for a few derandomized examples: the failure, or None."""

    def run(spec):
        check(impl, spec)

    run._hypothesis_internal_add_digest = name
    run = settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                   phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False,
                   suppress_health_check=list(HealthCheck))(given(spec=strategy)(run))
    try:
        with limits_override(LIMITS["cpu-interp"]):
            run()
    except Exception as e:  # noqa: BLE001 - the caller decides
        return e
    return None


def _inv(name):
    check, strategy, _ = INVARIANTS[name]
    return check, strategy


# Each stand-in passes the reference comparison and the invariants its capabilities allow (context parallelism,
# start positions, thd, partial rotary all go through the adapter's conversion).
PASSING = {
    HF: ["matches_reference", "cp_shards_reassemble", "formats_agree"],
    FLASH: ["matches_reference", "interleaved_is_permuted_half_split", "sequences_independent"],
    LIGER: ["matches_reference", "pass_through_bitwise", "input_not_modified"],
    VLLM: ["matches_reference", "adjoint", "cp_shards_reassemble", "interleaved_is_permuted_half_split"],
}
# One bug each, caught through the adapter by these checks.
CAUGHT = {
    f"hf:{STANDINS}:broken_hf_wrong_sign": "matches_reference",
    f"flash:{STANDINS}:broken_flash_ignores_offsets": "sequences_independent",
    f"vllm:{STANDINS}:broken_vllm_neox_inverted": "interleaved_is_permuted_half_split",
    f"liger:{STANDINS}:broken_liger_positions_ignored": "formats_agree",
}


def _check(name):
    return REFERENCE if name == "matches_reference" else _inv(name)


@pytest.mark.parametrize("spec,name", [(s, n) for s, names in PASSING.items() for n in names],
                         ids=[f"{s.split(':')[0]}-{n}" for s, names in PASSING.items() for n in names])
def test_standin_conforms_through_its_adapter(spec, name):
    failure = falsify(load_target(spec), *_check(name), name=name.encode())
    assert failure is None, f"{spec} {name}: {failure!r}"[:2000]


@pytest.mark.parametrize("spec,name", list(CAUGHT.items()), ids=[s.split(":")[-1] for s in CAUGHT])
def test_broken_standin_is_caught_through_its_adapter(spec, name):
    failure = falsify(load_target(spec), *_check(name), max_examples=30, name=name.encode())
    assert isinstance(failure, AssertionError), f"{spec}: {name} gave {failure!r}"


def test_16_bit_rounding_of_cos_sin_is_why_those_conventions_check_float32_only():
    """cos/sin in t's dtype, as those conventions take them, put a bf16 result outside one rounding: the reason
    their capabilities list float32 only. Lifting the restriction shows it."""
    t = load_target(HF)
    widened = Target(t.name, t.fn, Capabilities(interleaved=False, elementwise_freqs=False), t.convention)
    bf16 = rope_specs(rotation=True, dtypes_=st.just(torch.bfloat16), values=("normal",))
    assert isinstance(falsify(widened, check_matches_reference, bf16, max_examples=20), AssertionError)


def test_calls_outside_the_capabilities_are_rejected_not_failed():
    hf = load_target(HF)
    case = build(make_spec("sbhd", torch.float32, s=3, b=2, h=2, d=8, interleaved=True, angles="rotation"))
    assert hf.caps.lacks(case.t, case.freqs, case.kwargs()) == "no interleaved (GPT-J) pairs"
    case = build(make_spec("sbhd", torch.float32, s=3, b=2, h=2, d=8))  # random angles: pair halves differ
    assert "equal within each pair" in hf.caps.lacks(case.t, case.freqs, case.kwargs())
    case = build(make_spec("thd", torch.float16, h=2, d=8, seqlens=(2, 3), angles="rotation"))
    assert hf.caps.lacks(case.t, case.freqs, case.kwargs()).startswith("float16 not checked")
    assert load_target(FLASH).caps.missing_for("cp_shards_reassemble") == "no context parallelism"
    assert load_target(HF).caps.missing_for("bad_input: freqs too short")
    assert load_target("rope").caps.missing_for("bad_input: freqs too short") is None
    with pytest.raises(pytest.skip.Exception, match="no interleaved"):  # outside Hypothesis: a skip
        case = build(make_spec("bshd", torch.float32, s=2, b=1, h=1, d=4, interleaved=True, angles="rotation"))
        hf(case.t, case.freqs, **case.kwargs())


@pytest.mark.parametrize("fmt,cp", [("sbhd", 1), ("bshd", 2), ("thd", 1), ("thd", 2)])
def test_token_positions_follow_the_contract(fmt, cp):
    """Section 3: j, the dual-chunk map under context parallelism, then start_positions (per sequence)."""
    start = torch.tensor([5, 0, 2])
    if fmt == "thd":
        cu = torch.tensor([0, 4, 4, 8]) * cp  # global lengths 4cp, 0, 4cp: 4 local tokens each
        pos = adapters.token_positions((8, 1, 1), fmt, start, cu, cp, cp - 1)
        if cp == 1:
            assert pos.tolist() == [5, 6, 7, 8, 2, 3, 4, 5]
        else:  # rank 1 of 2: chunks 1 and 2 of each sequence of 8 (4 tokens locally, c = 2)
            assert pos.tolist() == [7, 8, 9, 10, 4, 5, 6, 7]
    else:
        shape = (4, 3, 1, 1) if fmt == "sbhd" else (3, 4, 1, 1)
        pos = adapters.token_positions(shape, fmt, start, None, cp, 0)
        assert pos.shape == (3, 4)
        expect = [0, 1, 2, 3] if cp == 1 else [0, 1, 6, 7]  # rank 0 of 2: chunks 0 and 3 of 8 tokens
        assert pos.tolist() == [[p + s for p in expect] for s in (5, 0, 2)]


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------

def test_conformance_report_of_a_small_run(tmp_path):
    """pytest --rope-impl hf:...:broken_hf_wrong_sign --conformance-report: a pass, a failure with Hypothesis'
    shrunk example, a test the capabilities rule out, and a bad-input rule that does not apply."""
    out = tmp_path / "report.md"
    run = _pytest(f"--rope-impl=hf:{STANDINS}:broken_hf_wrong_sign", f"--conformance-report={out}",
                  "tests/test_invariants.py::test_pair_norms_preserved",
                  "tests/test_invariants.py::test_interleaved_is_permuted_half_split",
                  "tests/test_properties.py::test_matches_float64_reference",
                  "tests/test_bad_input.py::test_rejects_bad_input[freqs too short]",
                  env={"ROPE_MAX_EXAMPLES": "4"})
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    text = out.read_text()
    assert "| pair_norms_preserved | pass (narrowed) |" in text, text
    assert "| interleaved_is_permuted_half_split | n/s: no interleaved (GPT-J) pairs |" in text, text
    assert "| matches_float64_reference | **fail** |" in text, text
    assert "| bad_input: freqs too short | n/s: no argument checks" in text, text
    failure = text.split("## Failures", 1)[1]
    assert "AssertionError: forward" in failure and "spec=Spec(" in failure, failure
    assert "| partial rotary | adapter slices" in text and "| angles | equal pair halves only |" in text


def test_report_as_json(tmp_path):
    class Rep:  # the parts of a pytest TestReport the plugin reads
        def __init__(self, when, outcome, props, longrepr=None):
            self.when, self.nodeid, self.user_properties, self.longrepr = when, "t.py::test_x", props, longrepr
            self.passed, self.skipped, self.failed = (outcome == k for k in ("passed", "skipped", "failed"))
            self.longreprtext = str(longrepr)

    path = tmp_path / "r.json"
    plugin = report.ConformanceReport(str(path), load_target(HF), "cpu-interp")
    plugin.pytest_runtest_logreport(Rep("setup", "passed", [("rope_property", "round_trip")]))
    plugin.pytest_runtest_logreport(Rep("call", "passed", [("rope_property", "round_trip"),
                                                            ("rope_narrowed", {"no interleaved (GPT-J) pairs": 3})]))
    plugin.pytest_runtest_logreport(Rep("teardown", "passed", []))  # no properties: known by nodeid, and passed
    plugin.pytest_sessionfinish(None)
    data = json.loads(path.read_text())
    assert data["impl"] == HF and data["capabilities"]["interleaved"] == "no"
    assert data["results"] == {"round_trip": {"outcome": "pass", "narrowed": {"no interleaved (GPT-J) pairs": 3}}}


def test_counterexample_is_trimmed():
    text = "\n".join(["    def test(): ...", "E       AssertionError: forward: 3 of 8 elements outside",
                      "E       Falsifying example: test(", "E           target=Target('hf'),",
                      "E           spec=Spec(tensor_format='sbhd',", "E            s=2,", "E            seed=0),",
                      "E       )", "E       ", "E       You can reproduce this example by ..."])
    got = report.counterexample(text)
    assert got.splitlines()[0] == "AssertionError: forward: 3 of 8 elements outside"
    assert "Falsifying example: test(target=Target('hf'), spec=Spec(tensor_format='sbhd', s=2, seed=0))" in got
    assert "reproduce" not in got


def test_counterexample_of_several_distinct_failures_keeps_each():
    """Hypothesis reports distinct failures as an exception group behind a gutter: every part keeps its message
    and example (none is an empty entry)."""
    text = "\n".join([
        "  + Exception Group Traceback (most recent call last):",
        "  | ExceptionGroup: Hypothesis found 2 distinct failures. (2 sub-exceptions)",
        "  +-+---------------- 1 ----------------", "    | Traceback (most recent call last):",
        "    | ValueError: big 51", "    | Falsifying example: test_x(", "    |     n=51,", "    | )",
        "    | Explanation:", "    |     These lines were always and only run by failing examples:",
        "    +---------------- 2 ----------------", "    | AssertionError: small 10", "    | assert 10 < 10",
        "    | Falsifying example: test_x(", "    |     n=10,", "    | )", "    +------------------------------------"])
    got = report.counterexample(text).splitlines()
    assert got == ["(1 of 2) ValueError: big 51", "Falsifying example: test_x(n=51)",
                   "(2 of 2) AssertionError: small 10", "Falsifying example: test_x(n=10)"], got


def test_merge_and_splice(tmp_path):
    runs = [{"impl": name, "profile": "gpu", "version": "x 1", "capabilities": Capabilities().table(),
             "results": {"adjoint": {"outcome": "pass"},
                         "round_trip": {"outcome": "fail", "detail": "AssertionError: boom"}}}
            for name in ("te", "liger")]
    text = report.render(runs, unavailable={"vllm": "vLLM is not installed here; install it with: pip install vllm"})
    assert "| property | `te` | `liger` | `vllm` |" in text
    assert "| round_trip | **fail** | **fail** | not installed |" in text and "AssertionError: boom" in text
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{conformance.BEGIN}\nold\n{conformance.END}\nafter\n")
    assert conformance.main(["hf:no_such_module_xyz:f", "--out", str(doc)]) == 0  # nothing to run: one column
    spliced = doc.read_text()
    assert spliced.startswith("intro\n") and spliced.endswith("after\n") and "old" not in spliced
    assert "### Conformance report" in spliced and "no_such_module_xyz" in spliced
