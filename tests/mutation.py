"""Mutation testing of rope/ (cosmic-ray's operators) against a fast selection of the CPU suite, a score per file.

    python -m tests.mutation [rope/FILE.py ...] [--jobs N] [--sample K] [--seed S] [--minutes M] [--out mutation.md]
                             [--rerun OLD.json] [--match REGEX] [--tests "PYTEST ARGS"] [--baseline-only]

Files: every .py file under rope/ found at run time, unless named. The tree is copied once per job (`--jobs`,
default 1) to a temporary directory: mutants are written there, never here. cosmic-ray's `init` lists every mutant
of the files (operator, occurrence, position) in a session database; `--sample K` takes K of each file's mutants,
uniformly at random (`--seed`), else all run; `--rerun OLD.json` runs only the survivors of an earlier run (matched
by file, operator and diff), `--match REGEX` only the mutants where it finds 'FILE:LINE OPERATOR LINE-TEXT' (the
line's source). Mutants are queued round-robin over the files, so that a run cut short by `--minutes` (the budget of
the whole run, all jobs) still leaves each file a uniform random sample; a mutant that does not finish in time is
not counted.

Each job is a Python process in its own copy that imports torch, triton, hypothesis and pytest once (most of a
pytest start) and forks per mutant: it writes the mutant into its copy, the child runs the file's SELECTION
(`pytest -x`, ROPE_MAX_EXAMPLES Hypothesis examples per property unless the selection sets it, no shrinking; the
CPU interpreter profile: TRITON_INTERPRET=1, no CUDA device), and the file is restored. Each file's selection
first runs once unmutated (baseline; `--baseline-only`: only that): a file whose baseline fails is reported and its
mutants are not run; its time sets the mutants' timeout (--timeout, default max(60 s, 4 x baseline)).

Outcomes: killed (the selection fails, or the mutant crashes or cannot be imported), timeout, survived (passes),
incompetent (cosmic-ray made no valid Python). Score = (killed + timeout) / (killed + timeout + survived), with a
95 % Wilson interval, since it is a sample. A mutant on a line marked `# pragma: no mutate` (or
`# pragma: no mutate: OPERATOR, ...`, cosmic-ray's names) is a documented equivalent: listed, not run. A survivor
inside a type annotation of a module that never evaluates them (`from __future__ import annotations`) is marked.
Writes --out (markdown: the scores, every survivor with operator, line and diff) and --out with .json (raw results),
both rewritten after each mutant.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = "-x -q -n 0 -p no:cacheprovider"


def nodes(file: str, *tests: str, folder: str = "tests/rope") -> str:
    """Node ids of tests in FOLDER/FILE (a name with its parameters in brackets: that case alone), shell-quoted."""
    return " ".join(shlex.quote(f"{folder}/{file}::{t}") for t in tests)


# Parts of the CPU suite, each quick (seconds to tens of seconds here, through Triton's interpreter), and each
# running the code it is named for. PROPS: the headline property, 16 pinned edge cases (every format, dtype, mode,
# partial rotation, layout) and 3 x ROPE_MAX_EXAMPLES drawn ones, forward and backward against float64, with every
# output element poisoned first.
PROPS = nodes("test_properties.py", "test_matches_float64_reference")
KERNEL = nodes("test_core.py", "test_odd_sizes", "test_program_order_covers_every_row", "test_thd_table_programs",
               "test_empty", "test_output_strides_are_contiguous", "test_thd_many_sequences[table-4-(3, 2)-False]",
               "test_any_strides[interleaved-thd-sliced]", "test_any_strides[halfsplit-bshd-transposed]",
               "test_long_context_angles[torch.bfloat16-thd]", "test_program_index_division_kernel",
               "test_program_index_division_constants")
API = nodes("test_core.py", "test_fused_false_is_reference", "test_signature_matches_transformer_engine",
            "test_freqs_dtype_upcast", "test_value_checks_off_never_reads_past_freqs",
            "test_value_checks_off_tokens_past_the_last_sequence",
            "test_value_checks_run_once_per_unmodified_index_tensor", "test_index_range_is_checked",
            "test_launch_hooks_are_detected", "test_repeated_calls_launch_directly",
            "test_functorch_transforms_refuse_cleanly", "test_more_than_2_pow_31_elements", "test_table_tile_rule")
QK = nodes("test_qk_inplace.py", "test_qk_is_one_launch_each_way", "test_qk_gradient_of_one_output_only",
           "test_qk_bad_pairs", "test_inplace_autograd", "test_inplace_qk", "test_inplace_rejects_overlapping_and_leaf",
           "test_inplace_qk_disjoint_views_of_one_buffer_and_aliasing",
           "test_qk_matches_two_calls_and_float64[table-thd-interleaved-3-3-cp]",
           "test_qk_matches_two_calls_and_float64[evaluated-bshd-interleaved-4-1-start]")
# rope's entry points in the plain conventions: their own tests, and the native properties of hf, flash and vllm
NATIVE_PLAIN = nodes("test_native.py", *(f"test_{prop}[{conv}]" for conv in ("hf", "flash", "vllm")
                                          for prop in ("forward", "backward")), folder="tests/conformance")
CONVENTIONS = f"tests/rope/test_entry_points.py tests/rope/test_conventions_bad_input.py {NATIVE_PLAIN}"
# file -> its selection; a selection may begin with NAME=VALUE settings of the child's environment
SELECTION = {
    "rope/reference.py": "tests/rope/test_reference_meta.py "
                         + nodes("test_core.py", "test_fused_false_is_reference")
                         + " " + nodes("test_entry_points.py", "test_cache_in_place_of_freqs"),
    "rope/_table.py": "tests/rope/test_angle_table.py "
                      + nodes("test_position_table.py", "test_positions_follow_the_spec",
                              "test_position_table_is_reused_and_never_stale",
                              "test_thd_positions_from_the_table[table-(2, 1)-False]",
                              "test_positions_follow_the_spec_for_every_chunk_length")
                      + " " + nodes("test_core.py", "test_value_checks_off_tokens_past_the_last_sequence"),
    "rope/embedding.py": "tests/rope/test_core.py tests/rope/test_entry_points.py -k 'embedding or Embedding'",
    "rope/_checks.py": f"tests/rope/test_bad_input.py {QK} {API} {CONVENTIONS} {PROPS} tests/rope/test_qknorm.py "
                       "tests/rope/test_serving.py "
                       + nodes("test_qk_inplace.py", "test_same_stride_overlap_decision_is_exact")
                       + " " + nodes("test_core.py", "test_empty"),
    "rope/functional.py": f"{API} {QK} {CONVENTIONS} {PROPS}",
    "rope/_backend.py": f"{API} {QK} {PROPS} "
                        + nodes("test_entry_points.py", "test_conventions_launch_the_kernel_only_where_it_runs")
                        + " " + nodes("test_native.py", "test_forward[hf]", folder="tests/conformance")
                        + " " + nodes("test_compile.py", "test_conventions_trace_as_the_reference", "test_opcheck",
                                      "test_compiled_errors_on_bad_input",
                                      "test_fullgraph_matches_eager_and_never_recompiles[interleaved-sbhd]",
                                      "test_fullgraph_matches_eager_and_never_recompiles[halfsplit-thd]"),
    "rope/_request.py": f"{API} {QK} {PROPS}",
    "rope/_launch.py": f"{PROPS} {KERNEL} {API} {QK} "
                       + nodes("test_qknorm.py", "test_apply_freqs_programs_of_one_and_of_several_tiles"),
    "rope/kernels/_common.py": f"{PROPS} {KERNEL} {QK} {CONVENTIONS} tests/rope/test_mrope.py "
                               "tests/rope/test_qknorm.py tests/rope/test_serving.py",
    "rope/kernels/rope.py": f"{PROPS} {KERNEL} {QK} {CONVENTIONS} tests/rope/test_mrope.py",
    "rope/kernels/qknorm.py": "ROPE_MAX_EXAMPLES=20 tests/rope/test_qknorm.py tests/conformance/test_native.py "
                              "-k qknorm",
    "rope/kernels/cache_write.py": "ROPE_MAX_EXAMPLES=20 tests/rope/test_serving.py tests/conformance/test_native.py "
                                   "-k cache",
    "rope/cache.py": f"{CONVENTIONS} -k 'cache or Cache'",
    "rope/hf.py": f"ROPE_MAX_EXAMPLES=20 {CONVENTIONS} tests/rope/test_mrope.py tests/rope/test_hf_forms.py -k hf",
    "rope/flash.py": f"ROPE_MAX_EXAMPLES=20 {CONVENTIONS} -k flash",
    "rope/vllm.py": f"ROPE_MAX_EXAMPLES=20 {CONVENTIONS} tests/rope/test_mrope.py -k vllm",
    "rope/mrope.py": f"ROPE_MAX_EXAMPLES=20 {CONVENTIONS} tests/rope/test_mrope.py -k 'mrope or entry'",
    "rope/meta.py": "ROPE_MAX_EXAMPLES=20 tests/rope/test_meta_bad_input.py tests/conformance/test_native.py -k meta",
    "rope/torchtitan.py": "ROPE_MAX_EXAMPLES=20 tests/rope/test_meta_bad_input.py tests/conformance/test_native.py "
                          "-k torchtitan",
    "rope/qknorm.py": "ROPE_MAX_EXAMPLES=20 tests/rope/test_qknorm.py tests/conformance/test_native.py -k qknorm",
    "rope/megatron.py": "ROPE_MAX_EXAMPLES=20 tests/rope/test_megatron.py tests/rope/test_conventions_bad_input.py "
                        "tests/conformance/test_native.py -k megatron",
    "rope/serving.py": "ROPE_MAX_EXAMPLES=20 tests/rope/test_serving.py tests/conformance/test_native.py -k cache",
    "rope/_memo.py": "tests/rope/test_memo.py tests/rope/test_angle_table.py",
    "rope/_cuda.py": "tests/rope/test_angle_table.py tests/rope/test_memo.py",
}
DEFAULT_TESTS = f"{PROPS} {API} {QK}"  # a file not named above
OUTCOMES = ("killed", "timeout", "survived", "incompetent", "equivalent")


def copy_tree(dst: Path):
    """The files git knows here (tracked, and untracked but not ignored): the tree as it is, without .venv. Where
    there is no git repository (a copy of the tree), everything but hidden folders, caches and builds."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                                capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "dist"))
        return
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)


