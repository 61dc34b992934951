"""Capturing one frame: run it symbolically, then generate the code that replaces it.

``capture_frame`` executes the function's bytecode on its real arguments (tensors as proxies)
and ends in one of two ways:

* the frame returns: the head function runs the graph, replays side effects and rebuilds the
  return value;
* the frame hits a graph break: capture restarts from scratch with the break placed at the
  root-frame instruction that was running (``Session.break_at``), stops just before it, and
  the head runs the graph so far, replays side effects, performs that instruction natively (a
  call through a compiled wrapper of the callee, a branch on a tensor, ``bool()``) and
  continues in a resume function, which is compiled in its turn.

The generated head function for ``def f(x, y): return torch.relu(x) + y`` reads::

    def ___head(___f, x, y):
        ___out = ___graph(x, y)
        return ___out[0]
"""

from __future__ import annotations

import copy
import dis
import linecache
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.capture import handlers  # noqa: F401  (registers the opcode handlers frames run)
from kiln.capture.calls.inline import CO_ASYNC, CO_GENERATOR
from kiln.capture.core.breaks import BreakRecord, FullGraphError, GraphBreak, SkipReason
from kiln.capture.core.contexts import is_known_context
from kiln.capture.core.frame import BreakHere, ExceptionEntry, Frame
from kiln.capture.core.session import Session
from kiln.capture.driver.reconstruct import Reconstructor, Unreconstructible
from kiln.capture.driver.resume import OPERATIONS, OPERATORS, emit_break
from kiln.capture.guards.guards import Equals, Guard, HasAttr, Identity, KeysAre, LengthIs, TypeIs
from kiln.capture.guards.sizes import SizePolicy, size_expression
from kiln.capture.guards.sources import Binder, FunctionAttr, Local, safe_name
from kiln.code_cache import compiled as compiled_code
from kiln.config import config
from kiln.errors import SourceLocation
from kiln.frontends.proxy import TraceMode
from kiln.frontends.source import set_user_location
from kiln.frontends.trace import _compiling
from kiln.ir.graph import Graph, InputKind, Value
from kiln.ir.op import Op
from kiln.ir.specialize import used_symbols
from kiln.ir.symbolic import ShapeEnv, active_env
from kiln.ops import prims

MAX_RESTARTS = 8


class Skip(Exception):
    """The frame must run as its original code."""

    def __init__(self, reason: SkipReason, detail: str, location: Any = None) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.location = location


class Restart(Exception):
    def __init__(self, offset: int, error: GraphBreak, guards: list[Guard]) -> None:
        super().__init__(str(error))
        self.offset = offset
        self.error = error
        self.guards = guards  # what the capture read on its way to the break


# Guards a head that breaks at a call keeps from the capture that went into the callee: they
# say why it breaks there (which modules, which settings). Tensor and size guards stay behind.
# The artifact cache checks them before it reuses a stored head in another process (every
# compiled module's call frame is one code object: a T5 run got a Whisper run's break); calls
# never check them (a head that breaks at a call is right for any callee).
_DECISIVE = (Identity, TypeIs, Equals, LengthIs, KeysAre, HasAttr)


@dataclass
class Capture:
    """What one capture produced: the head function and everything explain() reports."""

    head: Any
    head_source: str
    guards: list[Guard]
    graph: Graph | None
    breaks: list[BreakRecord] = field(default_factory=list)
    resumes: list[Any] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)  # values kept for the backward, if any
    # The rest of the frame after a break that runs as original code (explain lists it).
    uncompiled: list[BreakRecord] = field(default_factory=list)
    # Symbolic sizes: the symbols, where each was read and why it is symbolic, the guards
    # decided on them and where capture specialized one.
    shapes: ShapeEnv | None = None
    # The head's globals (objects its source names), for the artifact cache to store.
    scope: dict[str, Any] = field(default_factory=dict)
    # Why the head breaks where it does (``_DECISIVE``): checked only by the artifact cache.
    plan_guards: list[Guard] = field(default_factory=list)


def arg_names(code: types.CodeType) -> tuple[str, ...]:
    """The argument locals of ``code``, in ``co_varnames`` order (the generated functions'
    parameters)."""
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)
    return code.co_varnames[:count]


