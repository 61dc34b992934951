"""Runtime: source -> callables (kernel builds, loading, the on-disk artifact cache).

Input: what ``kiln/codegen`` produced, as the plain data of :mod:`kiln.codegen.sources`
(``CppSource``: a translation unit and its entry points; ``TritonSource``: a module and its
launch signature), the only thing of codegen's the runtime imports; it never generates source
and never sees the loop-level IR. Output: Python callables that take tensors and run
the kernels. Built artifacts are cached on disk under ``kiln.config.config.cache_dir``, keyed
by the source, the flags and the compiler, so a second process never rebuilds them.

- :mod:`kiln.runtime.cpp_build`: ``build`` (g++ -> shared library, cached, loaded with ctypes),
  ``load_kernels`` (one launcher per C++ kernel) and ``cpp_compiler_available``.
- :mod:`kiln.runtime.triton_build`: ``build_triton`` (generated module -> cached file ->
  launcher), ``load_triton_kernels``, ``precompile`` (parallel compiles) and
  ``triton_available``; :mod:`kiln.runtime.triton_launch` (the launcher and its fast paths),
  :mod:`kiln.runtime.triton_interpret` (``interpret_mode``: CPU tensors through Triton's
  interpreter) and :mod:`kiln.runtime.compile_pool` (persistent compile worker processes).
- :mod:`kiln.runtime.autotune`: ``mode="max-autotune"``'s search: every candidate of a kernel
  built, timed at its first launch, the fastest kept; choices cached on disk.
"""

from kiln.runtime.cpp_build import build, cpp_compiler_available, load_kernels
from kiln.runtime.triton_build import (
    build_triton,
    interpret_mode,
    load_triton_kernels,
    precompile,
    triton_available,
)

__all__ = [
    "build",
    "build_triton",
    "cpp_compiler_available",
    "interpret_mode",
    "load_kernels",
    "load_triton_kernels",
    "precompile",
    "triton_available",
]