def list_mutants(tree: Path, files: list[str], db_path: Path) -> dict[str, list]:
    """cosmic-ray `init` into a session database: every mutant of `files`, as (operator, occurrence, line, col)."""
    from cosmic_ray.commands.init import init
    from cosmic_ray.work_db import WorkDB, use_db

    mutants = {f: [] for f in files}
    with use_db(str(db_path), WorkDB.Mode.create) as db:
        init([tree / f for f in files], db, {})
        for item in db.work_items:
            for m in item.mutations:
                rel = Path(m.module_path).relative_to(tree).as_posix()
                mutants[rel].append((m.operator_name, m.occurrence, *m.start_pos))
    return {f: sorted(ms, key=lambda m: (m[2], m[3], m[0], m[1])) for f, ms in mutants.items()}


def mutate(source: str, operator: str, occurrence: int) -> str | None:
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    return mutate_code(source, get_operator(operator)(), occurrence)


def diff_body(a: str, b: str) -> str:
    return "\n".join(ln for ln in difflib.unified_diff(a.splitlines(), b.splitlines(), n=0, lineterm="")
                     if ln[:1] in "+-" and not ln.startswith(("+++", "---")))


def pragma_equivalent(line: str, operator: str) -> bool:
    m = re.search(r"pragma: no mutate(?::\s*([\w/, ]+))?", line)
    return bool(m) and (not m.group(1) or operator in {s.strip() for s in m.group(1).split(",")})