def param_names(code: types.CodeType) -> tuple[str, ...]:
    """:func:`arg_names` spelled as identifiers, for generated code."""
    return tuple(safe_name(name) for name in arg_names(code))


def capture_frame(
    fn: types.FunctionType,
    values: tuple[Any, ...],
    compile_graph: Any,
    router: Callable[[Any], Any],
    fullgraph: bool = False,
    sizes: SizePolicy | None = None,
) -> Capture:
    """Capture ``fn`` called with argument locals ``values``; raise :class:`Skip` when the
    frame must run uncompiled, :class:`FullGraphError` when ``fullgraph`` and a break is needed.
    ``compile_graph`` compiles each captured graph; the generated code calls callees and resume
    functions through ``router`` (their compiled wrappers, with the same options)."""
    break_at: int | None = None
    first_break: GraphBreak | None = None
    inherited: list[Guard] = []
    for _ in range(MAX_RESTARTS):
        try:
            return _capture_once(
                fn, values, break_at, first_break, compile_graph, router, sizes, inherited
            )
        except Restart as restart:
            if fullgraph:
                error = restart.error
                where = f" at {error.location}" if error.location else ""
                raise FullGraphError(
                    f"fullgraph=True, but {fn.__qualname__} needs a graph break{where}: "
                    f"{error.reason.name} ({error.reason.value}): {error.detail}",
                    error.location,
                ) from error
            if break_at is not None and restart.offset >= break_at:
                raise Skip(
                    SkipReason.INTERNAL_ERROR, f"capture restarted twice at {restart.offset}"
                ) from restart
            break_at = restart.offset
            first_break = restart.error
            inherited = [guard for guard in restart.guards if isinstance(guard, _DECISIVE)]
    raise Skip(SkipReason.INTERNAL_ERROR, "too many capture restarts")


def _capture_once(
    fn: types.FunctionType,
    values: tuple[Any, ...],
    break_at: int | None,
    first_break: GraphBreak | None,
    compile_graph: Any,
    router: Callable[[Any], Any],
    sizes: SizePolicy | None = None,
    inherited: tuple[Guard, ...] | list[Guard] = (),
) -> Capture:
    code = fn.__code__
    if code.co_flags & (CO_GENERATOR | CO_ASYNC):
        raise Skip(SkipReason.GENERATOR, f"{code.co_qualname} is a generator or coroutine")
    for name, value in zip(arg_names(code), values, strict=True):
        # (a comprehension's ``.0`` in code run with routed calls; a decorator's ``*args``
        # passing ``model.parameters()`` on to clip_grad_norm_)
        items = value.values() if type(value) is dict else value if type(value) is tuple else ()
        iterator = next((v for v in (value, *items) if _is_iterator(v)), None)
        if iterator is not None:
            detail = f"{name!r} is or holds a {type(iterator).__name__}"
            raise Skip(SkipReason.ITERATOR_ARGUMENT, detail)
    session = Session(_graph_name(code), break_at, router, sizes)
    names = arg_names(code)
    binder = Binder()
    with _capturing(session):
        try:
            set_user_location(_definition(code))  # guards on arguments cite the def line
            session.add_guard(Identity(FunctionAttr("__globals__"), "globals", fn.__globals__))
            local_values = {
                n: session.wrap(v, Local(n)) for n, v in zip(names, values, strict=True)
            }
            cells = dict(zip(code.co_freevars, fn.__closure__ or (), strict=True))
            cells.update(_passed_cells(code, local_values))
            root = Frame(session, code, fn.__globals__, local_values, function=fn, cells=cells)
            plan: _ReturnPlan | _BreakPlan
            try:
                plan = _ReturnPlan(root.run())
            except BreakHere:
                assert first_break is not None
                plan = _break_plan(root, first_break)
            except GraphBreak as error:
                offset = root.current.offset if root.current is not None else 0
                raise Restart(offset, error, list(session.guards)) from error
            rebuild = Reconstructor(session, binder)
            rebuild.closure_cells = {id(c): i for i, c in enumerate(fn.__closure__ or ())}
            try:
                body = plan.lines(rebuild, fn)
            except Unreconstructible as error:
                raise Skip(SkipReason.UNRECONSTRUCTIBLE, str(error)) from error
            for proxy in session.input_proxies.values():
                if proxy._mutations:  # in-place updates of inputs, written back after the graph
                    session.graph.mutations.append((proxy._initial, proxy.current()))
            rebuild.outputs[:] = [_unaliased(session.graph, value) for value in rebuild.outputs]
            session.guard_sizes()
            session.guard_written_leaves()
        finally:
            session.undo()
            set_user_location(None)
    graph = session.graph
    graph.outputs = list(rebuild.outputs)
    graph.output_spec = None
    if not session.guard_distinct_mutated_inputs():
        raise Skip(SkipReason.ALIASED_MUTATION, "an input written in place shares memory")
    runner = None
    used = used_symbols(graph)  # (a size only Python code reads needs no compile per value)
    graph.symbols = tuple(name for name in session.shapes.symbols if name in used)
    if graph.nodes or graph.outputs or graph.mutations:
        captured = _snapshot(graph) if config.artifact_cache else None
        try:
            graph, compiled = compile_graph(graph)
        except Exception as error:  # (re-raised by the cache in strict mode)
            raise Skip(SkipReason.BACKEND_ERROR, f"{type(error).__name__}: {error}") from error
        runner = GraphRunner(graph, compiled, captured)
        shapes = session.shapes
        symbol_values = "".join(
            f"{size_expression(shapes.symbols[name], shapes, lambda s: s.expr(binder))}, "
            for name in graph.symbols
        )
        # (the parameters' paths share their modules' prefixes: each computed once into a
        # local, as the guards do; a GPT-2's input list walked ~900 dict lookups a call)
        before = dict(binder.uses)
        _input_list(session, binder)
        shared = [s for s, n in binder.uses.items() if n - before.get(s, 0) > 1]
        prelude = binder.hoist(shared)
        inputs = _input_list(session, binder)
        call = f"___out = {binder.bind(runner, 'graph')}({inputs}, ({symbol_values}))"
        body = [*prelude, call, *body]
    source = _head_source(param_names(code), body)
    scope = dict(binder.names)
    exec(compiled_code(source, f"<kiln head of {code.co_qualname}>"), scope)
    training = runner.compiled if runner is not None else None
    return Capture(
        saved=list(getattr(training, "saved_names", [])),
        head=scope["___head"],
        head_source=source,
        guards=list(session.guards),
        graph=graph if runner is not None else None,
        breaks=plan.breaks,
        resumes=plan.resumes,
        uncompiled=plan.uncompiled,
        shapes=session.shapes if session.shapes.symbols else None,
        scope=dict(binder.names),
        plan_guards=[guard for guard in inherited if guard not in session.guards],
    )


