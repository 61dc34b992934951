"""The graph IR: SSA values, nodes and graphs.

A :class:`Graph` has inputs, a topologically ordered list of :class:`Node` and outputs. Every
value is defined once: by the graph (an input) or by one node (one of its outputs). Node
operands are values, Python scalars or ``None`` (an absent optional input). Mutations of graph
inputs (in-place ops on module buffers, for example) are functionalized: the graph computes the
new value and lists ``(input, new value)`` in :attr:`Graph.mutations`; whoever runs the graph
writes the new value back.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.ir.op import Op
from kiln.ir.types import Scalar, TensorType


class InputKind(enum.Enum):
    """What a graph input stands for, so a runner knows where to fetch it."""

    USER = "user"  # an argument of the traced function
    PARAMETER = "parameter"  # a module parameter, by attribute path
    BUFFER = "buffer"  # a module buffer, by attribute path
    CONSTANT = "constant"  # a tensor the program closed over; stored in Graph.constants
    RNG_SEED = "rng_seed"  # an int64 scalar drawn from torch's generator on every call


@dataclass(frozen=True)
class Origin:
    """Where a node came from: the torch API called and the user's source line."""

    api: str
    file: str = ""
    line: int = 0

    def __str__(self) -> str:
        if not self.file:
            return self.api
        short = self.file.rsplit("/", 1)[-1]
        return f"{self.api}  {short}:{self.line}"


@dataclass(eq=False)
class Value:
    """An SSA value: a graph input or one output of a node. Compared by identity."""

    name: str
    type: TensorType
    node: Node | None = None
    kind: InputKind | None = None
    source: str = ""  # for inputs: argument path or module attribute path

    def __repr__(self) -> str:
        return f"{self.name}: {self.type}"


Operand = Value | Scalar | None


@dataclass(eq=False)
class Node:
    """One op application. ``attrs`` is the op's attribute dataclass instance (or ``None``)."""

    op: Op
    inputs: tuple[Operand, ...]
    attrs: Any
    outputs: tuple[Value, ...] = ()
    origin: Origin = field(default_factory=lambda: Origin(""))
    # The user asked for this work to be recomputed in the backward rather than saved
    # (``torch.utils.checkpoint``): a hint to the partitioner.
    recompute: bool = False

    @property
    def output(self) -> Value:
        """The only output of a single-output node."""
        assert len(self.outputs) == 1, f"{self.op.name} has {len(self.outputs)} outputs"
        return self.outputs[0]

    def input_values(self) -> Iterator[Value]:
        return (operand for operand in self.inputs if isinstance(operand, Value))


class Donated(list[Any]):
    """Inputs a compiled graph may release after their last use: its host program empties the
    list once it holds them (the CUDA-graph runner's static copies of the inputs while it
    records: the recording's later steps may then take their memory)."""


@dataclass(eq=False)
class Graph:
    """A program in prims: inputs, nodes in topological order, outputs."""

    inputs: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    mutations: list[tuple[Value, Value]] = field(default_factory=list)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    name: str = "graph"
    output_spec: Any = None  # how to rebuild the user's return structure from outputs
    # The symbolic sizes the graph's types use, in the order a caller passes their values.
    symbols: tuple[str, ...] = ()
    # How many leading outputs the caller receives as results, laid out as eager would (the
    # pipeline sets it before the backend: a training forward's saved values are not results).
    user_outputs: int | None = None
    _names: set[str] = field(default_factory=set, repr=False)
    _counter: int = field(default=0, repr=False)

    def fresh_name(self, hint: str = "t") -> str:
        """A value name not yet used in this graph (``t0``, ``t1``, or a sanitized hint)."""
        if hint != "t":
            base = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in hint) or "v"
            if base[0].isdigit():
                base = "v_" + base
            name, suffix = base, 1
            while name in self._names:
                name, suffix = f"{base}_{suffix}", suffix + 1
        else:
            name = f"t{self._counter}"
            while name in self._names:
                self._counter += 1
                name = f"t{self._counter}"
            self._counter += 1
        self._names.add(name)
        return name

    def add_input(
        self,
        type_: TensorType,
        *,
        name: str = "t",
        kind: InputKind = InputKind.USER,
        source: str = "",
    ) -> Value:
        value = Value(self.fresh_name(name), type_, kind=kind, source=source or name)
        self.inputs.append(value)
        return value

    def add_constant(self, tensor: torch.Tensor, name: str = "c") -> Value:
        """Lift a concrete tensor into a graph input whose value the graph stores."""
        value = self.add_input(
            TensorType.of(tensor).with_(requires_grad=False), name=name, kind=InputKind.CONSTANT
        )
        self.constants[value.name] = tensor
        return value

    def append(
        self,
        op: Op,
        inputs: tuple[Operand, ...],
        attrs: Any,
        output_types: tuple[TensorType, ...],
        origin: Origin,
    ) -> Node:
        """Append a node whose output types were already computed (by the op's meta)."""
        node = Node(op, inputs, attrs, origin=origin)
        node.outputs = tuple(Value(self.fresh_name(), t, node) for t in output_types)
        self.nodes.append(node)
        return node

    def users(self) -> dict[Value, list[Node]]:
        """Map each value to the nodes that read it."""
        result: dict[Value, list[Node]] = {v: [] for v in self.inputs}
        for node in self.nodes:
            for out in node.outputs:
                result[out] = []
        for node in self.nodes:
            for value in node.input_values():
                result.setdefault(value, []).append(node)
        return result

    def __str__(self) -> str:
        from kiln.ir.printer import format_graph

        return format_graph(self)
