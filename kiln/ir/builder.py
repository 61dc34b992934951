"""Emitting nodes into the graph under construction.

Frontends (tracing now, bytecode capture later) open a :class:`GraphBuilder`; while it is
active, prims called on :class:`Value` operands append nodes to its graph instead of running.
The builder stamps each node with the current :class:`Origin` and computes its output types
with the op's meta, so a bad shape or dtype fails at the op that caused it, with the user's line.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from kiln.errors import KilnError, SourceLocation, op_error
from kiln.ir.graph import Graph, InputKind, Operand, Origin, Value
from kiln.ir.op import Op, Tag, op_def
from kiln.ir.symbolic import Dim
from kiln.ir.types import TensorType, carries_gradient

_active: contextvars.ContextVar[GraphBuilder | None] = contextvars.ContextVar(
    "kiln_graph_builder", default=None
)


class GraphBuilder:
    """Appends nodes to ``graph``; use as a context manager to make it the active builder."""

    def __init__(self, graph: Graph | None = None) -> None:
        self.graph = graph if graph is not None else Graph()
        self.origin = Origin("")
        self._token: contextvars.Token[GraphBuilder | None] | None = None
        self._constants: dict[int, tuple[torch.Tensor, Value]] = {}
        # Constants written in place by traced values: id -> their value now.
        self._rebound: dict[int, Value] = {}
        self._rng_seed: Value | None = None
        self._rng_offset: Dim = 0
        self.recompute = False  # nodes emitted now carry the partitioner's recompute hint

    def constant(self, tensor: torch.Tensor) -> Value:
        """The graph input holding ``tensor`` (a program constant), lifted once per tensor; its
        value now, if the program has written it in place since."""
        key = id(tensor)
        if key in self._rebound:
            return self._rebound[key]
        if key not in self._constants:
            self._constants[key] = (tensor, self.graph.add_constant(tensor.detach()))
        return self._constants[key][1]

    def rebind_constant(self, tensor: torch.Tensor, value: Value) -> None:
        """``tensor`` (a constant) was written in place: its value is ``value`` from now on."""
        self.constant(tensor)
        self._rebound[id(tensor)] = value

    def written_constant(self, tensor: torch.Tensor) -> Value | None:
        """The value of a constant the program wrote in place, or None."""
        return self._rebound.get(id(tensor))

    def rng_seed(self) -> Value:
        """The graph's int64 seed input, drawn from torch's generator on every call."""
        if self._rng_seed is None:
            self._rng_seed = self.graph.add_input(
                TensorType((), torch.int64), name="rng_seed", kind=InputKind.RNG_SEED
            )
        return self._rng_seed

    def rng_offset(self, count: Dim) -> Dim:
        """Reserve ``count`` numbers of the graph's random stream; return where they start (a
        symbolic offset after a symbolic count: the stretches never overlap, whatever the
        sizes)."""
        start = self._rng_offset
        self._rng_offset = start + max(count, 1)
        return start

    def __enter__(self) -> GraphBuilder:
        self._token = _active.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _active.reset(self._token)
        self._token = None

    @contextlib.contextmanager
    def recompute_scope(self) -> Iterator[None]:
        """Nodes emitted inside the block are recomputed in the backward, never saved."""
        previous, self.recompute = self.recompute, True
        try:
            yield
        finally:
            self.recompute = previous

    @contextlib.contextmanager
    def origin_scope(self, origin: Origin) -> Iterator[None]:
        """Nodes emitted inside the block get ``origin`` (the outermost API call wins)."""
        if self.origin.api:
            yield
            return
        self.origin = origin
        try:
            yield
        finally:
            self.origin = Origin("")

    def emit(self, op: Op, inputs: tuple[Operand, ...], attrs: Any) -> Value | tuple[Value, ...]:
        definition = op_def(op)
        operand_types = tuple(i.type if isinstance(i, Value) else i for i in inputs)
        try:
            types = definition.meta(attrs, *operand_types)
        except KilnError:
            raise
        except (TypeError, ValueError, RuntimeError, IndexError) as error:
            raise _op_error(op, error, self.origin) from error
        output_types = types if isinstance(types, tuple) else (types,)
        requires_grad = (
            torch.is_grad_enabled()
            and Tag.NONDIFFERENTIABLE not in definition.tags
            and any(isinstance(i, Value) and i.type.requires_grad for i in inputs)
        )
        output_types = tuple(
            t.with_(requires_grad=requires_grad and carries_gradient(t.dtype)) for t in output_types
        )
        node = self.graph.append(op, inputs, attrs, output_types, self.origin)
        node.recompute = self.recompute
        return node.outputs if isinstance(types, tuple) else node.outputs[0]


def _op_error(op: Op, error: Exception, origin: Origin) -> KilnError:
    location = SourceLocation(origin.file, origin.line) if origin.file else None
    api = f" (from {origin.api})" if origin.api else ""
    text = str(error).removeprefix(f"{op.printed_name}: ")
    return op_error(f"{op.printed_name}{api}: {text}", error, location)


def active_builder() -> GraphBuilder | None:
    return _active.get()


def require_builder() -> GraphBuilder:
    builder = _active.get()
    if builder is None:
        raise RuntimeError("no graph is being built: open a GraphBuilder first")
    return builder


def emit(op: Op, *inputs: Operand, attrs: Any = None) -> Value | tuple[Value, ...]:
    """Append ``op`` to the active graph and return its output value(s)."""
    return require_builder().emit(op, inputs, attrs)


def check_types(expected: TensorType, actual: TensorType) -> bool:
    """Whether two types agree on shape, dtype and device (requires_grad is the builder's)."""
    return (expected.shape, expected.dtype, expected.device) == (
        actual.shape,
        actual.dtype,
        actual.device,
    )