class _capturing:
    """The capture's global setup: builder, proxies' torch-function mode, is_compiling()."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.stack: list[Any] = []

    def __enter__(self) -> None:
        session = self.session
        mode = TraceMode(
            writable=session.writable_constant,
            on_constant=session.constant_tensor,
            is_constant=lambda tensor: (
                id(tensor) in session.constant_tensors or id(tensor) in session.input_proxies
            ),
        )
        for ctx in (self.session.builder, _compiling(), mode, active_env(session.shapes)):
            ctx.__enter__()
            self.stack.append(ctx)

    def __exit__(self, *exc: Any) -> None:
        while self.stack:
            self.stack.pop().__exit__(None, None, None)


# Prims whose reference implementation returns a view of its operand.
_VIEW_OPS = frozenset(
    {Op.RESHAPE, Op.PERMUTE, Op.BROADCAST, Op.EXPAND, Op.SLICE, Op.SQUEEZE, Op.UNSQUEEZE}
)


def _unaliased(graph: Graph, value: Value) -> Value:
    """``value``, copied if it is a view of a graph input: outputs that eager returns as views
    are re-created from the caller's tensor (``reconstruct``), so every graph output must be
    fresh memory (``x.t().contiguous()`` copies in eager)."""
    producers = {out: node for node in graph.nodes for out in node.outputs}
    current = value
    while current in producers and producers[current].op in _VIEW_OPS:
        current = producers[current].inputs[0]  # type: ignore[assignment]
    if current not in graph.inputs:
        return value
    return prims.convert(value, dtype=value.type.dtype)


def _snapshot(graph: Graph) -> Graph:
    """A copy of ``graph``'s values and nodes, for the artifact cache: passes rewire the
    nodes and values of the graph they are given (``out.node``, ``node.inputs``)."""
    values: dict[Value, Value] = {}

    def copied(operand: Any) -> Any:
        if isinstance(operand, Value) and operand not in values:
            values[operand] = copy.copy(operand)
        return values.get(operand, operand) if isinstance(operand, Value) else operand

    copy_ = copy.copy(graph)
    copy_.inputs = [copied(value) for value in graph.inputs]
    copy_.nodes = []
    for node in graph.nodes:
        new = copy.copy(node)
        new.inputs = tuple(copied(operand) for operand in node.inputs)
        new.outputs = tuple(copied(value) for value in node.outputs)
        for value in new.outputs:
            value.node = new
        copy_.nodes.append(new)
    copy_.outputs = [copied(value) for value in graph.outputs]
    copy_.mutations = [(copied(target), copied(new)) for target, new in graph.mutations]
    copy_.constants, copy_._names = dict(graph.constants), set(graph._names)
    return copy_


def _is_iterator(value: Any) -> bool:
    """A stateful iterator (not a container): iterating it during capture would consume the
    items the real call needs."""
    return hasattr(type(value), "__next__") and not isinstance(value, torch.Tensor)


def _definition(code: types.CodeType) -> SourceLocation:
    line = code.co_firstlineno
    return SourceLocation(code.co_filename, line, linecache.getline(code.co_filename, line).strip())


def _passed_cells(code: types.CodeType, local_values: dict[str, Any]) -> dict[str, Any]:
    """Cell variables a resume function receives as cell objects (it has no MAKE_CELL for
    them): they live in the frame's cells, not its locals."""
    made = {i.argval for i in dis.get_instructions(code) if i.opname == "MAKE_CELL"}
    passed = {}
    for name in code.co_cellvars:
        if name not in made and isinstance(local_values.get(name), types.CellType):
            passed[name] = local_values.pop(name)
    return passed


