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
from typing import Any

import torch

from kiln.backends import programs
from kiln.backends.kernels import Unavailable, build_kernels
from kiln.backends.registry import CompiledGraph, add_backend
from kiln.backends.templates import build_pair_choices
from kiln.codegen.debug import dump_program
from kiln.codegen.signatures import kernel_signature
from kiln.codegen.wrapper import Wrapper, extern_function
from kiln.collector import gc_paused
from kiln.config import config, logger
from kiln.ir.graph import Graph, InputKind, Node
from kiln.ir.interpreter import interpret
from kiln.ir.op import Op
from kiln.ir.specialize import rehint, size_places, specialize, used_symbols
from kiln.ir.symbolic import (
    Check,
    Dim,
    Relation,
    ShapeEnv,
    active_env,
    bounded,
    current_env,
    pinned,
    printing_sizes,
    relations_check,
)
from kiln.ops import host_calls
from kiln.options import Options
from kiln.random_state import preserved_random_state
from kiln.recording import record as record_event
from kiln.runtime.autotune import TuningRecord
from kiln.runtime.triton_build import start_workers
from kiln.schedule.layouts import Observed, input_pattern
from kiln.schedule.loops import Kernel, format_kernel
from kiln.schedule.program import ExternCall, Program
from kiln.schedule.scheduler import schedule
from kiln.schedule.templates import MatmulPair, matmul_pairs, replanned

