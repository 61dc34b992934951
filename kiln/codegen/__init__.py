"""Codegen: Kernels -> source (the loop-level IR printed for a device).

Input: the fused :class:`~kiln.schedule.loops.Kernel`\\ s of a scheduled program. Output:
sources plus launch signatures (``sources.py``: ``CppSource``, ``TritonSource``) that
``kiln/runtime`` builds and loads, one function per kernel taking the data
pointers of :func:`~kiln.schedule.program.kernel_arguments` (then the seed when the kernel
draws random numbers: an ``int64_t`` in C++, a pointer to it in Triton, so that a CUDA graph's
replay reads a fresh one). Nothing here schedules or fuses: a generator prints what it is given.

- :func:`cpp_library` (``cpp.py``, spellings in ``cpp_math.py``): one C++/OpenMP translation
  unit for CPU tensors, built by :mod:`kiln.runtime.cpp_build`.
- :func:`generate_triton` (``triton.py``, spellings in ``triton_math.py``): one ``@triton.jit``
  function per kernel for CUDA tensors (or, generated for the interpreter, for CPU tensors under
  ``TRITON_INTERPRET=1``), built and launched by :mod:`kiln.runtime.triton_build`.
- ``triton_candidates.py``: the launch shapes ``mode="max-autotune"`` times for a kernel.
- ``signatures.py``: kernels equal but for names are generated once (``deduplicate``).
- ``wrapper.py``: the host program; ``debug.py``: the debug directory's listing of a program.
"""

from kiln.codegen.cpp import cpp_library, generate_cpp
from kiln.codegen.sources import CppSource, TritonSource
from kiln.codegen.triton import generate_triton

__all__ = ["CppSource", "TritonSource", "cpp_library", "generate_cpp", "generate_triton"]
