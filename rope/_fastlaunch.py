"""A lean launch of an already compiled kernel: one C call that fills in the pointer arguments of a
parameter block prepared once per plan, and calls `cuLaunchKernel`.

Why: on the H200's host Triton's own launcher costs about 5.7 µs per call for these kernels
(`torch.clone` of a small tensor costs 6.4 µs in all), because every call goes through a Python
method, parses ~40 arguments (17 of them constexprs it then ignores), asks each tensor for its
`data_ptr` and asks the driver whether each pointer is a device pointer (BENCHMARKS.md, note 18).
All of that is fixed per plan except the pointers.

The C module is built on first use with the C compiler and Python headers that Triton's own
launcher needs, and cached under `~/.cache/rope` (or ROPE_CACHE_DIR). It is used only where it
provably matches the compiled kernel: the driver's own description of the kernel's parameters
(`cuFuncGetParamInfo`, CUDA 12.4+) must agree in count and size with the arguments Triton
compiled it for, and the kernel must need nothing beyond a plain launch (one CTA per program, no
cooperative or programmatic-dependent launch, no scratch memory). Anywhere else, or if the
module cannot be built, or with ROPE_FAST_LAUNCH=0, calls go through Triton's launcher as before.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef CUresult (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             void *, void **, void **);
typedef CUresult (*param_info_t)(void *, size_t, size_t *, size_t *);
typedef CUresult (*ctx_get_t)(void **);
typedef CUresult (*error_string_t)(CUresult, const char **);

static launch_t cu_launch;
static param_info_t cu_param_info;
static ctx_get_t cu_ctx_get;
static error_string_t cu_error_string;

#define MAX_SLOTS 64

/* init(): resolve the driver entry points (not at import, so the module loads without a GPU). */
static PyObject *init(PyObject *self, PyObject *unused) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    PyErr_Format(PyExc_OSError, "cannot open libcuda.so.1: %s", dlerror());
    return NULL;
  }
  cu_launch = (launch_t)dlsym(lib, "cuLaunchKernel");
  cu_param_info = (param_info_t)dlsym(lib, "cuFuncGetParamInfo");
  cu_ctx_get = (ctx_get_t)dlsym(lib, "cuCtxGetCurrent");
  cu_error_string = (error_string_t)dlsym(lib, "cuGetErrorString");
  if (!cu_launch || !cu_param_info || !cu_ctx_get || !cu_error_string) {
    PyErr_SetString(PyExc_OSError, "libcuda.so.1 lacks cuLaunchKernel, cuFuncGetParamInfo (CUDA 12.4+), "
                                   "cuCtxGetCurrent or cuGetErrorString");
    return NULL;
  }
  Py_RETURN_NONE;
}

/* param_sizes(function) -> [bytes of each of the kernel's parameters, in order] */
static PyObject *param_sizes(PyObject *self, PyObject *arg) {
  if (!cu_param_info) {
    PyErr_SetString(PyExc_RuntimeError, "param_sizes: call init() first");
    return NULL;
  }
  void *f = PyLong_AsVoidPtr(arg);
  if (PyErr_Occurred()) return NULL;
  PyObject *out = PyList_New(0);
  if (!out) return NULL;
  for (size_t i = 0; i <= MAX_SLOTS; i++) {
    size_t offset = 0, size = 0;
    if (cu_param_info(f, i, &offset, &size) != 0) break;
    PyObject *v = PyLong_FromSize_t(size);
    if (!v || PyList_Append(out, v) < 0) { Py_XDECREF(v); Py_DECREF(out); return NULL; }
    Py_DECREF(v);
  }
  return out;
}

/* launch(function, grid, threads, shared, stream, slots, *pointers) -> bool
   slots: bytes, one 8-byte little-endian slot per kernel parameter (a 4-byte parameter is read
   from the first half of its slot); the pointers replace the first len(pointers) slots. Launches
   a 1-D grid and returns True; returns False, launching nothing, if the calling thread has no
   current CUDA context (the caller then takes a launcher that sets one up). */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (!cu_launch) {
    PyErr_SetString(PyExc_RuntimeError, "launch: call init() first");
    return NULL;
  }
  if (nargs < 6 || !PyBytes_Check(args[5])) {
    PyErr_SetString(PyExc_TypeError, "launch(function, grid, threads, shared, stream, slots: bytes, *pointers)");
    return NULL;
  }
  void *f = PyLong_AsVoidPtr(args[0]);
  unsigned long grid = PyLong_AsUnsignedLong(args[1]);
  unsigned long threads = PyLong_AsUnsignedLong(args[2]);
  unsigned long shared = PyLong_AsUnsignedLong(args[3]);
  void *stream = PyLong_AsVoidPtr(args[4]);
  if (PyErr_Occurred()) return NULL;
  Py_ssize_t size = PyBytes_GET_SIZE(args[5]);
  Py_ssize_t n = size / 8, n_pointers = nargs - 6;
  if (size % 8 != 0 || n > MAX_SLOTS || n_pointers > n) {
    PyErr_SetString(PyExc_ValueError, "launch: slots must be whole 8-byte slots, at most 64, one per pointer at least");
    return NULL;
  }
  uint64_t slots[MAX_SLOTS];
  void *params[MAX_SLOTS];
  memcpy(slots, PyBytes_AS_STRING(args[5]), (size_t)size);
  for (Py_ssize_t i = 0; i < n_pointers; i++) slots[i] = PyLong_AsUnsignedLongLong(args[6 + i]);
  if (PyErr_Occurred()) return NULL;
  for (Py_ssize_t i = 0; i < n; i++) params[i] = &slots[i];
  void *ctx = NULL;
  if (cu_ctx_get(&ctx) != 0 || ctx == NULL) Py_RETURN_FALSE;
  if (grid == 0) Py_RETURN_TRUE;
  CUresult err = cu_launch(f, (unsigned)grid, 1, 1, (unsigned)threads, 1, 1, (unsigned)shared, stream, params, NULL);
  if (err != 0) {
    const char *msg = NULL;
    cu_error_string(err, &msg);
    PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel failed: %s (CUresult %d)", msg ? msg : "unknown error", err);
    return NULL;
  }
  Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
  {"init", init, METH_NOARGS, "resolve the CUDA driver entry points"},
  {"param_sizes", param_sizes, METH_O, "sizes of a CUfunction's parameters"},
  {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "launch a 1-D grid with prepared parameters"},
  {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "rope_fastlaunch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_rope_fastlaunch(void) { return PyModule_Create(&module); }
"""