def annotation_spans(source: str) -> list[tuple]:
    """(start, end) positions of the type annotations of a module that never evaluates them (`from __future__
    import annotations`): a mutant there is equivalent unless something reads them (torch.library.custom_op does)."""
    if "from __future__ import annotations" not in source:
        return []
    spans = []
    for n in ast.walk(ast.parse(source)):
        for a in ([n.returns] if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) else []) + \
                ([n.annotation] if isinstance(n, (ast.arg, ast.AnnAssign)) else []):
            if a is not None:
                spans.append(((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)))
    return spans


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return math.nan, math.nan
    p, d = k / n, 1 + z * z / n
    c, h = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


# ---- a job: a process in its own copy of the tree that imported the heavy modules once, forks per run ----------
def serve():
    """Job side (`--serve`): reads one JSON request a line (file, code or null, args, timeout, log), writes a reply."""
    import hypothesis  # noqa: F401
    import numpy  # noqa: F401
    import pytest
    import torch  # noqa: F401
    import triton  # noqa: F401
    import triton.language  # noqa: F401

    for line in sys.stdin:
        req = json.loads(line)
        path = Path(req["file"])
        original = path.read_text()
        if req["code"] is not None:
            path.write_text(req["code"])
        t0 = time.monotonic()
        try:
            rc = run_forked(pytest, req["args"], req["env"], req["timeout"], req["log"])
        finally:
            path.write_text(original)
        print(json.dumps({"rc": rc, "seconds": time.monotonic() - t0}), flush=True)


