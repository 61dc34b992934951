"""Kernels to launchers, per device: each device's code generator prints its kernels
(``kiln/codegen``) and the runtime builds and loads them (``kiln/runtime``).

``triton`` serves CUDA tensors (and CPU tensors through Triton's interpreter, as in CI),
``cpp`` CPU tensors, ``evaluate`` runs kernels as PyTorch ops (the scheduler's oracle, and
the fallback for a kernel Triton cannot take). Kernels with equal signatures are built once.
A generator that cannot serve this machine raises :class:`Unavailable`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.codegen.cpp import cpp_library
from kiln.codegen.signatures import deduplicate
from kiln.codegen.triton import generate_triton, unsupported_reason
from kiln.codegen.wrapper import Launcher
from kiln.config import logger
from kiln.errors import BackendError
from kiln.runtime.cpp_build import cpp_compiler_available, load_kernels
from kiln.runtime.triton_build import load_triton_kernels, triton_available
from kiln.schedule.evaluate import evaluate_kernel
from kiln.schedule.loops import Kernel
from kiln.schedule.program import kernel_arguments

_log = logger("kernels")

KernelBuilder = Callable[[list[Kernel], torch.device], dict[str, Launcher]]


def _evaluator(kernels: list[Kernel], device: torch.device) -> dict[str, Launcher]:
    def launcher(kernel: Kernel) -> Launcher:
        count = len(kernel_arguments(kernel))

        def launch(*arguments: object) -> None:
            seed = arguments[count] if len(arguments) > count else None
            evaluate_kernel(kernel, arguments[:count], seed)  # type: ignore[arg-type]

        return launch

    return {k.name: launcher(k) for k in kernels}


def _cpp(kernels: list[Kernel], device: torch.device) -> dict[str, Launcher]:
    if not cpp_compiler_available():
        raise Unavailable("no C++ compiler (g++) on PATH: install one for compiled CPU kernels")
    unique, same_as = deduplicate([k for k in kernels if k.xnumel > 0])
    launchers = load_kernels(cpp_library(unique)) if unique else {}
    return {name: launchers[original] for name, original in same_as.items()}


def _triton(kernels: list[Kernel], device: torch.device) -> dict[str, Launcher]:
    interpret = device.type != "cuda"  # CPU tensors: Triton's interpreter (tests, CI)
    reason = triton_available(device, interpret=interpret)
    if reason is not None:
        raise Unavailable(reason)
    unique, same_as = deduplicate([k for k in kernels if k.xnumel > 0])
    supported = [k for k in unique if unsupported_reason(k) is None]
    sources = [generate_triton(kernel, interpret) for kernel in supported]
    launchers = load_triton_kernels(sources, device) if sources else {}
    for kernel in supported:  # (a kernel Triton fails to compile for the GPU: PyTorch ops)
        launcher = launchers.get(kernel.name)
        if hasattr(launcher, "fallback"):
            launcher.fallback = _evaluator([kernel], device)[kernel.name]  # type: ignore[union-attr]
    others = [k for k in unique if k.name not in launchers]
    for kernel in others:  # a dtype Triton cannot load: PyTorch ops run the kernel
        _log.info("%s runs as PyTorch ops: %s", kernel.name, unsupported_reason(kernel))
    launchers.update(_evaluator(others, device))
    return {name: launchers[original] for name, original in same_as.items()}


class Unavailable(BackendError):
    """The code generator cannot serve this machine (warned about once per reason)."""


CODEGENS: dict[str, KernelBuilder] = {"evaluate": _evaluator, "cpp": _cpp, "triton": _triton}


def codegen_for(device: torch.device, forced: str = "") -> str:
    """The code generator serving ``device``: the options may force one (tests route CPU
    tensors through Triton's interpreter); otherwise Triton on CUDA and C++ on CPU."""
    if forced:
        return forced
    if device.type not in ("cuda", "cpu"):
        raise Unavailable(f"no code generator for {device.type} tensors")
    return "triton" if device.type == "cuda" else "cpp"


def build_kernels(
    kernels: list[Kernel], codegen: str = ""
) -> tuple[dict[str, Launcher], list[str]]:
    """Launchers of every kernel, each device's kernels built by that device's generator
    (``codegen`` forces one); also the generators used."""
    launchers: dict[str, Launcher] = {}
    by_device: dict[torch.device, list[Kernel]] = {}
    for kernel in kernels:
        by_device.setdefault(kernel.device, []).append(kernel)
    names = []
    for device, group in by_device.items():
        name = codegen_for(device, codegen)
        if name not in CODEGENS:
            raise BackendError(f"unknown code generator {name!r} (KILN_CODEGEN)")
        names.append(name)
        launchers.update(CODEGENS[name](group, device))
    return launchers, names
