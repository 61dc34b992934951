"""Kernels to launchers, per device: each device's code generator prints its kernels
(``kiln/codegen``) and the runtime builds and loads them (``kiln/runtime``).

``triton`` serves CUDA tensors (and CPU tensors through Triton's interpreter, as in CI),
``cpp`` CPU tensors, ``evaluate`` runs kernels as PyTorch ops (the scheduler's oracle, and
the fallback for a kernel Triton cannot take). Kernels with equal signatures are built once.
A generator that cannot serve this machine raises :class:`Unavailable`. Under
``mode="max-autotune"`` each Triton kernel is generated once per candidate launch shape
(``kiln/codegen/triton_candidates.py``) and the runtime picks one (``kiln/runtime/autotune.py``).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kiln.codegen.cpp import cpp_library
from kiln.codegen.signatures import deduplicate, kernel_signature
from kiln.codegen.triton import generate_triton, unsupported_reason
from kiln.codegen.triton_candidates import candidate_blocks
from kiln.codegen.wrapper import Launcher
from kiln.config import logger
from kiln.errors import BackendError
from kiln.runtime.autotune import TuningJob, TuningRecord, load_tuned
from kiln.runtime.cpp_build import cpp_compiler_available, load_kernels
from kiln.runtime.triton_build import build_triton_kernels, load_triton_kernels, triton_available
from kiln.schedule.evaluate import evaluate_kernel
from kiln.schedule.loops import Kernel, kernel_symbols
from kiln.schedule.program import kernel_arguments

_log = logger("kernels")

KernelBuilder = Callable[..., dict[str, Launcher]]
# Generated code by what it was generated from (kernel names of one stored program): a warm
# process that read the program from the disk reads its code too (kiln/backends/programs.py).
Memo = dict[tuple[Any, ...], Any]
UNIT_KERNELS = 24  # kernels a C++ translation unit gets at least before a program is split


def _generated(memo: Memo | None, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _unique(kernels: list[Kernel], memo: Memo | None) -> tuple[list[Kernel], dict[str, str]]:
    """:func:`deduplicate` (by kernel signature, which costs as much as printing a kernel)."""
    names = tuple(k.name for k in kernels)

    def make() -> tuple[list[str], dict[str, str]]:
        unique, same_as = deduplicate(kernels)
        return [k.name for k in unique], same_as

    unique_names, same_as = _generated(memo, ("unique", names), make)
    by_name = {k.name: k for k in kernels}
    return [by_name[name] for name in unique_names], same_as


def _evaluator(
    kernels: list[Kernel], device: torch.device, memo: Memo | None = None
) -> dict[str, Launcher]:
    if any(kernel_symbols(k) for k in kernels):
        raise BackendError("kernels run as PyTorch ops take no symbolic sizes")

    def launcher(kernel: Kernel) -> Launcher:
        count = len(kernel_arguments(kernel))

        def launch(*arguments: object) -> None:
            seed = arguments[count] if len(arguments) > count else None
            evaluate_kernel(kernel, arguments[:count], seed)  # type: ignore[arg-type]

        return launch

    return {k.name: launcher(k) for k in kernels}


def _cpp(
    kernels: list[Kernel], device: torch.device, memo: Memo | None = None
) -> dict[str, Launcher]:
    """One translation unit, or for a large program several (:func:`cpp_units`), printed in
    turn and compiled at once: one g++ each."""
    if not cpp_compiler_available():
        raise Unavailable("no C++ compiler (g++) on PATH: install one for compiled CPU kernels")
    unique, same_as = _unique([k for k in kernels if k.xnumel > 0], memo)
    libraries = []
    for unit in cpp_units(unique):
        key = ("cpp", tuple(k.name for k in unit))
        text = _generated(memo, key, functools.partial(_printed, unit))
        libraries.append(cpp_library(unit, source=text))
    launchers: dict[str, Launcher] = {}
    if len(libraries) == 1:  # (the common case: no thread to start)
        launchers = load_kernels(libraries[0])
    elif libraries:
        with ThreadPoolExecutor(len(libraries)) as pool:  # (g++ runs outside the GIL)
            for built in pool.map(load_kernels, libraries):
                launchers.update(built)
    return {name: launchers[original] for name, original in same_as.items()}


def _printed(kernels: list[Kernel]) -> str:
    return cpp_library(kernels).source


def cpp_units(kernels: list[Kernel]) -> list[list[Kernel]]:
    """``kernels`` as translation units: one, or one per core for a program of at least
    ``UNIT_KERNELS`` kernels per core (round robin, so the units are alike and each process
    splits one program the same way). One unit of DenseNet-121's training backward (toy
    width, 2-core VM) compiled for 70 s of its first call."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    count = min(cores or 1, len(kernels) // UNIT_KERNELS)
    if count <= 1:
        return [kernels] if kernels else []
    return [kernels[i::count] for i in range(count)]


