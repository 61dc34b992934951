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
from kiln.schedule.evaluate import evaluate_kernel
from kiln.schedule.loops import Kernel, format_kernel
from kiln.schedule.program import Program, kernel_arguments
from kiln.schedule.scheduler import schedule

_log = logger("kernels")

Runner = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
KernelBuilder = Callable[[list[Kernel], torch.device], dict[str, Launcher]]


@dataclass
class CompiledProgramRecord:
    """What one compilation made, for ``kiln.explain`` and tests."""

    graph: str
    device: str
    codegen: str
    program: Program | None
    seconds: float
    fallback: str = ""  # why the graph runs on the reference interpreter instead

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
                space = f"x<{step.xnumel}" + (f", r<{step.rnumel}" if step.rnumel > 1 else "")
                lines.append(f"{self.graph}: {step.name} ({space}): {', '.join(ops)}{where}")
            else:
                note = f" ({step.reason})" if step.reason else ""
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
    runnable = [k for k in kernels if k.xnumel > 0]
    if not runnable:
        return {}
    return load_kernels(runnable, generate_cpp(runnable))


def _triton(kernels: list[Kernel], device: torch.device) -> dict[str, Launcher]:
    from kiln.runtime.triton_build import load_triton_kernels, triton_available

    interpret = device.type != "cuda"  # CPU tensors: Triton's interpreter (tests, CI)
    reason = triton_available(device, interpret=interpret)
    if reason is not None:
        raise Unavailable(reason)
    runnable = [k for k in kernels if k.xnumel > 0]
    return load_triton_kernels(runnable, device, interpret) if runnable else {}


class Unavailable(BackendError):
    """The code generator cannot serve this machine (warned about once per reason)."""


CODEGENS: dict[str, KernelBuilder] = {"evaluate": _evaluator, "cpp": _cpp, "triton": _triton}
_WARNED: set[str] = set()


def register_codegen(name: str, builder: KernelBuilder) -> None:
    CODEGENS[name] = builder


def codegen_for(device: torch.device) -> str:
    """The code generator serving ``device``: config may force one (tests route CPU tensors
    through Triton's interpreter); otherwise Triton on CUDA and C++ on CPU."""
    forced = config.codegen
    if forced:
        return forced
    return "triton" if device.type == "cuda" else "cpp"


def graph_device(graph: Graph, inputs: Sequence[torch.Tensor]) -> torch.device:
    for value, tensor in zip(graph.inputs, inputs, strict=True):
        if value.kind is not InputKind.RNG_SEED and tensor.device.type != "cpu":
            return tensor.device
    for node in graph.nodes:
        for value in node.outputs:
            if value.type.device.type != "cpu":
                return value.type.device
    return torch.device("cpu")


@dataclass
class KilnProgram:
    """A graph compiled per layout of its user inputs."""

    graph: Graph
    variants: dict[tuple[object, ...], Runner] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.user = [i for i, v in enumerate(self.graph.inputs) if v.kind is InputKind.USER]

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        key = tuple(inputs[i].stride() for i in self.user)
        runner = self.variants.get(key)
        if runner is None:
            runner = self.variants[key] = self._compile(inputs)
        with torch.no_grad():
            return runner(inputs)

    def _compile(self, inputs: Sequence[torch.Tensor]) -> Runner:
        start = time.perf_counter()
        device = graph_device(self.graph, inputs)
        name = codegen_for(device)
        try:
            program = schedule(self.graph, inputs, device)
            launchers = CODEGENS[name](program.kernels(), device) if name in CODEGENS else None
            if launchers is None:
                raise BackendError(f"no {name} code generator is available")
            runner = Wrapper(program, launchers).compile()
        except Exception as error:
            if config.strict:
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
            self._record(device, name, None, start, reason)
            return lambda tensors: interpret(self.graph, tensors)
        self._record(device, name, program, start)
        return _without_autocast(runner)

    def _record(
        self,
        device: torch.device,
        codegen: str,
        program: Program | None,
        start: float,
        fallback: str = "",
    ) -> None:
        seconds = time.perf_counter() - start
        record = CompiledProgramRecord(
            self.graph.name, str(device), codegen, program, seconds, fallback
        )
        for recorder in RECORDERS:
            recorder.append(record)
        if _log.isEnabledFor(logging.INFO) and program is not None:
            for kernel in program.kernels():
                _log.info("%s\n%s", "; ".join(kernel.fused), format_kernel(kernel))


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

    def compile(self, graph: Graph) -> CompiledGraph:
        return KilnProgram(graph)


register_backend(KilnBackend())
