"""A compile worker: ``python triton_worker.py --serve`` compiles Triton kernels into
Triton's on-disk cache, in a process that imports Triton and nothing else. It takes jobs one
JSON line at a time from stdin and answers each on stdout, until stdin closes (the persistent
workers of ``compile_pool.py``).

This file is run by path, never imported as part of ``kiln``: importing the package would
import torch (about 4 s in a fresh process on the H100 machine), which is what made worker
processes slower than threads. Triton alone imports in about 0.1 s, and its compiler does not
need torch or a GPU when it is given the target.

Each job names a generated kernel module (``path``), its ``@triton.jit`` function (``name``),
the GPU ``target`` and the ``specialization`` that Triton itself serialized in the parent
process (through its JIT cache hook, when the kernel's warm-up was about to compile): the
signature, constants, attributes and options that Triton's launch will look up. Compiling
``ASTSource(fn, signature, constants, attributes)`` with those options gives the cache key of
that launch, so the parent's first launch loads the binary instead of compiling it.

After compiling, the worker also builds the kernel's C launcher (older Tritons compile one
with gcc per signature) into the same cache. A failed job's answer carries the error; the
parent logs it and compiles that kernel itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import time
from typing import Any


def _tuples(value: Any) -> Any:
    """JSON gives lists where Triton had tuples (signatures and options take no lists)."""
    if isinstance(value, list):
        return tuple(_tuples(item) for item in value)
    return value


def _constant(value: Any) -> Any:
    import triton.language as tl

    if isinstance(value, str) and tl.dtype.is_dtype(value):
        return tl.dtype(value)
    if isinstance(value, dict) and "constexpr" in value:
        return tl.constexpr(_tuples(value["constexpr"]))
    if isinstance(value, dict):
        raise ValueError(f"cannot decode the constant {value!r}")
    return _tuples(value)


def compile_job(job: dict[str, Any]) -> None:
    """Compile one kernel into Triton's cache (raises on failure)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile
    from triton.compiler.compiler import make_backend

    spec = importlib.util.spec_from_file_location(f"kiln_worker_{job['name']}", job["path"])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    function = getattr(module, job["name"])
    data = json.loads(job["specialization"])
    target = GPUTarget(**(data.get("target") or job["target"]))
    constants = {
        tuple(key): _constant(value)
        for key, value in zip(data["constant_keys"], data["constant_vals"], strict=True)
    }
    # Decoded as Triton's own JITFunction.preload decodes them (the cache key hashes their
    # reprs): attribute values stay lists, options' top-level lists become tuples.
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"], strict=True))
    signature = {key: _tuples(value) for key, value in data["signature"].items()}
    options = make_backend(target).parse_options(
        {key: tuple(v) if isinstance(v, list) else v for key, v in data["options"].items()}
    )
    source = ASTSource(function, signature, constants, attrs)
    compiled = triton_compile(source, target=target, options=options.__dict__)
    _build_launcher(compiled)


def _build_launcher(compiled: Any) -> None:
    """Build the kernel's C launcher into Triton's cache as well, when this Triton builds one
    per signature (before 3.7: a gcc run of about 0.2 s that loading the kernel in the parent
    would otherwise do, holding a compile thread there). Needs no GPU context; skipped when
    this Triton has no such launcher."""
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return
    if not hasattr(driver, "make_launcher"):  # Triton 3.7+: one generic launcher, no gcc
        return
    CudaLauncher = driver.CudaLauncher
    with contextlib.suppress(Exception):  # else the parent builds it when it loads the kernel
        CudaLauncher(compiled.src, compiled.metadata)


def serve(spawned: float, target: dict[str, Any] | None) -> None:
    """``--serve``: one JSON job per line on stdin, one JSON answer per line on stdout
    (``{"seconds": ..., "error": ...}``), until stdin closes (kiln/runtime/compile_pool.py).
    Before the first job it imports Triton's compiler and, given the ``target``, compiles a
    trivial kernel: the first compile of a process initializes LLVM and the backend, and
    doing it while the parent still schedules takes that off the first call."""
    import triton.compiler  # noqa: F401

    with contextlib.suppress(OSError):
        os.nice(5)  # the parent's own thread goes first while both want the CPU
    if target is not None:
        with contextlib.suppress(Exception):  # only a warm-up
            _warm_up(target)
    ready = time.time() - spawned
    for line in sys.stdin:
        if line.strip():
            job = json.loads(line)
            # the parent's cache, as it is now (a long-lived worker may outlive a setting)
            os.environ.update(job.get("env", {}))
            start = time.perf_counter()
            error = _run(job)
            answer = {"seconds": time.perf_counter() - start, "ready": ready}
            sys.stdout.write(json.dumps({**answer, "error": error} if error else answer) + "\n")
            sys.stdout.flush()


def _warm_up(target: dict[str, Any]) -> None:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    @triton.jit
    def kiln_worker_warm_up(pointer):  # type: ignore[no-untyped-def]
        tl.store(pointer, tl.load(pointer) + 1)

    gpu = GPUTarget(**target)
    options = make_backend(gpu).parse_options({"num_warps": 1})
    source = ASTSource(kiln_worker_warm_up, {"pointer": "*fp32"}, {}, {})
    _build_launcher(triton.compile(source, target=gpu, options=options.__dict__))


def _run(job: dict[str, Any]) -> str:
    try:
        compile_job(job)
    except Exception as error:  # the parent's first launch compiles it instead
        return f"{job['path']}: {type(error).__name__}: {error}".replace("\n", " ")
    return ""


if __name__ == "__main__":
    # argv: --serve, the parent's time.time() at the spawn, the GPU target as JSON (or "null")
    serve(float(sys.argv[2]), json.loads(sys.argv[3]))