_log = logger("kernels")
# A size a program in symbolic sizes serves this many times gets a program of its own, for at
# most HOT_SIZES sizes per graph (text generation's lengths, each met once per generate(),
# stay symbolic; a training loop's batch size does not).
HOT_CALLS = 64
HOT_SIZES = 4
_log_dynamic = logger("dynamic")

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
    # max-autotune: why a product has no template (by its extern step's id; schedule/templates.py)
    untemplated: dict[int, str] = field(default_factory=dict)
    # A graph with symbolic sizes: which sizes the program serves ("any sizes where s0 > 8",
    # or "sizes s0=5 only (why)")
    sizes: str = ""

    @property
    def unique_kernels(self) -> int:
        """Distinct kernels (by signature; computed when asked: benchmarks report it)."""
        kernels = self.program.kernels() if self.program is not None else []
        return len({kernel_signature(k) for k in kernels})

    def kernel_lines(self) -> list[str]:
        """One line per kernel (the ops it fuses and the user lines they come from) and per
        extern call."""
        with printing_sizes(repr):  # (a program in symbolic sizes: as written)
            return self._kernel_lines()

    def _kernel_lines(self) -> list[str]:
        if self.program is None:
            return [f"{self.graph}: reference interpreter ({self.fallback})"]
        lines = [f"{self.graph}: compiled for {self.sizes}"] if self.sizes else []
        for step in self.program.steps:
            if isinstance(step, Kernel):
                ops = list(dict.fromkeys(f.split()[0] for f in step.fused))
                places = list(dict.fromkeys(f.split()[-1] for f in step.fused if ":" in f))
                where = f"  [{', '.join(places[:4])}]" if places else ""
                space = " + ".join(
                    f"x<{k.xnumel}" + (f", r<{k.rnumel}" if _reduces(k.rnumel) else "")
                    for k in (step, *step.parts)
                )
                lines.append(f"{self.graph}: {step.name} ({space}): {', '.join(ops)}{where}")
            else:
                note = f" ({step.reason})" if step.reason else ""
                via = host_calls.library(step.node, self.cpu_matmul)
                note += f" via {via}" if via else ""
                if id(step) in self.untemplated:
                    note += f" (no template: {self.untemplated[id(step)]})"
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
    # Extern results PyTorch laid out otherwise than the schedule assumed (the node's first
    # output name -> strides): a variant that saw one is rebuilt once, assuming what PyTorch does.
    observed: dict[str, list[Observed]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.user = [i for i, v in enumerate(self.graph.inputs) if v.kind is InputKind.USER]
        self._stale = False
        self._rebuilt: set[tuple[object, ...]] = set()
        # A graph with symbols: where each is read off the inputs, and the programs compiled
        # so far with the relations on the sizes each holds for (SymbolicVariant).
        used = used_symbols(self.graph)
        self.places = sorted((n, p) for n, p in size_places(self.graph).items() if n in used)
        self.symbolic: list[SymbolicVariant] = []
        # Calls at each size a symbolic variant serves, until HOT_SIZES of them have their own
        # program (a training loop's usual batch, after its last smaller one made it symbolic)
        self.counting: dict[tuple[object, ...], int] = {}
        self.hot = 0

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        key: tuple[object, ...] = tuple(inputs[i].stride() for i in self.user)
        if self.places:
            key += tuple(inputs[i].shape[d] for _, (i, d) in self.places)
        runner = self.variants.get(key)
        if runner is None:
            with preserved_random_state(), gc_paused():
                variants = bounded(self.variants) if self.places else self.variants
                runner = variants[key] = self._variant(inputs)
            if self.places and self.hot < HOT_SIZES and self._sized(runner):
                self.counting[key] = 0
        elif self.counting and key in self.counting:  # (empty but for symbolic programs)
            self.counting[key] += 1
            if self.counting[key] >= HOT_CALLS:
                with preserved_random_state(), gc_paused():
                    runner = self._hot_size(key, inputs)
        with torch.no_grad():
            results = runner(inputs)
        if self._stale:
            self._stale = False
            if key not in self._rebuilt:  # once: layouts that keep changing just get copied
                self._rebuilt.add(key)
                del self.variants[key]
                self.symbolic = [v for v in self.symbolic if v.runner is not runner]
        return results

    def _variant(self, inputs: Sequence[torch.Tensor]) -> Runner:
        """The runner for new strides or sizes: a graph without symbols compiles; a graph with
        symbols first tries the programs compiled for other sizes, then compiles one for a
        range of sizes, or, when that fails, for these sizes alone."""
        if not self.places:
            return self._compile(inputs, self.graph)
        values = {name: int(inputs[i].shape[d]) for name, (i, d) in self.places}
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in inputs):
            return self._compile(inputs, specialize(self.graph, values))  # (types only)
        layouts = _layout_pattern(self.graph, inputs)
        for variant in self.symbolic:
            if variant.layouts == layouts and variant.holds(values):
                return variant.runner
        env = ShapeEnv()
        family = None if self.observed else programs.symbolic_key(self.graph, layouts, self.options)
        try:
            with active_env(env):  # (rehinting may ask questions too)
                graph = rehint(self.graph, values)
                found = programs.load_symbolic(family, values, graph) if family else None
                env.relations.update(dict.fromkeys(found.relations if found else ()))
                runner = self._compile(inputs, graph, symbolic=True, stored=found)
            relations, checks = tuple(env.relations), tuple(env.checks.values())
            if family and not found and not checks and self._built:
                programs.store_symbolic(family, relations, graph, *self._built)
        except Exception as error:
            reason = (
                f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            )
            note = f"{_sizes_text(values)} only ({reason})"
            _log_dynamic.info("%s: kernels for %s", self.graph.name, note)
            runner = self._compile(inputs, specialize(self.graph, values), note=note)
            self.symbolic.append(SymbolicVariant(layouts, pinned(values), runner, pinned=True))
            return runner
        self.symbolic.append(SymbolicVariant(layouts, relations, runner, checks=checks))
        return runner

    def _sized(self, runner: Runner) -> bool:
        return any(v.runner is runner and not v.pinned for v in self.symbolic)

    def _hot_size(self, key: tuple[object, ...], inputs: Sequence[torch.Tensor]) -> Runner:
        """A program of its own for a size a program in symbolic sizes has served
        ``HOT_CALLS`` times: kernels with constant sizes run faster (CPU: 18-30% on a
        transformer block and a small CNN, whose symbolic indices divide at run time)."""
        del self.counting[key]
        self.hot += 1
        if self.hot >= HOT_SIZES:
            self.counting.clear()
        values = {name: int(inputs[i].shape[d]) for name, (i, d) in self.places}
        note = f"{_sizes_text(values)} only (served {HOT_CALLS} times in symbolic sizes)"
        runner = self.variants[key] = self._compile(
            inputs, specialize(self.graph, values), note=note
        )
        return runner

    def _observe(self, node: Node, layouts: Sequence[Observed]) -> None:
        strides = [strides for _, strides in layouts]
        _log.info("%s returned strides %s, not the predicted ones; rebuilding once", node, strides)
        self.observed[node.outputs[0].name] = list(layouts)  # (names hold in every sized copy)
        self._stale = True

    def _compile(
        self,
        inputs: Sequence[torch.Tensor],
        graph: Graph,
        symbolic: bool = False,
        note: str = "",
        stored: programs.Stored | None = None,
    ) -> Runner:
        """The program of ``graph`` for ``inputs``; ``symbolic``: ``graph`` keeps its symbols
        (under the active :class:`ShapeEnv`) and a failure raises instead of falling back.
        ``note``: the sizes it serves, for ``kiln.explain`` (a symbolic one says it itself);
        ``stored``: a program in symbolic sizes read from the disk, with its code."""
        self._note = note
        self._host = ""  # (the host program that runs, for the debug directory)
        self._untemplated: dict[int, str] = {}
        self._built: tuple[Program, dict[Any, Any]] | None = None
        start = time.perf_counter()
        names: list[str] = []
        self._tuned: list[TuningRecord] = []
        if any(t.device.type == "meta" for t in inputs if isinstance(t, torch.Tensor)):
            # Tensors without data: only types to propagate, which the interpreter does on
            # meta tensors as eager would (a kernel would read memory that does not exist).
            self._record("", None, start, "meta tensors")
            return lambda tensors: interpret(graph, tensors)
        try:
            devices = {t.device for t in inputs if isinstance(t, torch.Tensor)}
            start_workers(devices, self.options.codegen)
            if stored is not None:
                program, file_key, memo = stored.program, None, stored.generated
            else:
                program, file_key, from_disk = self._schedule(inputs, graph, symbolic)
                memo = programs.load_generated(file_key) if from_disk and file_key else {}
            scheduled = time.perf_counter()
            tuned: list[TuningRecord] | None = [] if self.options.autotune else None
            known = len(memo)
            pairs = self._matmul_pairs(program) if tuned is not None and not symbolic else []
            program = replanned(program, pairs)
            kernels = program.kernels() + [p.rest for p in pairs if p.rest is not None]
            launchers, names = build_kernels(kernels, self.options.codegen, tuned, memo)
            if file_key and len(memo) != known:
                programs.store_generated(file_key, memo)
            paired, operands = self._pair_choices(pairs, launchers, tuned)
            self._tuned = tuned or []
            sizes = self.places if symbolic else ()
            wrapper = Wrapper(
                program, launchers, self._observe, self.options.cpu_matmul, sizes, paired, operands
            )
            runner = wrapper.compile()
            self._host = wrapper.text
            self._built = (program, memo)
            self._phases = {"schedule": scheduled - start, "build": time.perf_counter() - scheduled}
        except Exception as error:
            if symbolic or self.options.strict or _draws_random_numbers(graph):
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
            return lambda tensors: interpret(graph, tensors)
        self._record("+".join(names), program, start)
        return _without_autocast(runner)

    def _matmul_pairs(self, program: Program) -> list[MatmulPair]:
        """max-autotune: the products whose reading kernel a template may fuse, on the devices
        whose kernels are Triton's (``kiln/schedule/templates.py``)."""
        devices = {"cuda"} if self.options.codegen in ("", "triton") else set()
        if self.options.codegen == "triton":  # (CPU tensors: Triton's interpreter)
            devices.add("cpu")
        return matmul_pairs(program, frozenset(devices), self._untemplated)

    def _pair_choices(
        self, pairs: list[MatmulPair], launchers: dict[str, Any], tuned: list[TuningRecord] | None
    ) -> tuple[dict[int, Any], dict[int, Any]]:
        """The wrapper's paired externs and their kernels' extra operands; ``launchers`` gets
        each pair's choice in place of its kernel (``kiln/backends/templates.py``)."""
        paired: dict[int, Any] = {}
        operands: dict[int, Any] = {}
        if not pairs or tuned is None:
            return paired, operands

        def extern(call: ExternCall) -> Any:
            return extern_function(call, self._observe, self.options.cpu_matmul)

        by_device: dict[torch.device, list[MatmulPair]] = {}
        for pair in pairs:
            by_device.setdefault(pair.result.device, []).append(pair)
        for device, group in by_device.items():
            choices = build_pair_choices(group, launchers, device, tuned, extern)
            for pair in group:
                choice = choices.get(pair.kernel.name)
                if choice is None or id(pair.extern) not in choice.externs:
                    # (an extern and a kernel, as scheduled)
                    self._untemplated[id(pair.extern)] = f"{pair.kernel.name} has no template form"
                    continue
                paired[id(pair.extern)] = choice.externs[id(pair.extern)]
                operands[id(pair.kernel)] = pair.operands
                launchers[pair.kernel.name] = choice.launcher
        return paired, operands

    def _schedule(
        self, inputs: Sequence[torch.Tensor], graph: Graph, symbolic: bool
    ) -> tuple[Program, str | None, bool]:
        """The program for ``inputs``' layouts, from the disk when a process scheduled it;
        its file key (None: not cached) and whether it came from the disk. (A program with
        symbols is not kept on disk: the relations it holds for would have to be.)"""
        cached = not self.observed and not symbolic
        file_key = programs.key(graph, inputs, self.options) if cached else None
        program = programs.load(file_key, graph) if file_key else None
        if program is not None:
            return program, file_key, True
        program = schedule(graph, inputs, self.observed)
        if file_key:
            programs.store(file_key, graph, program)
        return program, file_key, False

    def _record(
        self, codegen: str, program: Program | None, start: float, fallback: str = ""
    ) -> None:
        seconds = time.perf_counter() - start
        record = CompiledProgramRecord(self.graph.name, codegen, program, seconds, fallback)
        record.phases = getattr(self, "_phases", {})
        env = current_env()
        if env is not None:  # (a program in symbolic sizes: what it decided on them)
            relations = ", ".join([r.text() for r in env.relations] + list(env.checks))
            record.sizes = f"any sizes where {relations}" if relations else "any sizes"
            _log_dynamic.info("%s: kernels for %s", self.graph.name, record.sizes)
        else:
            record.sizes = getattr(self, "_note", "")
        record.cpu_matmul = self.options.cpu_matmul
        record.tuned = self._tuned
        record.untemplated = getattr(self, "_untemplated", {})
        record_event(record)
        if program is not None and _log.isEnabledFor(logging.INFO):
            for kernel in program.kernels():
                _log.info("%s\n%s", "; ".join(kernel.fused), format_kernel(kernel))
        if program is not None and config.debug_dir:
            dump_program(self.graph, program, str(config.debug_dir), getattr(self, "_host", ""))


