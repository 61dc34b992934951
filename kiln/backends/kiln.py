"""The ``kiln`` backend: schedule a graph into fused kernels and run generated code.

A graph compiles on its first call, when the inputs' devices and strides are known: the
scheduler (``kiln/schedule``) groups the work into kernels and extern calls, a code generator
(``kiln/codegen``: Triton for CUDA tensors, C++ for CPU tensors) prints the kernels, the
runtime (``kiln/runtime``) builds and loads them, and the wrapper runs the steps in order.
Another layout of the user's inputs compiles another variant. When no generator can serve
the device (no Triton, no C++ compiler) or a build fails, the graph runs on the reference
interpreter with one warning (``KILN_STRICT=1`` raises instead).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kiln.backends.registry import CompiledGraph, register_backend
from kiln.codegen.wrapper import Launcher, Wrapper
from kiln.config import config, logger
from kiln.errors import BackendError
from kiln.ir.graph import Graph, InputKind
from kiln.ir.interpreter import interpret
from kiln.ir.op import Op
from kiln.ops import host_calls
from kiln.options import Options
from kiln.random_state import preserved_random_state
from kiln.runtime.triton_build import start_workers
from kiln.schedule.evaluate import evaluate_kernel
from kiln.schedule.index import Index, format_index
from kiln.schedule.loops import (
    Apply,
    Const,
    IndexValue,
    Kernel,
    Load,
    Rand,
    Reduce,
    format_kernel,
    walk,
)
from kiln.schedule.program import Program, kernel_arguments
from kiln.schedule.scheduler import schedule

_log = logger("kernels")

Runner = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
KernelBuilder = Callable[[list[Kernel], torch.device], dict[str, Launcher]]


@dataclass
class CompiledProgramRecord:
    """What one compilation made, for ``kiln.explain`` and tests."""

    graph: str
    codegen: str
    program: Program | None
    seconds: float
    fallback: str = ""  # why the graph runs on the reference interpreter instead
    phases: dict[str, float] = field(default_factory=dict)  # schedule / build / first run
    unique_kernels: int = 0
    cpu_matmul: str = "auto"  # the options' library of float32 CPU matmuls

    def kernel_lines(self) -> list[str]:
        """One line per kernel (the ops it fuses and the user lines they come from) and per
        extern call."""
        if self.program is None:
            return [f"{self.graph}: reference interpreter ({self.fallback})"]
        lines = []
        for step in self.program.steps:
            if isinstance(step, Kernel):
                ops = list(dict.fromkeys(f.split()[0] for f in step.fused))
                places = list(dict.fromkeys(f.split()[-1] for f in step.fused if ":" in f))
                where = f"  [{', '.join(places[:4])}]" if places else ""
                space = " + ".join(
                    f"x<{k.xnumel}" + (f", r<{k.rnumel}" if k.rnumel > 1 else "")
                    for k in (step, *step.parts)
                )
                lines.append(f"{self.graph}: {step.name} ({space}): {', '.join(ops)}{where}")
            else:
                note = f" ({step.reason})" if step.reason else ""
                via = host_calls.library(step.node, self.cpu_matmul)
                note += f" via {via}" if via else ""
                origin = f"  [{step.node.origin}]" if step.node.origin.api else ""
                lines.append(f"{self.graph}: extern {step.node.op.printed_name}{note}{origin}")
        return lines


RECORDERS: list[list[CompiledProgramRecord]] = []  # kiln.explain listens here


def _evaluator(kernels: list[Kernel], device: torch.device) -> dict[str, Launcher]:
    def launcher(kernel: Kernel) -> Launcher:
        count = len(kernel_arguments(kernel))

        def launch(*arguments: object) -> None:
            seed = arguments[count] if len(arguments) > count else None
            evaluate_kernel(kernel, arguments[:count], seed)  # type: ignore[arg-type]

        return launch

    return {k.name: launcher(k) for k in kernels}


def _cpp(kernels: list[Kernel], device: torch.device) -> dict[str, Launcher]:
    from kiln.codegen.cpp import generate_cpp
    from kiln.runtime.cpp_build import cpp_compiler_available, load_kernels

    if not cpp_compiler_available():
        raise Unavailable("no C++ compiler (g++) on PATH: install one for compiled CPU kernels")
    unique, same_as = deduplicate([k for k in kernels if k.xnumel > 0])
    launchers = load_kernels(unique, generate_cpp(unique)) if unique else {}
    return {name: launchers[original] for name, original in same_as.items()}


def _triton(kernels: list[Kernel], device: torch.device) -> dict[str, Launcher]:
    from kiln.codegen.triton import unsupported_reason
    from kiln.runtime.triton_build import load_triton_kernels, triton_available

    interpret = device.type != "cuda"  # CPU tensors: Triton's interpreter (tests, CI)
    reason = triton_available(device, interpret=interpret)
    if reason is not None:
        raise Unavailable(reason)
    unique, same_as = deduplicate([k for k in kernels if k.xnumel > 0])
    supported = [k for k in unique if unsupported_reason(k) is None]
    launchers = load_triton_kernels(supported, device, interpret) if supported else {}
    for kernel in supported:  # (a kernel Triton fails to compile for the GPU: PyTorch ops)
        launcher = launchers.get(kernel.name)
        if hasattr(launcher, "fallback"):
            launcher.fallback = _evaluator([kernel], device)[kernel.name]  # type: ignore[union-attr]
    others = [k for k in unique if k.name not in launchers]
    for kernel in others:  # a dtype Triton cannot load: PyTorch ops run the kernel
        _log.info("%s runs as PyTorch ops: %s", kernel.name, unsupported_reason(kernel))
    launchers.update(_evaluator(others, device))
    return {name: launchers[original] for name, original in same_as.items()}


def deduplicate(kernels: list[Kernel]) -> tuple[list[Kernel], dict[str, str]]:
    """Kernels that differ only in their names and buffers' names are built once (a network
    repeats its blocks): the distinct kernels, and each kernel's name -> the one it reuses."""
    unique: dict[str, Kernel] = {}
    same_as: dict[str, str] = {}
    for kernel in kernels:
        key = kernel_signature(kernel)
        same_as[kernel.name] = unique.setdefault(key, kernel).name
    return list(unique.values()), same_as


