"""Where Triton put each kernel's binary, so that a later process loads it without asking
Triton's compiler.

Triton's own disk cache is keyed by ``triton_key()``: a hash of the compiler's sources and of
its 500 MB library, which a fresh process computes before it can look anything up (0.7-1.4 s
on the H100 host, and once more in every compile worker). A warm start of ResNet-50 spent
most of its time there. This index maps what a launch compiles (the kernel's source, its
specialization, options, target and environment, and Triton's version and library file) to
the files Triton wrote for it, ``<cache_dir>/triton-index/<key>.json``::

    {"hash": "<Triton's key for the kernel>", "group": {"k.json": "/.../k.json", "k.cubin": ...}}

:func:`install` replaces a generated kernel's ``compile`` (the hook Triton's JIT calls on a
miss in its in-memory cache) with :func:`_compile`: an index hit builds Triton's
``CompiledKernel`` straight from those files; a miss compiles as Triton would and records the
result. An entry whose files are gone (Triton's cache cleared) is a miss. Inside :func:`only`,
a miss raises :class:`NotIndexed` instead of compiling (the caller then sends the kernel to a
compile worker).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from kiln.config import config, logger

_log = logger("kernels")
_state = threading.local()


class NotIndexed(Exception):
    """A kernel the index does not have, met inside :func:`only`."""


@contextlib.contextmanager
def only() -> Iterator[None]:
    """Within: kernels load from the index or raise :class:`NotIndexed` (in this thread)."""
    _state.only = True
    try:
        yield
    finally:
        _state.only = False


def install(module: ModuleType, before_compile: Callable[[], None]) -> None:
    """Route the Triton kernels of a generated ``module`` through the index;
    ``before_compile`` runs before a miss compiles (waiting for this process's warm-up).

    Triton's JIT sets its ``compile`` attribute when it first runs on a device (``self.compile
    = compile`` in ``create_binder``), so the kernel's class becomes a subclass whose
    ``compile`` property keeps what is assigned and returns it wrapped by :func:`_compile`."""
    for function in list(vars(module).values()):
        if hasattr(function, "warmup") and hasattr(function, "create_binder"):  # a JITFunction
            original = vars(function).pop("compile", None)
            function.__class__ = _indexed(type(function))
            function._kiln_before_compile = before_compile
            if original is not None:
                function.compile = original


_INDEXED: dict[type, type] = {}


def _indexed(base: type) -> type:
    if base not in _INDEXED:
        _INDEXED[base] = _indexed_class(base)
    return _INDEXED[base]


def _indexed_class(base: type) -> type:
    def get(self: Any) -> Any:
        original = vars(self).get("_kiln_compile")
        if original is None:
            raise AttributeError("compile")
        return functools.partial(_compile, original, self._kiln_before_compile)

    def set(self: Any, value: Any) -> None:
        vars(self)["_kiln_compile"] = value

    return type(f"Indexed{base.__name__}", (base,), {"compile": property(get, set)})


def _compile(original: Any, before_compile: Callable[[], None], src: Any, **kwargs: Any) -> Any:
    from triton.compiler.compiler import CompiledKernel

    try:
        key = _key(src, kwargs.get("target"), kwargs.get("options"))
    except Exception as error:  # a Triton whose sources lack what the key reads
        _log.info("Triton binary index unusable: %s: %s", type(error).__name__, error)
        key = None
    path = Path(config.cache_dir) / "triton-index" / f"{key}.json"
    if key is not None and path.exists():
        try:
            entry = json.loads(path.read_text())
            return CompiledKernel(src, entry["group"], entry["hash"])
        except Exception as error:  # files gone or damaged: compile again
            _log.info("Triton binary index entry %s unusable: %s", path.name, error)
    if getattr(_state, "only", False):
        raise NotIndexed(key)
    before_compile()
    compiled = original(src, **kwargs)
    group = getattr(compiled, "metadata_group", None)
    if key is not None and isinstance(group, dict):
        _write(path, {"hash": compiled.hash, "group": group})
    return compiled


def _key(src: Any, target: Any, options: dict[str, Any] | None) -> str:
    """What Triton's cache key holds, with the version and library file's identity in place
    of ``triton_key()``."""
    from triton.compiler import compiler  # (where compile() finds it, in every version)

    parts = [
        _library(),
        src.hash(),
        repr(target),
        repr(sorted((options or {}).items())),
        repr(sorted(compiler.get_cache_invalidating_env_vars().items())),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@functools.cache
def _library() -> str:
    """Triton's version and its library files' sizes and times (a rebuild changes them)."""
    import triton

    root = Path(triton.__file__).parent
    files = [*sorted((root / "_C").glob("*.so")), root / "__init__.py"]
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists()]
    return f"{triton.__version__} {stats}"


def _write(path: Path, entry: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(entry, f)
        os.replace(f.name, path)
    except OSError as error:  # a read-only cache: the next process asks Triton again
        _log.info("cannot write the Triton binary index entry %s: %s", path, error)