_MODULE_NAME = "rope_fastlaunch"
_STATE: dict = {}  # "module": the loaded C module (initialised), or None; "reason": why not


def _cache_dir() -> str:
    return os.environ.get("ROPE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "rope")


def _compiler():
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build() -> str:
    """Path of the compiled C module, building it if this machine has none cached yet (raises if
    it cannot be built)."""
    key = hashlib.sha256((_SOURCE + sys.version + sysconfig.get_platform()).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"{_MODULE_NAME}_{key}{sysconfig.get_config_var('EXT_SUFFIX')}")
    if os.path.exists(path):
        return path
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    os.makedirs(_cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
        src = os.path.join(tmp, "launch.c")
        with open(src, "w") as f:
            f.write(_SOURCE)
        so = os.path.join(tmp, "launch.so")
        include = sysconfig.get_paths()["include"]
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{include}", src, "-o", so, "-ldl"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(so, path)  # atomic: concurrent builders (pytest-xdist workers) all end with one file
    return path


def load(path: str):
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def module():
    """The initialised C module, or None (then `reason()` says why); built and loaded once."""
    if "module" not in _STATE:
        _STATE["module"], _STATE["reason"] = None, ""
        if os.environ.get("ROPE_FAST_LAUNCH", "1") == "0":
            _STATE["reason"] = "switched off (ROPE_FAST_LAUNCH=0)"
        else:
            try:
                mod = load(build())
                mod.init()
                _STATE["module"] = mod
            except Exception as exc:  # no compiler, no headers, no driver: Triton's launcher instead
                _STATE["reason"] = f"{type(exc).__name__}: {exc}"
    return _STATE["module"]


def reason() -> str:
    """Why the lean launch is not in use ("" if it is, or has not been tried yet)."""
    return _STATE.get("reason", "")


_SIZES = {"i1": 4, "i8": None, "i16": None, "i32": 4, "u1": 4, "u32": 4, "i64": 8, "u64": 8}


def slots(types: list, sizes: list, n_pointers: int, values: list):
    """The parameter block for `launch`, or None where it cannot describe the kernel.

    types: Triton's type of each argument the kernel takes as a parameter, in order ("*bf16",
    "i32", ...); values: those arguments' values (pointers' are filled in per call); sizes: the
    driver's size of every parameter, which may add trailing scratch pointers (passed as null).
    """
    if len(values) != len(types) or len(sizes) < len(types) or len(sizes) - len(types) > 2 or len(sizes) > 64:
        return None
    block = bytearray()
    for i, (ty, size, value) in enumerate(zip(types, sizes[:len(types)], values, strict=True)):
        want = 8 if ty.startswith("*") else _SIZES.get(ty)
        if want is None or want != size or (i < n_pointers) != ty.startswith("*"):
            return None
        if i < n_pointers:
            value = 0
        if not isinstance(value, int):
            return None
        block += struct.pack("<Q", value & ((1 << (8 * size)) - 1))
    for size in sizes[len(types):]:  # Triton's global and profile scratch pointers
        if size != 8:
            return None
        block += bytes(8)
    return bytes(block)


def prepare(compiled, arg_names: list, n_pointers: int, scalars: tuple):
    """(launch, function, threads, shared, slots) for launching `compiled` through the C module,
    or None where only Triton's launcher may launch it (see the module docstring)."""
    mod = module()
    if mod is None:
        return None
    md = compiled.metadata
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "launch_pdl", False) or getattr(md, "global_scratch_size", 0)
            or getattr(md, "profile_scratch_size", 0)
            or tuple(getattr(md, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) not in ((1, 1, 1), (1,), ())):
        return None
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(signature, dict) or list(signature) != list(arg_names):
        return None
    values = [0] * n_pointers + list(scalars)
    if len(values) != len(signature):
        return None
    taken = [(ty, v) for ty, v in zip(signature.values(), values, strict=True) if ty != "constexpr"]
    if any(not isinstance(ty, str) for ty, _ in taken):
        return None
    block = slots([ty for ty, _ in taken], mod.param_sizes(compiled.function), n_pointers, [v for _, v in taken])
    if block is None:
        return None
    return mod.launch, compiled.function, 32 * md.num_warps, md.shared, block
