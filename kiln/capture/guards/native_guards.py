"""Tensor guards checked in C++: a small CPython extension built once per machine.

A compiled module's guard checks every parameter and buffer it captured (type, dtype, device,
shape, strides, requires_grad) before the graph runs. From Python each check goes through
torch's attribute getters, which build a ``torch.device``, a ``torch.Size`` and a stride tuple:
about 0.35 us a tensor, 95 of the 133 us of a ResNet-50-shaped guard (``benchmarks/
guard_cost.py``), and 0.3-0.5 ms a call on the H100's hosts, all of it before the first kernel
launches. The extension reads the same metadata from each tensor's ``TensorImpl``: one call
checks all of them (about 3.5 us for 268 tensors on the CPU).

The extension is compiled with g++ against the running torch's headers (5-15 s), in a
background thread started by the first guard set with at least ``NATIVE_MIN_TENSORS`` tensor
checks, and cached under ``<cache_dir>/guards/`` by the source, torch and Python versions and
the compiler, so later processes load it at once. Guard sets compiled before it is ready get
their guard function rebuilt when it is (:func:`when_ready`). Without a compiler, headers or a
working build the Python checks stay (logged once under ``guards``). ``KILN_NATIVE_GUARDS=0``
turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kiln.config import config, logger

NATIVE_MIN_TENSORS = 64  # fewer tensor checks stay in Python (small models: a few us)
MODULE = "kiln_native_guards"

SOURCE = r"""
#include <Python.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <cstdint>
#include <vector>

