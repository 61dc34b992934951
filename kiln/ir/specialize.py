"""Graphs with symbolic sizes: which symbols they use, how to bind them from a call's inputs,
and the same graph with every symbol replaced by its value.

A captured graph's input types may have symbolic dims (``f32[s0, 768]``); so may its node
attributes (``reshape(t0, shape=(s0, 12, 64))``) and scalar operands (``mul(t1, s0)``). Every
symbol is a dim of some input, so the sizes of a call's inputs bind them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kiln.ir.graph import Graph, Node, Value
from kiln.ir.symbolic import Dim, Sym, Symbol, substitute
from kiln.ir.types import TensorType


def sizes_in(value: Any) -> list[Any]:
    """The sizes (ints and symbols) in an attrs value or scalar operand, through tuples, lists,
    dicts and dataclass fields (not into a nested graph: its own nodes are typed)."""
    if isinstance(value, Sym):
        return [value]
    if isinstance(value, tuple | list):
        return [size for item in value for size in sizes_in(item)]
    if type(value) is dict:
        return [size for item in value.values() for size in sizes_in(item)]
    if isinstance(value, Graph | Value | Node):
        return []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [s for f in dataclasses.fields(value) for s in sizes_in(getattr(value, f.name))]
    return []


def used_symbols(graph: Graph) -> set[str]:
    """The names of the symbols ``graph``'s work depends on: the types of the inputs it reads
    and of its values, its attributes and scalar operands (an input read only for its size
    by Python code does not count)."""
    read = {value for node in graph.nodes for value in node.input_values()}
    read |= set(graph.outputs) | {target for target, _ in graph.mutations}
    sizes = [size for value in graph.inputs if value in read for size in value.type.shape]
    for node in graph.nodes:
        sizes += [size for out in node.outputs for size in out.type.shape]
        sizes += sizes_in(node.attrs) + sizes_in(node.inputs)
    return {s.name for size in sizes if isinstance(size, Sym) for s in size.symbols()}


def symbols_of(graph: Graph) -> dict[str, Symbol]:
    """The symbols ``graph``'s sizes mention, by name (with their ranges)."""
    sizes = [size for value in graph.inputs for size in value.type.shape]
    for node in graph.nodes:
        sizes += [size for out in node.outputs for size in out.type.shape]
        sizes += sizes_in(node.attrs) + sizes_in(node.inputs)
    return {s.name: s for size in sizes if isinstance(size, Sym) for s in size.symbols()}


def rehint(graph: Graph, values: Mapping[str, int]) -> Graph:
    """``graph`` with its symbols kept but hinted by ``values`` (the sizes of the call being
    compiled), so that what later stages decide by hint follows that call's sizes."""
    hinted: dict[str, Dim] = {
        name: Sym.symbol(name, values[name], symbol.low, symbol.high)
        for name, symbol in symbols_of(graph).items()
        if name in values
    }
    result = specialize(graph, hinted)
    result.symbols = graph.symbols
    return result


def size_places(graph: Graph) -> dict[str, tuple[int, int]]:
    """Where each symbol of ``graph``'s input types can be read at run time: (input position,
    dim) of the first input dim that is exactly that symbol."""
    places: dict[str, tuple[int, int]] = {}
    for position, value in enumerate(graph.inputs):
        for dim, size in enumerate(value.type.shape):
            if isinstance(size, Sym) and len(size.terms) == 1 and size.terms[0][1] == 1:
                atoms = size.terms[0][0]
                if len(atoms) == 1 and isinstance(atoms[0], Symbol):
                    places.setdefault(atoms[0].name, (position, dim))
    return places


def sized_node(node: Node, values: Mapping[str, int]) -> Node:
    """A copy of ``node`` (its attributes, operand and result types) at the sizes ``values``;
    the results keep their names."""
    operands = list(dict.fromkeys(node.input_values()))
    alone = Graph(inputs=operands, nodes=[node], outputs=list(node.outputs))
    return specialize(alone, values).nodes[0]


def mentions_symbols(node: Node) -> bool:
    """Whether ``node``'s attributes or the types it reads or makes have symbolic sizes."""
    types = [v.type for v in (*node.input_values(), *node.outputs)]
    return bool(sizes_in(node.attrs)) or any(t.is_symbolic for t in types)


def specialize(graph: Graph, values: Mapping[str, Dim]) -> Graph:
    """A copy of ``graph`` with every symbol replaced by its value in ``values``."""
    result = Graph(name=graph.name, constants=dict(graph.constants), output_spec=graph.output_spec)
    result.symbols = ()
    result.user_outputs = graph.user_outputs
    renamed: dict[Value, Value] = {}

    def typed(kind: TensorType) -> TensorType:
        return kind.with_(shape=tuple(substitute(dim, values) for dim in kind.shape))

    for value in graph.inputs:
        copy = Value(value.name, typed(value.type), kind=value.kind, source=value.source)
        renamed[value] = copy
        result.inputs.append(copy)
    for node in graph.nodes:
        inputs = tuple(
            renamed[item] if isinstance(item, Value) else substitute(item, values)
            for item in node.inputs
        )
        new = Node(
            node.op, inputs, substitute_deep(node.attrs, values), (), node.origin, node.recompute
        )
        new.outputs = tuple(Value(out.name, typed(out.type), new) for out in node.outputs)
        renamed.update(zip(node.outputs, new.outputs, strict=True))
        result.nodes.append(new)
    result.outputs = [renamed[value] for value in graph.outputs]
    result.mutations = [(renamed[a], renamed[b]) for a, b in graph.mutations]
    result._names = set(graph._names)
    result._counter = graph._counter
    return result


def substitute_deep(value: Any, values: Mapping[str, Dim]) -> Any:
    """``value`` with symbols replaced, through tuples, lists and dataclasses."""
    if isinstance(value, Sym):
        return substitute(value, values)
    if isinstance(value, Graph):  # (an autograd.Function's backward, captured with the graph)
        return specialize(value, values) if _mentions_symbols(value) else value
    if type(value) in (tuple, list) or (isinstance(value, tuple) and not hasattr(value, "_fields")):
        items = [substitute_deep(item, values) for item in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return list(items) if type(value) is list else tuple(items)  # (a symbolic shape too)
    if type(value) is dict:
        changed = {key: substitute_deep(item, values) for key, item in value.items()}
        return value if all(changed[k] is value[k] for k in value) else changed
    if isinstance(value, Value | Node):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for field in dataclasses.fields(value):
            if not field.init:
                continue
            old = getattr(value, field.name)
            new = substitute_deep(old, values)
            if new is not old:
                changes[field.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    return value


def _mentions_symbols(graph: Graph) -> bool:
    return any(value.type.is_symbolic for value in graph.inputs) or any(
        out.type.is_symbolic for node in graph.nodes for out in node.outputs
    )