def _graph_name(code: types.CodeType) -> str:
    name = "".join(ch if ch.isalnum() else "_" for ch in code.co_name).strip("_")
    return name or "graph"


def _head_source(names: tuple[str, ...], body: list[str]) -> str:
    params = ", ".join(["___f", *names])
    lines = "".join(f"    {line}\n" for statement in body for line in statement.split("\n"))
    return f"def ___head({params}):\n{lines or '    pass'}\n"


def _input_list(session: Session, binder: Binder) -> str:
    sources = dict(session.inputs)
    items = []
    for value in session.graph.inputs:
        if value.kind is InputKind.CONSTANT:
            items.append(binder.bind(session.graph.constants[value.name], "const"))
        elif value.kind is InputKind.RNG_SEED:
            items.append(f"{binder.bind(_seed, 'seed')}()")
        else:
            items.append(sources[value].expr(binder))
    return "[" + ", ".join(items) + "]"


def _seed() -> torch.Tensor:
    return torch.randint(0, 2**62, (), dtype=torch.int64)


class GraphRunner:
    """Calls a compiled graph and writes mutated inputs back, as eager's in-place ops would."""

    def __init__(self, graph: Graph, compiled: Any, captured: Graph | None = None) -> None:
        self.graph = graph
        self.compiled = compiled
        self.captured = captured  # the graph before the pipeline (what the artifact cache keeps)
        self.count = len(graph.outputs)
        position = {value: i for i, value in enumerate(graph.inputs)}
        self.mutated = [position[target] for target, _ in graph.mutations]

    def __call__(self, inputs: list[torch.Tensor], sizes: tuple[int, ...]) -> list[torch.Tensor]:
        # (``sizes``: the values of the graph's symbols, read off the frame by the head)
        results = self.compiled(inputs, sizes) if sizes else self.compiled(inputs)
        if self.mutated:
            with torch.no_grad():
                for index, new in zip(self.mutated, results[self.count :], strict=True):
                    if not _same_memory(inputs[index], new):  # else written in place
                        inputs[index].copy_(new)
        return results


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` is ``a``'s memory with ``a``'s layout (a backend wrote it in place; an
    autograd Function returns such an input as a view of it)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.device == b.device
    )


# --- plans: how the head ends -------------------------------------------------------------
@dataclass
class _ReturnPlan:
    value: Any
    breaks: list[BreakRecord] = field(default_factory=list)
    resumes: list[Any] = field(default_factory=list)
    uncompiled: list[BreakRecord] = field(default_factory=list)

    def lines(self, rebuild: Reconstructor, fn: types.FunctionType) -> list[str]:
        result = rebuild.value(self.value)
        rebuild.effects()
        return [*rebuild.lines, f"return {result}"]


@dataclass
class _BreakPlan:
    frame: Frame
    kind: str  # "call", "branch", "bool", "operation", "native"
    error: GraphBreak
    breaks: list[BreakRecord] = field(default_factory=list)
    resumes: list[Any] = field(default_factory=list)
    uncompiled: list[BreakRecord] = field(default_factory=list)
    handler: ExceptionEntry | None = None  # the try body's entry, for a break inside one

    def lines(self, rebuild: Reconstructor, fn: types.FunctionType) -> list[str]:
        rebuild.effects()
        return emit_break(self, rebuild, fn)


def _break_plan(root: Frame, error: GraphBreak) -> _BreakPlan:
    inst = root.current
    assert inst is not None
    record = BreakRecord(error.reason, error.detail, error.location, root.code.co_qualname)
    kind = _break_kind(inst)
    handler = _check_breakable(root, inst, f"{error.reason.name}: {error.detail}", kind)
    plan = _BreakPlan(root, kind, error, breaks=[record], handler=handler)
    if kind == "native":
        detail = f"the rest of the frame, from {inst.opname} at the break on: {error.detail}"
        plan.uncompiled.append(
            BreakRecord(
                SkipReason.RESUMED_UNCOMPILED, detail, error.location, root.code.co_qualname
            )
        )
    return plan


def _break_kind(inst: dis.Instruction) -> str:
    if inst.opname in ("CALL", "CALL_KW", "CALL_FUNCTION_EX", "PRECALL"):
        return "call"
    if "JUMP" in inst.opname and ("IF_TRUE" in inst.opname or "IF_FALSE" in inst.opname):
        return "branch"
    if inst.opname == "TO_BOOL":
        return "bool"
    if inst.opname in OPERATIONS and (inst.opname != "BINARY_OP" or inst.argrepr in OPERATORS):
        return "operation"
    return "native"


def _check_breakable(
    root: Frame, inst: dis.Instruction, why: str, kind: str
) -> ExceptionEntry | None:
    """Skip the frame where a break cannot be resumed; the ``try`` body entry whose handler
    the native step must lead to when it raises, when the break is directly inside one."""
    location = root.location
    for other in root.instructions:
        if (
            other.opname.startswith("JUMP_BACKWARD") or "BACKWARD_IF" in other.opname
        ) and other.offset > inst.offset >= other.argval:
            raise Skip(SkipReason.BREAK_IN_LOOP, why, location)
    handler: ExceptionEntry | None = None
    if _in_try(root, inst.offset):
        handler = root.covering_entry(inst.offset)
        # Resumable: a break directly in a try body (not in a handler, not in a with block
        # inside the try), at a step the head performs, which it can send to the handler.
        if handler is None or handler.lasti or _is_with_handler(root, handler):
            raise Skip(SkipReason.BREAK_IN_TRY, why, location)
        if kind not in ("call", "operation", "bool"):
            raise Skip(SkipReason.BREAK_IN_TRY, why, location)
    for item in root.stack:
        exit_method = isinstance(item, types.MethodType) and item.__name__ == "__exit__"
        if exit_method and not is_known_context(root.entered.get(id(item))):
            raise Skip(SkipReason.BREAK_IN_WITH, why, location)
    return handler


def _is_with_handler(root: Frame, entry: ExceptionEntry) -> bool:
    handler = root.instructions[root.index[entry.target] : root.index[entry.target] + 2]
    return [i.opname for i in handler] == ["PUSH_EXC_INFO", "WITH_EXCEPT_START"]


def _in_try(root: Frame, offset: int) -> bool:
    entry = root.covering_entry(offset)
    while entry is not None:
        if not _is_with_handler(root, entry):
            return True
        cleanup = root.covering_entry(entry.target)
        entry = root.covering_entry(cleanup.target) if cleanup is not None else None
    return False


__all__ = [
    "Capture",
    "GraphRunner",
    "Restart",
    "Skip",
    "arg_names",
    "capture_frame",
    "param_names",
]
