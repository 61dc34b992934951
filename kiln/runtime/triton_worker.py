"""A compile worker: ``python triton_worker.py JOBS_FILE`` compiles Triton kernels into
Triton's on-disk cache, in a process that imports Triton and nothing else.

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

One line per failed job goes to stdout; the parent logs them, and such a kernel compiles at
its first launch as usual.
"""

from __future__ import annotations

import importlib.util
import json
import sys
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
    triton_compile(source, target=target, options=options.__dict__)


def main(jobs_file: str) -> None:
    with open(jobs_file) as handle:
        jobs = json.load(handle)
    for job in jobs:
        try:
            compile_job(job)
        except Exception as error:  # the parent's first launch compiles it instead
            text = f"{job['path']}: {type(error).__name__}: {error}".replace("\n", " ")
            print(text, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