def kernel_signature(kernel: Kernel) -> str:
    """The kernel's structure with names replaced by positions: equal signatures compile to
    the same code."""
    position = {id(b): i for i, b in enumerate(kernel_arguments(kernel))}
    parts = _structure(kernel, position)
    for part in kernel.parts:
        parts += ["part", *_structure(part, position)]
    return "\n".join(parts)


def _structure(kernel: Kernel, position: dict[int, int]) -> list[str]:
    number: dict[int, int] = {}

    def index(value: Index) -> str:
        return format_index(
            value,
            lambda a: (
                a.name
                if hasattr(a, "name")
                else f"%{number[id(a.value)]}{'!' if a.checked else ''}{'w' if a.wrapped else ''}"
            ),
        )

    parts = [f"{kernel.xnumel},{kernel.rnumel}"]
    for expr in walk([store.value for store in kernel.stores]):
        number[id(expr)] = len(number)
        fields = [type(expr).__name__, str(expr.dtype)]
        if isinstance(expr, Load):
            mask = number[id(expr.mask)] if expr.mask is not None else None
            fields += [
                f"@{position[id(expr.buffer)]}",
                index(expr.offset),
                f"{mask}",
                repr(expr.other),
            ]
        elif isinstance(expr, Apply):
            fields += [expr.op.name, *(f"%{number[id(a)]}" for a in expr.args)]
        elif isinstance(expr, Reduce):
            fields += [expr.kind.name, f"%{number[id(expr.value)]}"]
        elif isinstance(expr, Const):
            fields.append(repr(expr.value))
        elif isinstance(expr, IndexValue):
            fields.append(index(expr.index))
        elif isinstance(expr, Rand):
            fields += [index(expr.offset), str(expr.normal)]
        parts.append(" ".join(fields))
    for store in kernel.stores:
        buffer, value = store.buffer, number[id(store.value)]
        parts.append(f"store @{position[id(buffer)]} {buffer.dtype} {index(store.offset)} %{value}")
    return parts


class Unavailable(BackendError):
    """The code generator cannot serve this machine (warned about once per reason)."""


CODEGENS: dict[str, KernelBuilder] = {"evaluate": _evaluator, "cpp": _cpp, "triton": _triton}
_WARNED: set[str] = set()


def register_codegen(name: str, builder: KernelBuilder) -> None:
    CODEGENS[name] = builder


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