class NoShrink:
    """pytest plugin: Hypothesis stops at the first failing example (no shrinking): the mutant is killed all the
    same, and a shrink can take minutes of interpreted launches. The profile keeps its name (tests/rope/strategies.py
    sizes shapes by it)."""

    @staticmethod
    def pytest_configure(config):
        from hypothesis import Phase, settings

        name = settings.get_current_profile_name() if hasattr(settings, "get_current_profile_name") \
            else settings._current_profile
        settings.register_profile(name, settings.get_profile(name),
                                  phases=[Phase.explicit, Phase.reuse, Phase.generate])
        settings.load_profile(name)


def run_forked(pytest, args: list[str], env: dict, timeout: float, log: str) -> int | None:
    """pytest.main(args) in a forked child of its own session, with `env` added to its environment; its exit code
    (negative: a signal), or None when it ran past `timeout` seconds."""
    pid = os.fork()
    if pid == 0:
        rc = 70
        try:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.environ.update(env)
            rc = int(pytest.main(args, plugins=[NoShrink()]))
        except BaseException:  # noqa: B036 - the child must reach os._exit whatever happens
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    end = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.killpg(pid, signal.SIGKILL)  # the child and whatever it started, nothing else
            os.waitpid(pid, 0)
            return None
        time.sleep(0.05)


class Job:
    def __init__(self, tree: Path, max_examples: int):
        env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1",
                   ROPE_MAX_EXAMPLES=str(max_examples), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
                   TRITON_CACHE_DIR=str(tree / ".cache" / "triton"),
                   TORCHINDUCTOR_CACHE_DIR=str(tree / ".cache" / "inductor"))
        env.pop("HYPOTHESIS_PROFILE", None)  # conftest: cpu-interp without a CUDA device
        self.tree = tree
        (tree / ".cache").mkdir(exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.mutation", "--serve"], cwd=tree, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, file: str, code: str | None, tests: str, timeout: float) -> dict:
        words = shlex.split(f"{tests} {PYTEST}")  # a selection may begin with NAME=VALUE settings, as in a shell
        env = dict(w.split("=", 1) for w in words if re.match(r"[A-Z_]+=", w))
        req = dict(file=file, code=code, args=[w for w in words if not re.match(r"[A-Z_]+=", w)], env=env,
                   timeout=timeout, log=str(self.tree / ".cache" / "pytest.log"))
        (self.tree / ".cache" / "pytest.log").unlink(missing_ok=True)
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"mutation job in {self.tree} ended (exit {self.proc.wait()})")
        out = json.loads(reply)
        log_file = self.tree / ".cache" / "pytest.log"
        log = log_file.read_text(errors="replace").strip().splitlines() if log_file.exists() else []
        out["tail"] = [ln for ln in log if ln.startswith(("FAILED", "ERROR"))][:3] + log[-1:]
        return out

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


