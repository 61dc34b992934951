"""Guards checked in C++: a small CPython extension built once per machine.

A compiled module's guard checks every submodule it went through (the same object, its hooks
empty, its configuration such as a convolution's stride unchanged) and every parameter and
buffer it captured (type, dtype, device, shape, strides, requires_grad) before the graph runs:
2,319 checks for a RegNet-Y. As generated Python that is 183 us a call on this CPU (1.5 ms on
an H100's host, before the first kernel launches); torch's attribute getters alone cost about
0.35 us a tensor. The extension runs a *plan* instead: each access path is one node (an
argument, a constant, an attribute, an item, a call of a weak reference) computed once from an
earlier node, then each check reads a node: identity, value (same type and ``==``), length,
exact type, or a tensor's metadata read from its ``TensorImpl``. The RegNet's guard takes 50 us.

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
#include <algorithm>
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

// Whether ``object`` is a tensor matching ``spec`` (false on anything unexpected).
bool matches(PyObject* object, const Spec& spec) {
  if (reinterpret_cast<PyObject*>(Py_TYPE(object)) != spec.type) return false;
  if (!THPVariable_Check(object)) return false;
  try {
    const at::Tensor& tensor = THPVariable_Unpack(object);
    if (tensor.layout() != c10::kStrided || tensor.scalar_type() != spec.dtype ||
        tensor.device() != spec.device || tensor.requires_grad() != spec.requires_grad) {
      return false;
    }
    c10::IntArrayRef sizes = tensor.sizes();
    c10::IntArrayRef strides = tensor.strides();
    if (sizes.size() != spec.sizes.size()) return false;
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] != spec.sizes[d] || strides[d] != spec.strides[d]) return false;
    }
  } catch (...) {  // symbolic sizes, a tensor without storage: not what was captured
    return false;
  }
  return true;
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
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!matches(PyTuple_GET_ITEM(objects, i), specs->items[i])) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// A guard plan: access paths evaluated from the guard function's arguments (each node one
// step from an earlier node), then checks on the values they reach.
enum NodeKind { kArgument = 0, kConstant = 1, kAttribute = 2, kItem = 3, kCall = 4 };
enum CheckKind { kIs = 0, kEquals = 1, kLength = 2, kTypeIs = 3, kTensor = 4, kSeparate = 5 };

struct Node {
  int kind;
  Py_ssize_t parent;  // (kArgument: the argument's position)
  PyObject* key;      // constant, attribute name or item key (owned; may be null)
};

struct Check {
  int kind;
  Py_ssize_t node;
  PyObject* value;  // kIs: the object; kEquals: the value; kTypeIs/kEquals: type in `type`
  PyObject* type;     // (kSeparate: value is a tuple of nodes, the first `number` written)
  Py_ssize_t number;  // kLength: the length; kTensor: the spec's index
};

struct Plan {
  std::vector<Node> nodes;
  std::vector<Check> checks;
  Specs specs;
  ~Plan() {
    for (auto& node : nodes) Py_XDECREF(node.key);
    for (auto& check : checks) {
      Py_XDECREF(check.value);
      Py_XDECREF(check.type);
    }
  }
};

const char* kPlanName = "kiln.guard_plan";

void destroy_plan(PyObject* capsule) {
  delete static_cast<Plan*>(PyCapsule_GetPointer(capsule, kPlanName));
}

PyObject* owned(PyObject* object) {
  Py_INCREF(object);
  return object;
}

// kSeparate's nodes: a tuple of node numbers, the first `written` of them written.
bool separate_nodes(PyObject* value, Py_ssize_t written, Py_ssize_t nodes) {
  if (!PyTuple_Check(value) || written < 0 || written > PyTuple_GET_SIZE(value)) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(value); ++i) {
    Py_ssize_t node = PyLong_AsSsize_t(PyTuple_GET_ITEM(value, i));
    if (node < 0 || node >= nodes) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

// plan(nodes, checks, specs) -> capsule. nodes: [(kind, parent, key)]; checks: [(kind, node,
// value, type, number)]; specs: what specs() takes, indexed by the tensor checks' numbers.
PyObject* plan(PyObject*, PyObject* args) {
  PyObject *nodes, *checks, *spec_list;
  if (!PyArg_ParseTuple(args, "O!O!O", &PyList_Type, &nodes, &PyList_Type, &checks, &spec_list)) {
    return nullptr;
  }
  PyObject* packed = specs(nullptr, spec_list);
  if (packed == nullptr) return nullptr;
  auto* result = new Plan();
  std::swap(result->specs.items, static_cast<Specs*>(PyCapsule_GetPointer(packed, kName))->items);
  Py_DECREF(packed);
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(nodes); ++i) {
    int kind;
    Py_ssize_t parent;
    PyObject* key;
    if (!PyArg_ParseTuple(PyList_GET_ITEM(nodes, i), "inO", &kind, &parent, &key) ||
        parent < 0 || (kind >= kAttribute && parent >= i)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a node reads a later node");
      delete result;
      return nullptr;
    }
    result->nodes.push_back(Node{kind, parent, owned(key)});
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(checks); ++i) {
    int kind;
    Py_ssize_t node, number;
    PyObject *value, *type;
    PyObject* item = PyList_GET_ITEM(checks, i);
    Py_ssize_t tensors = static_cast<Py_ssize_t>(result->specs.items.size());
    if (!PyArg_ParseTuple(item, "inOOn", &kind, &node, &value, &type, &number) || node < 0 ||
        node >= PyList_GET_SIZE(nodes) || (kind == kTensor && (number < 0 || number >= tensors)) ||
        (kind == kSeparate && !separate_nodes(value, number, PyList_GET_SIZE(nodes)))) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a check reads no node");
      delete result;
      return nullptr;
    }
    result->checks.push_back(Check{kind, node, owned(value), owned(type), number});
  }
  return PyCapsule_New(result, kPlanName, destroy_plan);
}

// The written tensors share no storage with each other or with the others (storages
// without memory never count), as storages_separate() checks in Python.
bool separate(const std::vector<PyObject*>& values, const Check& check) {
  std::vector<uintptr_t> written;
  Py_ssize_t count = PyTuple_GET_SIZE(check.value);
  for (int pass = 0; pass < 2; ++pass) {
    for (Py_ssize_t i = pass ? check.number : 0; i < (pass ? count : check.number); ++i) {
      PyObject* object = values[PyLong_AsSsize_t(PyTuple_GET_ITEM(check.value, i))];
      if (object == nullptr || !THPVariable_Check(object)) return false;
      const at::Tensor& tensor = THPVariable_Unpack(object);
      auto address = tensor.has_storage()
          ? reinterpret_cast<uintptr_t>(tensor.storage().data()) : uintptr_t{0};
      if (address == 0) continue;
      if (pass == 0) {
        written.push_back(address);
      } else if (std::binary_search(written.begin(), written.end(), address)) {
        return false;
      }
    }
    if (pass == 0) {
      std::sort(written.begin(), written.end());
      if (std::adjacent_find(written.begin(), written.end()) != written.end()) return false;
    }
  }
  return true;
}

bool passes(const Plan& plan, const Check& check, PyObject* value) {
  switch (check.kind) {
    case kIs:
      return value == check.value;
    case kEquals: {
      if (reinterpret_cast<PyObject*>(Py_TYPE(value)) != check.type) return false;
      int equal = PyObject_RichCompareBool(value, check.value, Py_EQ);
      if (equal < 0) PyErr_Clear();
      return equal == 1;
    }
    case kLength: {
      Py_ssize_t length = PyObject_Length(value);
      if (length < 0) PyErr_Clear();
      return length == check.number;
    }
    case kTypeIs:
      return reinterpret_cast<PyObject*>(Py_TYPE(value)) == check.type;
    case kTensor:
      return matches(value, plan.specs.items[check.number]);
  }
  return false;
}

// run(capsule, (arguments...)) -> whether every check of the plan passes
PyObject* run(PyObject*, PyObject* args) {
  PyObject* capsule;
  PyObject* arguments;
  if (!PyArg_ParseTuple(args, "OO!", &capsule, &PyTuple_Type, &arguments)) return nullptr;
  auto* plan = static_cast<Plan*>(PyCapsule_GetPointer(capsule, kPlanName));
  if (plan == nullptr) return nullptr;
  std::vector<PyObject*> values(plan->nodes.size(), nullptr);
  bool ok = true;
  for (size_t i = 0; ok && i < plan->nodes.size(); ++i) {
    const Node& node = plan->nodes[i];
    PyObject* value = nullptr;
    switch (node.kind) {
      case kArgument:
        if (node.parent < PyTuple_GET_SIZE(arguments)) {
          value = PyTuple_GET_ITEM(arguments, node.parent);
          Py_INCREF(value);
        }
        break;
      case kConstant:
        value = node.key;
        Py_XINCREF(value);
        break;
      case kAttribute:
        value = PyObject_GetAttr(values[node.parent], node.key);
        break;
      case kItem:
        value = PyObject_GetItem(values[node.parent], node.key);
        break;
      case kCall:
        value = PyObject_CallNoArgs(values[node.parent]);
        break;
    }
    if (value == nullptr) {  // a path that no longer exists: the guard fails
      PyErr_Clear();
      ok = false;
    }
    values[i] = value;
  }
  for (size_t i = 0; ok && i < plan->checks.size(); ++i) {
    const Check& check = plan->checks[i];
    ok = check.kind == kSeparate ? separate(values, check)
                                 : passes(*plan, check, values[check.node]);
  }
  for (PyObject* value : values) Py_XDECREF(value);
  if (ok) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

PyMethodDef kMethods[] = {
    {"specs", specs, METH_O, "Pack tensor specs for check()."},
    {"check", check, METH_VARARGS, "Whether each object matches its packed spec."},
    {"plan", plan, METH_VARARGS, "Pack a guard plan for run()."},
    {"run", run, METH_VARARGS, "Whether a guard plan passes on the guard's arguments."},
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
