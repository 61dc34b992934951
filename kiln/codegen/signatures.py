"""Kernels that differ only in names are built once: a network repeats its blocks.

A kernel's signature is its loop-level listing (:func:`~kiln.schedule.loops.format_kernel`)
with buffers named by argument position and every dtype printed; equal signatures compile to
the same code, so each code generator builds one kernel per signature and binds the others to it.
"""

from __future__ import annotations

from kiln.schedule.loops import Buffer, Kernel, format_kernel
from kiln.schedule.program import kernel_arguments


def kernel_signature(kernel: Kernel) -> str:
    """``kernel``'s structure with names replaced by positions."""
    position = {id(b): i for i, b in enumerate(kernel_arguments(kernel))}

    def name(buffer: Buffer) -> str:
        return f"@{position[id(buffer)]}"

    return format_kernel(kernel, name)


def deduplicate(kernels: list[Kernel]) -> tuple[list[Kernel], dict[str, str]]:
    """The distinct kernels, and each kernel's name -> the name of the one it reuses."""
    unique: dict[str, Kernel] = {}
    same_as: dict[str, str] = {}
    for kernel in kernels:
        key = kernel_signature(kernel)
        same_as[kernel.name] = unique.setdefault(key, kernel).name
    return list(unique.values()), same_as