# ---- the campaign --------------------------------------------------------------------------------------------
class Campaign:
    def __init__(self, args, files: list[str], work: Path):
        self.args, self.files, self.work = args, files, work
        self.t0 = time.monotonic()
        self.deadline = self.t0 + 60 * args.minutes if args.minutes else math.inf
        self.lock = threading.Lock()
        self.results: list[dict] = []
        self.info: dict[str, dict] = {}
        self.queue: list[tuple] = []
        self.baselines: list[str] = []  # files whose unmutated selection is still to run
        self.ready: dict[str, threading.Event] = {}
        self.annotations: dict[str, list] = {}

    def tests(self, f: str) -> str:
        return self.args.tests or SELECTION.get(f, DEFAULT_TESTS)

    def plan(self, mutants: dict[str, list], sources: dict[str, str]):
        rerun = None
        if self.args.rerun:
            old = json.loads(Path(self.args.rerun).read_text())["results"]
            rerun = {(r["file"], r["operator"], r["diff"]) for r in old if r["outcome"] == "survived"}
            rerun_ops = {(f, op) for f, op, _ in rerun}
        per_file = []
        for f in self.files:
            lines = sources[f].splitlines()
            chosen, equivalent = [], []
            for op, occ, line, col in mutants[f]:
                (equivalent if pragma_equivalent(lines[line - 1], op) else chosen).append((f, op, occ, line, col))
            if self.args.match:
                chosen = [m for m in chosen
                          if re.search(self.args.match, f"{f}:{m[3]} {m[1]} {lines[m[3] - 1].strip()}")]
            if rerun is not None:
                chosen = [m for m in chosen if (f, m[1]) in rerun_ops and
                          (f, m[1], diff_body(sources[f], mutate(sources[f], m[1], m[2]) or "")) in rerun]
            rng = random.Random(f"{self.args.seed}:{f}")  # a file's sample does not depend on the other files
            if self.args.sample and len(chosen) > self.args.sample:
                chosen = rng.sample(chosen, self.args.sample)
            rng.shuffle(chosen)
            self.info[f] = dict(mutants=len(mutants[f]), sampled=len(chosen), tests=self.tests(f))
            self.results += [dict(file=f, operator=m[1], occurrence=m[2], line=m[3], outcome="equivalent",
                                  diff=diff_body(sources[f], mutate(sources[f], m[1], m[2]) or ""))
                             for m in equivalent]
            per_file.append(chosen)
            self.annotations[f] = annotation_spans(sources[f])
        # round-robin over files: a cut at the deadline leaves each file a uniform sample of its own
        for rnd in range(max(map(len, per_file), default=0)):
            self.queue += [ms[rnd] for ms in per_file if rnd < len(ms)]
        self.queue.reverse()  # popped from the end
        self.baselines = [f for f, ms in zip(self.files, per_file, strict=True) if ms or self.args.baseline_only]
        if self.args.baseline_only:
            self.queue = []
        self.ready = {f: threading.Event() for f in self.baselines}

    def baseline(self, job: Job, f: str):
        r = dict(rc="(the job ended)", seconds=0.0, tail=[])
        try:
            r = job.run(f, None, self.tests(f), min(self.args.baseline_timeout, self.deadline - time.monotonic()))
        finally:  # also when the job failed: the file's mutants are then not run
            ok = r["rc"] == 0
            with self.lock:
                self.info[f].update(baseline_ok=ok, baseline_rc=r["rc"], baseline_s=round(r["seconds"], 1),
                                    baseline_tail=[] if ok else r["tail"],
                                    timeout_s=round(self.args.timeout or max(60.0, 4 * r["seconds"])))
                self.write()
            self.ready[f].set()
        print(f"baseline {f}: {'ok' if ok else 'FAILED'} (exit {r['rc']}) in {r['seconds']:.1f} s", flush=True)

    def worker(self, job: Job, sources: dict[str, str]):
        while True:
            with self.lock:
                f = self.baselines.pop(0) if self.baselines else None
            if f:
                self.baseline(job, f)
                continue
            with self.lock:
                if not self.queue:
                    return
                f, op, occ, line, col = self.queue.pop()
            self.ready[f].wait()  # its baseline may be running in another job
            info = self.info[f]
            left = self.deadline - time.monotonic()
            if not info["baseline_ok"] or left < info["baseline_s"]:
                continue  # not run: a failing baseline, or no time left for it
            with self.lock:  # parso, in cosmic-ray, is not known to be thread-safe
                code = mutate(sources[f], op, occ)
            res = dict(file=f, operator=op, occurrence=occ, line=line, col=col,
                       diff=diff_body(sources[f], code) if code else "",
                       in_annotation=any(tuple(a) <= (line, col) < tuple(b) for a, b in self.annotations[f]))
            try:
                compile(code or "", f, "exec")
            except SyntaxError:
                code = None
            if code is None:
                res.update(outcome="incompetent")
            else:
                r = job.run(f, code, info["tests"], min(info["timeout_s"], left))
                if r["rc"] is None and left < info["timeout_s"]:
                    continue  # stopped by the budget, not by its own timeout: not counted
                res.update(outcome="timeout" if r["rc"] is None else "survived" if r["rc"] == 0 else "killed",
                           rc=r["rc"], seconds=round(r["seconds"], 1), tail=r["tail"])
            with self.lock:
                self.results.append(res)
                self.write()
            print(f"{res['outcome']:>11} {f}:{line} {op}", flush=True)

    def run(self, sources: dict[str, str]):
        trees = [self.work / f"job{i}" for i in range(self.args.jobs)]
        for t in trees[1:]:
            shutil.copytree(trees[0], t)
        jobs = [Job(t, self.args.max_examples) for t in trees]
        threads = [threading.Thread(target=self.worker, args=(j, sources)) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for j in jobs:
            j.close()
        with self.lock:
            self.write()

    # ---- report ----
    def write(self):
        out, elapsed = Path(self.args.out), time.monotonic() - self.t0
        raw = dict(args={k: v for k, v in vars(self.args).items() if k != "files"}, elapsed_s=round(elapsed),
                   files=self.info, results=self.results)
        out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
        out.write_text(self.render(elapsed))

    @staticmethod
    def score(results: list) -> float | None:
        n = sum(r["outcome"] in ("killed", "timeout", "survived") for r in results)
        return 1 - sum(r["outcome"] == "survived" for r in results) / n if n else None

    def row(self, name: str, results: list, info: dict, note: str = "") -> str:
        """A line of the table."""
        c = {k: sum(r["outcome"] == k for r in results) for k in OUTCOMES}
        n = c["killed"] + c["timeout"] + c["survived"]
        secs = [r["seconds"] for r in results if "seconds" in r]
        lo, hi = wilson(n - c["survived"], n)
        text = f"{self.score(results):.1%}{note} [{lo:.0%}, {hi:.0%}]" if n else "-"
        if not info.get("baseline_ok", True):
            text = f"baseline failed (exit {info['baseline_rc']}): {'; '.join(info['baseline_tail'])}"
        cells = [name, info.get("mutants", "?"), info.get("sampled", "?"), n + c["incompetent"],
                 *(c[k] for k in OUTCOMES), text, info.get("baseline_s", ""),
                 f"{sum(secs) / len(secs):.1f}" if secs else ""]
        return "| " + " | ".join(map(str, cells)) + " |"

    def render(self, elapsed: float) -> str:
        a = self.args
        run_n = sum(r["outcome"] != "equivalent" for r in self.results)
        how = (f"the survivors of `{a.rerun}`" if a.rerun else
               f"a seeded random sample of up to {a.sample} per file (seed {a.seed})" if a.sample else "every mutant")
        lines = [f"Mutants: {how}{f', matching `{a.match}`' if a.match else ''}; {a.jobs} jobs, "
                 f"{elapsed / 60:.1f} min{f' of a {a.minutes}-minute budget' if a.minutes else ''}; {run_n} run "
                 f"({60 * run_n / max(elapsed, 1):.0f} a minute); ROPE_MAX_EXAMPLES={a.max_examples} unless the "
                 "selection sets it, CPU interpreter profile. Score = (killed + timeout) / (killed + timeout + "
                 "survived), 95 % Wilson interval.", "",
                 "| file | mutants | sampled | run | killed | timeout | survived | incompetent | equivalent (pragma) "
                 "| score [95 % CI] | s baseline | s per mutant |", "|" + "---|" * 12]
        weighted = []  # (mutants in the file, its score): the total estimated as if every file were run whole
        for f in self.files:
            results = [r for r in self.results if r["file"] == f]
            lines.append(self.row(f"`{f}`", results, self.info.get(f, {})))
            if self.score(results) is not None:
                weighted.append((self.info[f]["mutants"], self.score(results)))
        total = dict(mutants=sum(i["mutants"] for i in self.info.values()),
                     sampled=sum(i["sampled"] for i in self.info.values()))
        note = f" (weighted by mutants per file: {sum(m * s for m, s in weighted) / sum(m for m, _ in weighted):.1%})" \
            if weighted else ""
        lines.append(self.row("all (pooled)", self.results, total, note))
        for f in self.files:
            for kind, title in (("survived", "Survivors"), ("equivalent", "Documented equivalents")):
                rs = sorted((r for r in self.results if r["file"] == f and r["outcome"] == kind),
                            key=lambda r: (r["line"], r["operator"], r["occurrence"]))
                lines += ["", f"{title} in `{f}`:", ""] if rs else []
                for r in rs:
                    note = " (in a type annotation, never evaluated in this module)" if r.get("in_annotation") else ""
                    lines += [f"- line {r['line']}, {r['operator']} (occurrence {r['occurrence']}){note}:", "",
                              "  ```diff", *("  " + ln for ln in r["diff"].splitlines()), "  ```"]
        lines += ["", "Selections (pytest arguments, with `-x -q -n 0`):", ""]
        lines += [f"- `{f}`: `{self.info[f]['tests']}`" for f in self.files if f in self.info]
        return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutation", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", help="files of rope/ (default: every .py under rope/)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run in parallel, each job in its own copy")
    parser.add_argument("--sample", type=int, default=None, help="K mutants per file, uniformly at random")
    parser.add_argument("--seed", type=int, default=0, help="of the sample and of the order")
    parser.add_argument("--minutes", type=float, default=None, help="budget of the whole run, all jobs")
    parser.add_argument("--rerun", default=None, help="run only the survivors of this earlier JSON result")
    parser.add_argument("--match", default=None, help="only mutants where it finds 'FILE:LINE OPERATOR LINE-TEXT'")
    parser.add_argument("--tests", default=None, help="pytest arguments for every file (default: SELECTION)")
    parser.add_argument("--out", default="mutation.md", help="markdown report; raw results beside it, .json")
    parser.add_argument("--timeout", type=float, default=None, help="seconds a mutant (default: max(60, 4 x baseline))")
    parser.add_argument("--baseline-timeout", type=float, default=600.0, help="seconds for a file's unmutated run")
    parser.add_argument("--max-examples", type=int, default=5, help="Hypothesis examples per property")
    parser.add_argument("--baseline-only", action="store_true", help="only time each file's unmutated selection")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return 0
    files = args.files or sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "rope").rglob("*.py"))
    with tempfile.TemporaryDirectory(prefix="rope-mutation-") as tmp:
        work = Path(tmp)
        copy_tree(work / "job0")
        sources = {f: (work / "job0" / f).read_text() for f in files}
        campaign = Campaign(args, files, work)
        campaign.plan(list_mutants(work / "job0", files, work / "session.sqlite"), sources)
        print(f"{len(campaign.queue)} mutants to run over {len(files)} files, {args.jobs} jobs", flush=True)
        campaign.run(sources)
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
