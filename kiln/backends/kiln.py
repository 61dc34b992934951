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

from kiln.backends import programs
from kiln.backends.kernels import Unavailable, build_kernels
from kiln.backends.registry import CompiledGraph, add_backend
from kiln.codegen.debug import dump_program
from kiln.codegen.signatures import kernel_signature
from kiln.codegen.wrapper import Wrapper
from kiln.collector import gc_paused
from kiln.config import config, logger
from kiln.ir.graph import Graph, InputKind
from kiln.ir.interpreter import interpret
from kiln.ir.op import Op
from kiln.ops import host_calls
from kiln.options import Options
from kiln.random_state import preserved_random_state
from kiln.recording import record as record_event
from kiln.runtime.autotune import TuningRecord
from kiln.runtime.triton_build import start_workers
from kiln.schedule.loops import Kernel, format_kernel
from kiln.schedule.program import Program
from kiln.schedule.scheduler import schedule

_log = logger("kernels")

Runner = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
_WARNED: set[str] = set()  # generator-unavailable reasons already warned about


@dataclass
class CompiledProgramRecord:
    """What one compilation made, for ``kiln.explain`` and tests."""

    graph: str
    codegen: str
    program: Program | None
    seconds: float
    fallback: str = ""  # why the graph runs on the reference interpreter instead
    phases: dict[str, float] = field(default_factory=dict)  # schedule / build / first run
    cpu_matmul: str = "auto"  # the options' library of float32 CPU matmuls
    # max-autotune: each Triton kernel's choice, made at its first launch (kiln/runtime/autotune.py)
    tuned: list[TuningRecord] = field(default_factory=list)

    @property
    def unique_kernels(self) -> int:
        """Distinct kernels (by signature; computed when asked: benchmarks report it)."""
        kernels = self.program.kernels() if self.program is not None else []
        return len({kernel_signature(k) for k in kernels})

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
        lines += [f"{self.graph}: {choice.line()}" for choice in self.tuned if choice.chosen]
        return lines


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
            with preserved_random_state(), gc_paused():
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
        self._tuned: list[TuningRecord] = []
        if any(t.device.type == "meta" for t in inputs if isinstance(t, torch.Tensor)):
            # Tensors without data: only types to propagate, which the interpreter does on
            # meta tensors as eager would (a kernel would read memory that does not exist).
            self._record("", None, start, "meta tensors")
            return lambda tensors: interpret(self.graph, tensors)
        try:
            devices = {t.device for t in inputs if isinstance(t, torch.Tensor)}
            start_workers(devices, self.options.codegen)
            program, file_key, stored = self._schedule(inputs)
            scheduled = time.perf_counter()
            tuned: list[TuningRecord] | None = [] if self.options.autotune else None
            memo = programs.load_generated(file_key) if stored and file_key else {}
            known = len(memo)
            kernels = program.kernels()
            launchers, names = build_kernels(kernels, self.options.codegen, tuned, memo)
            if file_key and len(memo) != known:
                programs.store_generated(file_key, memo)
            self._tuned = tuned or []
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

    def _schedule(self, inputs: Sequence[torch.Tensor]) -> tuple[Program, str | None, bool]:
        """The program for ``inputs``' layouts, from the disk when a process scheduled it;
        its file key (None: not cached) and whether it came from the disk."""
        file_key = None if self.observed else programs.key(self.graph, inputs, self.options)
        program = programs.load(file_key, self.graph) if file_key else None
        if program is not None:
            return program, file_key, True
        program = schedule(self.graph, inputs, self.observed)
        if file_key:
            programs.store(file_key, self.graph, program)
        return program, file_key, False

    def _record(
        self, codegen: str, program: Program | None, start: float, fallback: str = ""
    ) -> None:
        seconds = time.perf_counter() - start
        record = CompiledProgramRecord(self.graph.name, codegen, program, seconds, fallback)
        record.phases = getattr(self, "_phases", {})
        record.cpu_matmul = self.options.cpu_matmul
        record.tuned = self._tuned
        record_event(record)
        if program is not None and _log.isEnabledFor(logging.INFO):
            for kernel in program.kernels():
                _log.info("%s\n%s", "; ".join(kernel.fused), format_kernel(kernel))
        if program is not None and config.debug_dir:
            dump_program(self.graph, program, str(config.debug_dir))


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


add_backend(KilnBackend())