def _triton(
    kernels: list[Kernel],
    device: torch.device,
    memo: Memo | None = None,
    tuned: list[TuningRecord] | None = None,
) -> dict[str, Launcher]:
    interpret = device.type != "cuda"  # CPU tensors: Triton's interpreter (tests, CI)
    reason = triton_available(device, interpret=interpret)
    if reason is not None:
        raise Unavailable(reason)
    unique, same_as = _unique([k for k in kernels if k.xnumel > 0], memo)
    supported = [k for k in unique if unsupported_reason(k) is None]
    sized = [k for k in unique if kernel_symbols(k)]
    if any(k not in supported for k in sized):
        raise BackendError(f"kernel {sized[0].name}: no Triton form with symbolic sizes")
    launchers: dict[str, Launcher] = {}
    if tuned is not None and supported and not sized:  # (sizes vary: nothing to tune on)
        launchers, records = load_tuned([_tuning_job(k, interpret) for k in supported], device)
        tuned += records
    elif supported:
        sources = [_triton_source(k, interpret, memo) for k in supported]
        launchers = load_triton_kernels(sources, device)
    failing = []
    for kernel in supported:  # (a kernel Triton fails to compile for the GPU: another way)
        launcher = launchers.get(kernel.name)
        if hasattr(launcher, "fallback") and kernel not in sized:
            launcher.fallback = SecondForm(kernel, device)  # type: ignore[union-attr]
            if getattr(launcher, "precompile_error", None):
                failing.append(kernel)
    if failing:
        _start_in_second_form(failing, launchers, device)
    others = [k for k in unique if k.name not in launchers]
    for kernel in others:  # a dtype Triton cannot load: PyTorch ops run the kernel
        _log.info("%s runs as PyTorch ops: %s", kernel.name, unsupported_reason(kernel))
    launchers.update(_evaluator(others, device))
    return {name: launchers[original] for name, original in same_as.items()}


def _start_in_second_form(
    failing: list[Kernel], launchers: dict[str, Any], device: torch.device
) -> None:
    """The kernels whose first form failed to precompile run in their second from the first
    launch: the second forms compile together now, not one by one at launch, after the
    first form failed again in-process."""
    second = [generate_triton(k, interpret=False, reshaped=True) for k in failing]
    for kernel, built in zip(failing, build_triton_kernels(second, device), strict=True):
        first = launchers[kernel.name]
        error = str(first.precompile_error).strip().splitlines()
        first.failed = f"Triton kernel {kernel.name} failed to compile: {error[-1][:200]}"
        first.fallback.prepare(built)
        warnings.warn(
            f"kiln: {first.failed}; it runs {SecondForm.description} instead", stacklevel=3
        )


class SecondForm:
    """How a kernel runs when Triton fails to compile it for the GPU (a compiler bug must cost
    speed, never the program): in Triton's second form (reductions reshaped:
    ``triton_math.kept``), and as PyTorch ops if that fails too."""

    description = "in another Triton form (else as PyTorch ops)"

    def __init__(self, kernel: Kernel, device: torch.device) -> None:
        self.kernel, self.device = kernel, device
        self.launcher: Any = None

    def prepare(self, launcher: Any = None) -> None:
        """Build the second form's launcher (or take ``launcher``, built already), with
        PyTorch ops as its own fallback."""
        if launcher is None:
            source = generate_triton(self.kernel, interpret=False, reshaped=True)
            (launcher,) = build_triton_kernels([source], self.device)
        launcher.fallback = _evaluator([self.kernel], self.device)[self.kernel.name]
        self.launcher = launcher

    def __call__(self, *arguments: Any) -> None:
        if self.launcher is None:
            self.prepare()
        self.launcher(*arguments)


def _triton_source(kernel: Kernel, interpret: bool, memo: Memo | None) -> Any:
    key = ("triton", kernel.name, interpret)
    return _generated(memo, key, lambda: generate_triton(kernel, interpret))


def _tuning_job(kernel: Kernel, interpret: bool) -> TuningJob:
    """``kernel``'s autotune candidates, and what its choice depends on: its signature (names
    replaced by positions) and its buffers' sizes, strides and dtypes."""
    candidates = [
        generate_triton(kernel, interpret, blocks=b) for b in candidate_blocks(kernel, interpret)
    ]
    buffers = [(b.shape, b.strides, str(b.dtype)) for b in kernel_arguments(kernel)]
    identity = f"{kernel_signature(kernel)}\n{buffers}"
    return TuningJob(kernel.name, identity, tuple(candidates), len(kernel.writes()))


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
    kernels: list[Kernel],
    codegen: str = "",
    tuned: list[TuningRecord] | None = None,
    memo: Memo | None = None,
) -> tuple[dict[str, Launcher], list[str]]:
    """Launchers of every kernel, each device's kernels built by that device's generator
    (``codegen`` forces one); also the generators used. ``tuned`` (a list: autotuning on)
    receives a :class:`TuningRecord` per Triton kernel, its choice made at its first launch
    (``kiln/runtime/autotune.py``). ``memo``: generated code to reuse and to add to (see
    :data:`Memo`)."""
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
        if name == "triton" and tuned is not None:
            launchers.update(_triton(group, device, None, tuned))
        else:
            launchers.update(CODEGENS[name](group, device, memo))
    return launchers, names
