"""The backend registry, the interface every backend implements, and the public backend API.

A backend turns a verified :class:`~kiln.ir.Graph` into a :data:`CompiledGraph`: a callable that
takes the graph's inputs (in ``graph.inputs`` order) and returns the graph's outputs followed by
the new values of mutated inputs, exactly like :func:`kiln.ir.interpret`. Writing mutations
back and rebuilding the user's return structure is the caller's job, so backends stay small.

Users register a backend the way ``torch.compile`` takes one, as a compile function::

    def my_backend(graph: kiln.Graph, example_inputs: list[torch.Tensor]):
        return lambda inputs: kiln.ir.interpret(graph, inputs)

    kiln.register_backend("mine", my_backend)
    kiln.compile(model, backend="mine")

``example_inputs`` are the first call's tensors. A backend that declares
:class:`Capabilities` gets only the parts of a graph it supports (``kiln/backends/split.py``).
Installed packages add backends through the entry-point group ``kiln.backends`` (an entry
names a compile function or a :class:`Backend` object), discovered on the first lookup of a
name not registered here.
"""

from __future__ import annotations

import importlib.metadata
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kiln.config import logger
from kiln.errors import BackendError
from kiln.ir.graph import Graph, Node
from kiln.ir.op import Op, Tag, op_def
from kiln.options import Options
from kiln.recording import record

CompiledGraph = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
CompileFn = Callable[[Graph, list[torch.Tensor]], Callable[..., Any]]
ENTRY_POINT_GROUP = "kiln.backends"
DEFAULT_BACKEND = "kiln"

_log = logger("backends")


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run: prims (``None``: all), dtypes of every operand and result
    (``None``: all), and a rule of its own for finer limits (``refuse(node)`` returns why the
    node cannot run there, or ``""``)."""

    ops: frozenset[Op] | None = None
    dtypes: frozenset[torch.dtype] | None = None
    refuse: Callable[[Node], str] | None = None

    def refusal(self, node: Node) -> str:
        """Why ``node`` cannot run on the backend; ``""`` when it can.

        >>> Capabilities(ops=frozenset({Op.ADD})).refusal(sin_node)
        'op sin not supported'
        """
        if self.ops is not None and node.op not in self.ops:
            return f"op {node.op.printed_name} not supported"
        if self.dtypes is not None:
            for value in (*node.input_values(), *node.outputs):
                if value.type.dtype not in self.dtypes:
                    return f"dtype {str(value.type.dtype).replace('torch.', '')} not supported"
        return self.refuse(node) if self.refuse is not None else ""


class Backend(Protocol):
    """Compiles graphs. ``name`` is how users select it: ``kiln.compile(f, backend=name)``;
    ``options`` are the compile's (the code generator, strict mode, ...). A backend may also
    have a ``capabilities`` attribute (:class:`Capabilities`): then the pipeline's partitioner
    gives it only what it supports."""

    @property
    def name(self) -> str: ...

    def compile(self, graph: Graph, options: Options) -> CompiledGraph: ...


@dataclass
class BackendRecord:
    """An event for ``kiln.explain``'s ``backends`` section: how a graph was split between
    backends, or that a backend failed and the default one took over."""

    graph: str
    lines: list[str]
    ops_on: dict[str, int] = field(default_factory=dict)  # backend -> ops it runs
    pieces: list[str] = field(default_factory=list)  # backend of each subgraph, in order

    def backend_lines(self) -> list[str]:
        return [f"{self.graph}: {line}" for line in self.lines]


@dataclass(frozen=True)
class FunctionBackend:
    """A backend given as a compile function, compiled at each graph's first call."""

    name: str
    compile_fn: CompileFn
    capabilities: Capabilities | None = None

    def compile(self, graph: Graph, options: Options) -> CompiledGraph:
        return FirstCallCompile(self, graph, options)