@dataclass
class KilnProgram:
    """A graph compiled per layout of its user inputs."""

    graph: Graph
    options: Options = field(default_factory=Options)
    variants: dict[tuple[object, ...], Runner] = field(default_factory=dict)
    # Extern results PyTorch laid out otherwise than the schedule assumed (node id ->
    # strides): a variant that saw one is rebuilt once, assuming what PyTorch does.
    observed: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.user = [i for i, v in enumerate(self.graph.inputs) if v.kind is InputKind.USER]
        self._stale = False
        self._rebuilt: set[tuple[object, ...]] = set()

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        key = tuple(inputs[i].stride() for i in self.user)
        runner = self.variants.get(key)
        if runner is None:
            with preserved_random_state():
                runner = self.variants[key] = self._compile(inputs)
        with torch.no_grad():
            results = runner(inputs)
        if self._stale:
            self._stale = False
            if key not in self._rebuilt:  # once: layouts that keep changing just get copied
                self._rebuilt.add(key)
                del self.variants[key]
        return results

    def _observe(self, node: object, strides: list[tuple[int, ...]]) -> None:
        _log.info("%s returned strides %s, not the predicted ones; rebuilding once", node, strides)
        self.observed[id(node)] = strides
        self._stale = True

    def _compile(self, inputs: Sequence[torch.Tensor]) -> Runner:
        start = time.perf_counter()
        names: list[str] = []
        if any(t.device.type == "meta" for t in inputs if isinstance(t, torch.Tensor)):
            # Tensors without data: only types to propagate, which the interpreter does on
            # meta tensors as eager would (a kernel would read memory that does not exist).
            self._record("", None, start, "meta tensors")
            return lambda tensors: interpret(self.graph, tensors)
        try:
            devices = {t.device for t in inputs if isinstance(t, torch.Tensor)}
            start_workers(devices, self.options.codegen)
            program = schedule(self.graph, inputs, self.observed)
            scheduled = time.perf_counter()
            launchers, names = build_kernels(program.kernels(), self.options.codegen)
            wrapper = Wrapper(program, launchers, self._observe, self.options.cpu_matmul)
            runner = wrapper.compile()
            self._phases = {"schedule": scheduled - start, "build": time.perf_counter() - scheduled}
        except Exception as error:
            if self.options.strict or _draws_random_numbers(self.graph):
                # A graph with random ops cannot fall back alone: the interpreter draws other
                # numbers than the kernels, and a forward/backward pair must see the same mask.
                raise
            if isinstance(error, Unavailable):
                reason = str(error)
                if reason not in _WARNED:
                    _WARNED.add(reason)
                    warnings.warn(
                        f"kiln: graphs run on the reference interpreter: {reason}", stacklevel=2
                    )
            else:
                reason = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                warnings.warn(
                    f"kiln: graph {self.graph.name} runs on the reference interpreter ({reason})",
                    stacklevel=2,
                )
            self._record("+".join(names), None, start, reason)
            return lambda tensors: interpret(self.graph, tensors)
        self._record("+".join(names), program, start)
        return _without_autocast(runner)

    def _record(
        self, codegen: str, program: Program | None, start: float, fallback: str = ""
    ) -> None:
        seconds = time.perf_counter() - start
        record = CompiledProgramRecord(self.graph.name, codegen, program, seconds, fallback)
        record.phases = getattr(self, "_phases", {})
        record.cpu_matmul = self.options.cpu_matmul
        if program is not None:
            record.unique_kernels = len({kernel_signature(k) for k in program.kernels()})
        for recorder in RECORDERS:
            recorder.append(record)
        if program is not None and _log.isEnabledFor(logging.INFO):
            for kernel in program.kernels():
                _log.info("%s\n%s", "; ".join(kernel.fused), format_kernel(kernel))
        if program is not None and config.debug_dir:
            _dump(self.graph, program)


def _dump(graph: Graph, program: Program) -> None:
    """The graph, its kernels (loop-level IR) and the host program, in the debug directory
    (the generators dump their kernel sources there too)."""
    folder = os.path.join(str(config.debug_dir), "programs")
    os.makedirs(folder, exist_ok=True)
    listing = "\n\n".join(format_kernel(k) for k in program.kernels())
    wrapper = Wrapper(program, {}).source()
    path = os.path.join(folder, f"{graph.name}_{id(program):x}.txt")
    with open(path, "w") as file:
        file.write(f"# graph\n{graph}\n\n# kernels\n{listing}\n\n# host program\n{wrapper}")


def _draws_random_numbers(graph: Graph) -> bool:
    return any(node.op in (Op.RANDOM_UNIFORM, Op.RANDOM_NORMAL) for node in graph.nodes)


def _without_autocast(runner: Runner) -> Runner:
    """The graph holds autocast's casts already; externs must not cast again."""

    def run(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"):
            with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
                return runner(inputs)
        return runner(inputs)

    return run


@dataclass(frozen=True)
class KilnBackend:
    name: str = "kiln"

    def compile(self, graph: Graph, options: Options) -> CompiledGraph:
        return KilnProgram(graph, options)


register_backend(KilnBackend())
