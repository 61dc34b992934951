"""Triton's interpreter for CPU tensors: ``interpret_mode()`` runs the kernels defined or
launched inside it on the CPU (``TRITON_INTERPRET=1``), which is how tests and CI check the
generated Triton code without a GPU.

Triton decides between compiling and interpreting when a function is *decorated* and patches
``triton.language`` while an interpreted kernel runs; this module swaps triton.language's own
``@jit`` functions for interpretable ones and restores everything on exit, so compiled GPU
kernels keep working in the same process.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

# Held while the interpreter's patches are in place, and while kernel modules are imported
# (an interpreted module imports under interpret_mode).
LOCK = threading.RLock()


_interpret_depth = 0


@functools.cache
def _library_swaps() -> list[tuple[Any, str, Any, Any]]:
    """``(module, name, jit function, interpreted function)`` for triton.language's own
    ``@jit`` functions (``tl.sum``, ``tl.rand``, ...). Triton picks the interpreter when a
    function is *decorated*, so a process that imported Triton without ``TRITON_INTERPRET=1``
    holds compiled-only versions, which interpreted kernels cannot call."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    interpreted: dict[int, Any] = {}
    swaps = []
    for module in (tl, tl.core, tl.math, tl.standard, tl.random):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in interpreted:
                    interpreted[id(value)] = InterpretedFunction(value.fn)
                swaps.append((module, name, value, interpreted[id(value)]))
    return swaps


def _language_objects() -> list[Any]:
    """What the interpreter patches while kernels run: triton.language's modules and classes."""
    import triton.language as tl

    core = tl.core
    names = ("tensor", "dtype", "condition", "tensor_descriptor_base")
    classes = [getattr(core, name) for name in names if hasattr(core, name)]
    return [tl, core, tl.math, tl.standard, tl.random, *classes]


def _snapshot() -> list[tuple[Any, dict[str, Any]]]:
    return [(obj, dict(vars(obj))) for obj in _language_objects()]


def _restore(snapshot: list[tuple[Any, dict[str, Any]]]) -> None:
    """Undo attribute changes to triton.language. Triton's interpreter restores what a kernel
    launch patches, but a device-function call (``tl.rand``, our helpers) patches
    ``triton.language.core`` for good, which breaks compiling GPU kernels afterwards."""
    for obj, saved in snapshot:
        for name, value in list(vars(obj).items()):
            if name not in saved:
                # a module keeps new globals (the interpreter's rewritten library functions
                # read them later); a class loses patched-in methods
                if not isinstance(obj, ModuleType):
                    delattr(obj, name)
            elif saved[name] is not value:
                setattr(obj, name, saved[name])


@contextmanager
def interpret_mode() -> Iterator[None]:
    """Run Triton kernels defined or launched inside on the CPU interpreter: sets
    ``TRITON_INTERPRET=1``, makes triton.language's library functions interpretable, silences
    numpy's floating-point warnings (masked lanes divide by zero, as on the GPU, silently), and
    on exit restores the environment and everything the interpreter patched."""
    global _interpret_depth
    import numpy as np

    with LOCK:
        if _interpret_depth:
            _interpret_depth += 1
            try:
                yield
            finally:
                _interpret_depth -= 1
            return
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        snapshot = _snapshot()
        for module, name, _, interpreted in _library_swaps():
            setattr(module, name, interpreted)
        _interpret_depth = 1
        try:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                yield
        finally:
            _interpret_depth = 0
            _restore(snapshot)
            if previous is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = previous