namespace {

// What one tensor must be: its exact Python type, dtype, device, requires_grad, sizes and
// strides (what kiln.capture.guards.guards.TensorMatch checks from Python).
struct Spec {
  PyObject* type;
  c10::ScalarType dtype;
  c10::Device device;
  bool requires_grad;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
};

struct Specs {
  std::vector<Spec> items;
  ~Specs() {
    for (auto& spec : items) Py_XDECREF(spec.type);
  }
};

const char* kName = "kiln.tensor_specs";

void destroy(PyObject* capsule) {
  delete static_cast<Specs*>(PyCapsule_GetPointer(capsule, kName));
}

bool int_tuple(PyObject* tuple, std::vector<int64_t>& out) {
  if (!PyTuple_Check(tuple)) {
    PyErr_SetString(PyExc_TypeError, "sizes and strides must be tuples of ints");
    return false;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(tuple);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
    if (out[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// specs([(type, dtype, device, requires_grad, sizes, strides), ...]) -> capsule
PyObject* specs(PyObject*, PyObject* arg) {
  PyObject* seq = PySequence_Fast(arg, "specs() takes a sequence of tensor specs");
  if (seq == nullptr) return nullptr;
  auto* result = new Specs();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject *type, *dtype, *device, *grad, *sizes, *strides;
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    if (!PyArg_ParseTuple(item, "OOOOOO", &type, &dtype, &device, &grad, &sizes, &strides)) {
      delete result;
      Py_DECREF(seq);
      return nullptr;
    }
    if (!PyType_Check(type) || !THPDtype_Check(dtype) || !THPDevice_Check(device) ||
        !PyBool_Check(grad)) {
      PyErr_SetString(PyExc_TypeError, "a spec is (type, dtype, device, bool, sizes, strides)");
      delete result;
      Py_DECREF(seq);
      return nullptr;
    }
    Spec spec{type, reinterpret_cast<THPDtype*>(dtype)->scalar_type,
              reinterpret_cast<THPDevice*>(device)->device, grad == Py_True, {}, {}};
    if (!int_tuple(sizes, spec.sizes) || !int_tuple(strides, spec.strides)) {
      delete result;
      Py_DECREF(seq);
      return nullptr;
    }
    Py_INCREF(type);
    result->items.push_back(std::move(spec));
  }
  Py_DECREF(seq);
  return PyCapsule_New(result, kName, destroy);
}

// check(capsule, (objects...)) -> whether each object matches its spec
PyObject* check(PyObject*, PyObject* args) {
  PyObject* capsule;
  PyObject* objects;
  if (!PyArg_ParseTuple(args, "OO!", &capsule, &PyTuple_Type, &objects)) return nullptr;
  auto* specs = static_cast<Specs*>(PyCapsule_GetPointer(capsule, kName));
  if (specs == nullptr) return nullptr;
  Py_ssize_t n = PyTuple_GET_SIZE(objects);
  if (static_cast<size_t>(n) != specs->items.size()) Py_RETURN_FALSE;
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* object = PyTuple_GET_ITEM(objects, i);
      const Spec& spec = specs->items[i];
      if (reinterpret_cast<PyObject*>(Py_TYPE(object)) != spec.type) Py_RETURN_FALSE;
      if (!THPVariable_Check(object)) Py_RETURN_FALSE;
      const at::Tensor& tensor = THPVariable_Unpack(object);
      if (tensor.layout() != c10::kStrided || tensor.scalar_type() != spec.dtype ||
          tensor.device() != spec.device || tensor.requires_grad() != spec.requires_grad) {
        Py_RETURN_FALSE;
      }
      c10::IntArrayRef sizes = tensor.sizes();
      c10::IntArrayRef strides = tensor.strides();
      if (sizes.size() != spec.sizes.size()) Py_RETURN_FALSE;
      for (size_t d = 0; d < sizes.size(); ++d) {
        if (sizes[d] != spec.sizes[d] || strides[d] != spec.strides[d]) Py_RETURN_FALSE;
      }
    }
  } catch (...) {  // symbolic sizes, a tensor without storage: not what was captured
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

PyMethodDef kMethods[] = {
    {"specs", specs, METH_O, "Pack tensor specs for check()."},
    {"check", check, METH_VARARGS, "Whether each object matches its packed spec."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "kiln_native_guards", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_kiln_native_guards(void) { return PyModule_Create(&kModule); }
"""

_log = logger("guards")
_lock = threading.Lock()
_module: ModuleType | None = None
_state = "idle"  # idle -> building -> ready | failed
_callbacks: list[Callable[[], None]] = []


def module() -> ModuleType | None:
    """The loaded extension, or None (not built yet, failed, or turned off)."""
    return _module


def pending() -> bool:
    """Whether the extension is being built (or may be): not failed, not turned off."""
    return config.native_guards and _state in ("idle", "building")


def request() -> None:
    """Start building (or loading) the extension in a background thread, once a process."""
    global _state
    with _lock:
        if _state != "idle" or not config.native_guards:
            return
        _state = "building"
    threading.Thread(target=_build_and_load, name="kiln-native-guards", daemon=True).start()


def wait(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for a build in flight (benchmarks time the steady state,
    which a build of 15-20 s on a fresh machine would otherwise straddle); whether the
    extension is loaded."""
    if _state == "building":
        done = threading.Event()
        when_ready(done.set)  # set at once if the build finished meanwhile
        done.wait(timeout)
    return _module is not None


def when_ready(callback: Callable[[], None]) -> None:
    """Call ``callback`` once the extension is loaded (now, when it already is; never, when
    the build failed)."""
    with _lock:
        if _state == "building" or _state == "idle":
            _callbacks.append(callback)
            return
        ready = _state == "ready"
    if ready:
        callback()


def load_now() -> ModuleType | None:
    """Build (or load) the extension in this thread; the loaded module or None (tests)."""
    global _state
    with _lock:
        if _state == "ready":
            return _module
        _state = "building"
    _build_and_load()
    return _module


def _build_and_load() -> None:
    global _module, _state
    try:
        loaded = _load(_build())
    except Exception as error:  # no compiler, no headers, a failed build: Python checks stay
        _log.info("native tensor guards unavailable, checking in Python: %s", error)
        with _lock:
            _state, callbacks = "failed", list(_callbacks)
            _callbacks.clear()
        return
    with _lock:
        _module, _state = loaded, "ready"
        callbacks = list(_callbacks)
        _callbacks.clear()
    for callback in callbacks:
        try:
            callback()
        except Exception as error:  # the entry keeps its Python guard
            _log.info("rebuilding a guard with native tensor checks failed: %s", error)


def _paths() -> tuple[str, str, str]:
    torch_dir = Path(torch.__file__).parent
    include = str(torch_dir / "include")
    return include, str(torch_dir / "lib"), sysconfig.get_paths()["include"]


def _flags() -> list[str]:
    include, lib, python_include = _paths()
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    return [
        "-O2", "-shared", "-fPIC", "-std=c++17", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{python_include}", f"-I{include}", f"-I{include}/torch/csrc/api/include",
        f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10",
    ]  # fmt: skip


def _build() -> Path:
    compiler = shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no g++ on PATH")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = "\n".join([SOURCE, torch.__version__, sys.version, compiler, *_flags()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    directory = Path(config.cache_dir) / "guards"
    target = directory / f"{MODULE}_{digest}{suffix}"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale(directory)
    # this process's own files, renamed into place: concurrent builders never share a file
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".cpp", delete=False) as text:
        text.write(SOURCE)
    source = Path(text.name)
    with tempfile.NamedTemporaryFile(dir=directory, suffix=suffix, delete=False) as partial:
        temporary = Path(partial.name)
    try:
        done = subprocess.run(
            [compiler, str(source), "-o", str(temporary), *_flags()],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"g++ failed on {source}: {done.stderr[-2000:]}")
        os.replace(temporary, target)  # atomic: another process never loads half a library
        os.replace(source, target.with_suffix("").with_suffix(".cpp"))  # readable beside it
    finally:
        temporary.unlink(missing_ok=True)
        source.unlink(missing_ok=True)
    return target


def _remove_stale(directory: Path) -> None:
    """Temporary files of builds whose process exited mid-way (the build runs on a daemon
    thread), older than an hour."""
    cutoff = time.time() - 3600
    for path in directory.glob("tmp*"):
        with contextlib.suppress(OSError):
            if path.stat().st_mtime < cutoff:
                path.unlink()


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    checks: Any = loaded
    probe = torch.zeros(2, 3)
    packed = checks.specs([(type(probe), probe.dtype, probe.device, False, (2, 3), (3, 1))])
    if not checks.check(packed, (probe,)) or checks.check(packed, (probe.t(),)):
        raise RuntimeError(f"{path} gives wrong answers on a probe tensor")
    return loaded