@dataclass(frozen=True)
class SymbolicVariant:
    """A program compiled for a range of sizes: the inputs' layouts it was scheduled for and
    the relations on the symbols it holds for."""

    layouts: tuple[object, ...]
    relations: tuple[Relation, ...]
    runner: Runner
    pinned: bool = False  # compiled for one size (its kernels could not take them)
    checks: tuple[Check, ...] = ()  # (ShapeEnv.checks)
    holds: Callable[[dict[str, int]], bool] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "holds", relations_check(self.relations, self.checks))


def _layout_pattern(graph: Graph, inputs: Sequence[torch.Tensor]) -> tuple[object, ...]:
    """The user inputs' layouts as a program with symbols depends on them
    (:func:`~kiln.schedule.layouts.input_pattern` for an input with symbolic dims)."""
    pattern: list[object] = []
    for value, tensor in zip(graph.inputs, inputs, strict=True):
        if not isinstance(tensor, torch.Tensor):
            continue
        if value.type.is_symbolic:
            pattern.append(input_pattern(tensor))
        elif value.kind is InputKind.USER:
            pattern.append(tensor.stride())
    return tuple(pattern)


def _sizes_text(values: dict[str, int]) -> str:
    return "sizes " + ", ".join(f"{name}={value}" for name, value in values.items())


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


def _reduces(rnumel: Dim) -> bool:
    """Whether a kernel reduces (listed as ``r<n``), without a question about a symbolic
    extent (``explain`` runs outside any environment that could record its guard)."""
    return not isinstance(rnumel, int) or rnumel > 1
