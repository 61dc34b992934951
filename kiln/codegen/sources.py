"""What code generation hands the runtime: generated sources and how to launch them.

Plain data, importing nothing of Kiln's: the runtime builds, loads and launches these and
never sees the loop-level IR or a generator (``tests/test_architecture.py`` checks that
``kiln/runtime`` imports nothing else of ``kiln/codegen``, and nothing of ``kiln/schedule``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Form(enum.Enum):
    POINTWISE = "pointwise"
    PERSISTENT = "persistent reduction"
    LOOPED = "looped reduction"
    TEMPLATE = "matmul template"  # a product and its epilogue (codegen/triton_matmul.py)


@dataclass(frozen=True)
class TritonSource:
    """A generated kernel module and how to launch it."""

    name: str  # the @triton.jit function
    kernel_name: str  # the Kernel's name
    source: str
    arguments: tuple[str, ...]  # buffer names, in kernel_arguments() order
    argument_dtypes: tuple[torch.dtype, ...]
    has_seed: bool  # a pointer to the int64 seed follows the tensors (a 1-element tensor)
    constexprs: dict[str, int]  # XBLOCK (and RBLOCK)
    num_warps: int
    grid: tuple[int, int, int]
    form: Form
    interpret: bool
    # Symbolic sizes the kernel takes (int arguments after the pointers and the seed), and
    # then the grid's program count as a Python expression of them ("" when it is ``grid``).
    sizes: tuple[str, ...] = ()
    grid_text: str = ""
    num_stages: int = 0  # software pipelining stages (0: Triton's default)


@dataclass(frozen=True)
class CppEntry:
    """One kernel's function in a C++ library:
    ``name(T0* a0, ..., [int64_t seed], [int64_t size_s0, ...])``."""

    name: str
    argument_count: int  # tensors, in kernel_arguments() order
    has_seed: bool
    checks_indices: bool  # reports a gathered index out of range through kiln_index_error
    sizes: int = 0  # symbolic sizes it takes, after the seed (their values, as int64)


@dataclass(frozen=True)
class CppSource:
    """One C++ translation unit (a graph's kernels) and its kernels' entry points."""

    name: str
    source: str
    entries: tuple[CppEntry, ...]