class FirstCallCompile:
    """Calls the compile function with the first call's inputs; if it raises, the graph runs on
    the default backend, with a warning (``Options.strict``, or random ops, raise instead)."""

    def __init__(self, backend: FunctionBackend, graph: Graph, options: Options) -> None:
        self.backend, self.graph, self.options = backend, graph, options
        self.run: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.run is None:
            with self._lock:
                if self.run is None:
                    self.run = self._compile(list(inputs))
        with torch.no_grad():  # autodiff ran already: the backward is a graph of its own
            return list(self.run(inputs))

    def _compile(self, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        name = self.backend.name
        try:
            return self.backend.compile_fn(self.graph, inputs)
        except Exception as error:
            # A graph with random ops cannot fall back alone: the default backend draws other
            # numbers, and a forward/backward pair must see the same ones (a dropout mask).
            random = any(Tag.RANDOM in op_def(node.op).tags for node in self.graph.nodes)
            if self.options.strict or random:
                raise BackendError(f"backend {name!r} failed on {self.graph.name}") from error
            reason = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            message = (
                f"backend {name!r} failed to compile graph {self.graph.name} ({reason}); "
                f"it runs on the default backend {DEFAULT_BACKEND!r}"
            )
            warnings.warn(f"kiln: {message}", stacklevel=3)
            _log.warning("%s", message)
            record(BackendRecord(self.graph.name, [message], pieces=[DEFAULT_BACKEND]))
            return lookup_backend(DEFAULT_BACKEND).compile(self.graph, self.options)


_BACKENDS: dict[str, Backend] = {}
_DISCOVERED: list[bool] = []  # non-empty once the entry points were read


def add_backend(backend: Backend) -> Backend:
    """Make ``backend`` selectable by its name; a second backend of the same name is an error."""
    if backend.name in _BACKENDS:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend
    return backend


def lookup_backend(name: str) -> Backend:
    """The backend registered as ``name`` (entry points are read on the first miss)."""
    if name not in _BACKENDS:
        discover_backends()
    try:
        return _BACKENDS[name]
    except KeyError:
        known = ", ".join(list_backends())
        raise BackendError(f"unknown backend {name!r} (registered: {known})") from None


def discover_backends() -> None:
    """Register the backends installed packages declare in the ``kiln.backends`` entry-point
    group (once per process; one that fails to load is skipped with a warning)."""
    if _DISCOVERED:
        return
    _DISCOVERED.append(True)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in _BACKENDS:
            continue
        try:
            loaded = entry.load()
        except Exception as error:
            warnings.warn(f"kiln: backend entry point {entry.value} failed: {error}", stacklevel=2)
            continue
        if not hasattr(loaded, "compile"):
            loaded = FunctionBackend(entry.name, loaded, getattr(loaded, "capabilities", None))
        _BACKENDS[entry.name] = loaded


def register_backend(
    name: str, compile_fn: CompileFn, *, capabilities: Capabilities | None = None
) -> None:
    """Make ``kiln.compile(f, backend=name)`` compile with ``compile_fn(graph, example_inputs)``,
    which returns a callable taking the graph's inputs (``graph.inputs`` order) and returning
    its outputs then the new values of mutated inputs. With ``capabilities``, the backend gets
    the subgraphs it supports and the default backend runs the rest."""
    add_backend(FunctionBackend(name, compile_fn, capabilities))


def get_backend(name: str) -> CompileFn:
    """The compile function of backend ``name`` (built-in ones too): ``get_backend("eager")(
    graph, inputs)(inputs)`` runs ``graph``."""
    backend = lookup_backend(name)
    if isinstance(backend, FunctionBackend):
        return backend.compile_fn

    def compile_fn(graph: Graph, example_inputs: list[torch.Tensor]) -> CompiledGraph:
        return backend.compile(graph, Options(backend=name))

    return compile_fn


def list_backends() -> list[str]:
    """The names of every backend, installed packages' included."""
    discover_backends()
    return sorted(_BACKENDS)
