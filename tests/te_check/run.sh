#!/usr/bin/env bash
# TransformerEngine's own tests/pytorch/test_fused_rope.py, unmodified, against `rope` (README.md here).
#   TE_SOURCE=/path/to/TransformerEngine bash tests/te_check/run.sh [extra pytest args, e.g. -k thd]
# TE_SOURCE: the root of a TransformerEngine checkout, or a folder holding just the two files needed,
# at TE's paths: transformer_engine/pytorch/attention/rope.py and tests/pytorch/test_fused_rope.py.
# Serial by default (a packed-QKV case needs up to 31.5 GiB of GPU memory). Log: ${OUT:-/tmp}/te_tests.log
# Env: TE_SHARD=i/N   run shard i of N (disjoint, by crc32 of the test id; plugin.py): the whole file
#                     takes ~1.5-2 h serially on an H100
#      TE_WORKERS=n   pytest-xdist with n workers (--dist loadgroup; the > 8 GiB packed-QKV cases run
#                     one at a time): n <= 4 on an 80 GB GPU, n <= 8 on a 141 GB one
#      TE_PEAK_MEM=1  report the largest per-test CUDA memory peaks
set -uo pipefail
if [[ -z "${TE_SOURCE:-}" ]]; then
  echo "te_check: set TE_SOURCE to the root of a TransformerEngine checkout (see tests/te_check/README.md)" >&2
  exit 2
fi
if ! te_root="$(cd "$TE_SOURCE" 2>/dev/null && pwd)"; then
  echo "te_check: TE_SOURCE=$TE_SOURCE is not a folder" >&2
  exit 2
fi
export TE_SOURCE="$te_root"  # absolute: run.sh moves to the repository root next
cd "$(dirname "$0")/../.."  # the repository root: `tests.te_check` and `rope` import from here
TE_TESTS="$TE_SOURCE/tests/pytorch"
TEST_FILE="$TE_TESTS/test_fused_rope.py"
if [[ ! -f "$TEST_FILE" ]]; then
  echo "te_check: $TEST_FILE not found (expected TE's layout: tests/pytorch/test_fused_rope.py)" >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="${OUT:-/tmp}/te_tests.log"
mkdir -p "$(dirname "$LOG")"

# TE's commit: git, where TE_SOURCE is the top of its own checkout; else a TE_COMMIT file there.
te_commit="unknown (no git checkout, no TE_COMMIT file)"
if [[ "$(git -C "$TE_SOURCE" rev-parse --show-toplevel 2>/dev/null)" == "$TE_SOURCE" ]]; then
  te_commit="$(git -C "$TE_SOURCE" rev-parse HEAD)"
elif [[ -f "$TE_SOURCE/TE_COMMIT" ]]; then
  te_commit="$(head -n 1 "$TE_SOURCE/TE_COMMIT")"
fi

# Header; importing the stand-in here turns a wrong TE_SOURCE into one line before pytest starts.
TE_COMMIT_SEEN="$te_commit" python - "$TEST_FILE" <<'PY' 2>&1 | tee "$LOG"
import hashlib
import os
import sys

try:
    from tests.te_check import standin
except Exception as e:
    if type(e).__name__ != "TESourceError":
        raise
    sys.exit(str(e))
import torch
import triton

import rope


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"torch {torch.__version__} | triton {triton.__version__} | {cuda}")
print(f"rope: {os.path.dirname(rope.__file__)}")
print(f"TE commit: {os.environ['TE_COMMIT_SEEN']}")
for path in (standin.te_rope.__file__, sys.argv[1]):
    print(f"TE file: {path} (sha256 {sha(path)}...)")
print(f"TE_SHARD={os.environ.get('TE_SHARD', '')} TE_WORKERS={os.environ.get('TE_WORKERS', '')}")
PY
if [[ ${PIPESTATUS[0]} -ne 0 ]]; then
  exit 2
fi

if [[ -n "${TE_WORKERS:-}" ]]; then
  par=(-n "$TE_WORKERS" --dist loadgroup)
  export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
else
  par=(-p no:xdist)
fi
# --noconftest: neither this repository's conftest.py (--rope-impl, Hypothesis profiles, the CPU
# interpreter switch) nor any of TE's is loaded. -c /dev/null: no pyproject/pytest.ini settings.
# --rootdir = the test file's folder: node ids `test_fused_rope.py::...`, the same for every checkout
# (TE_SHARD depends on them). --import-mode=importlib: TE's tests/ folders stay off sys.path (TE's
# `tests` would otherwise meet this repository's). The stand-in is a plugin so that it is imported
# before TE's test file is collected.
cmd=(python -m pytest -q -p no:cacheprovider "${par[@]}" --noconftest -c /dev/null --rootdir="$TE_TESTS"
     --import-mode=importlib -p tests.te_check.standin -p tests.te_check.plugin -rfE --tb=line
     "$TEST_FILE" "$@")
echo "+ ${cmd[*]}" >>"$LOG"
"${cmd[@]}" >>"$LOG" 2>&1
rc=$?
echo "--- failures and errors per test function:"
grep -E '^(FAILED|ERROR) ' "$LOG" | sed -E 's/^(FAILED|ERROR) [^:]+::([A-Za-z0-9_]+).*/\1 \2/' | sort | uniq -c
echo "--- summary (exit $rc; log $LOG):"
grep -E "(passed|failed|skipped|deselected|error|collected|no tests ran).* in [0-9.]+s" "$LOG" | tail -n 1 \
  | grep . || grep . "$LOG" | tail -n 1  # (-qq --collect-only ends with `test_fused_rope.py: N` instead)
exit "$rc"
