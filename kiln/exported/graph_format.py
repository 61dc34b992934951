"""A graph as JSON-able data, and back: the ``graph.json`` of a saved program.

Nodes name their op (``Op`` member name) and list operands and typed attributes; values are
referred to by name; a symbolic size is its polynomial over the graph's symbol table. Every
non-JSON value is a one-key object tagged by its kind::

    {"op": "RESHAPE", "inputs": [{"value": "x"}],
     "attrs": {"dataclass": "kiln.ops.attrs:ReshapeAttrs",
               "fields": {"shape": {"tuple": [{"sym": [[["batch"], 1]]}, 8]}}},
     "outputs": [["t0", {"shape": [...], "dtype": "float32", ...}]], "origin": [...]}

Classes and callables are stored by importable name and resolved on load only inside the
packages in ``IMPORTABLE`` (a saved program never imports the model's own source).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
from typing import Any

import torch

from kiln.errors import KilnError
from kiln.ir.graph import Graph, InputKind, Node, Origin, Value
from kiln.ir.op import Op
from kiln.ir.printer import callable_name
from kiln.ir.symbolic import Division, Relation, Sym, Symbol
from kiln.ir.types import TensorType

IMPORTABLE = ("torch", "kiln", "math", "operator", "builtins", "_operator")

_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class GraphFormatError(KilnError):
    """A graph that cannot be written as data, or data that is not a valid graph."""


class Encoder:
    """Writes graph parts as data; collects the symbols the sizes use."""

    def __init__(self) -> None:
        self.symbols: dict[str, Symbol] = {}

    def type(self, kind: TensorType) -> dict[str, Any]:
        return {
            "shape": [self.value(dim) for dim in kind.shape],
            "dtype": str(kind.dtype).removeprefix("torch."),
            "device": str(kind.device),
            "requires_grad": kind.requires_grad,
        }

    def sym(self, size: Sym) -> list[Any]:
        return [[[self.atom(atom) for atom in mono], coef] for mono, coef in size.terms]

    def atom(self, atom: Symbol | Division) -> Any:
        if isinstance(atom, Symbol):
            self.symbols[atom.name] = atom
            return atom.name
        parts = [self.sym(atom.numerator), self.sym(atom.denominator)]
        return {"mod" if atom.modulo else "div": parts}

    def value(self, item: Any) -> Any:
        """``item`` (an operand, attribute or part of one) as data."""
        if item is None or isinstance(item, bool | int | str):
            return item
        if isinstance(item, float):
            return item if math.isfinite(item) else {"float": repr(item)}
        if isinstance(item, Value):
            return {"value": item.name}
        if isinstance(item, Sym):
            return {"sym": self.sym(item)}
        if type(item) in (tuple, torch.Size):
            return {"tuple": [self.value(part) for part in item]}
        if type(item) is list:
            return [self.value(part) for part in item]
        if type(item) is dict:
            return {"dict": [[self.value(k), self.value(v)] for k, v in item.items()]}
        if isinstance(item, torch.device):
            return {"device": str(item)}
        if isinstance(item, slice):
            return {"slice": [self.value(p) for p in (item.start, item.stop, item.step)]}
        if item is Ellipsis:
            return {"ellipsis": None}
        if isinstance(item, torch.dtype | torch.memory_format | torch.layout):
            return {"torch": str(item).removeprefix("torch.")}
        if isinstance(item, enum.Enum):
            return {"enum": _class_name(type(item)), "name": item.name}
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            fields = {
                f.name: self.value(getattr(item, f.name))
                for f in dataclasses.fields(item)
                if f.init
            }
            return {"dataclass": _class_name(type(item)), "fields": fields}
        if callable(item):
            name = callable_name(item)
            if _resolve(name) is not item:
                raise GraphFormatError(f"cannot save a call to {name}: it is not importable")
            return {"callable": name}
        raise GraphFormatError(f"cannot save a {type(item).__name__} ({item!r:.80})")

    def node(self, node: Node) -> dict[str, Any]:
        try:
            return {
                "op": node.op.name,
                "inputs": [self.value(operand) for operand in node.inputs],
                "attrs": self.value(node.attrs),
                "outputs": [[out.name, self.type(out.type)] for out in node.outputs],
                "origin": [node.origin.api, node.origin.file, node.origin.line],
                "recompute": node.recompute,
            }
        except GraphFormatError as error:
            raise GraphFormatError(f"{error} (node {node.op.name}, {node.origin})") from None

    def relation(self, relation: Relation) -> dict[str, Any]:
        return {
            "sym": self.sym(relation.expression),
            "relation": relation.relation,
            "why": relation.why,
        }


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(dotted: str) -> Any:
    """The object a ``module.attr.attr`` or ``module:Qual.name`` name stands for, imported
    only from the packages in ``IMPORTABLE``; None when there is none."""
    module_name, _, attrs = dotted.partition(":")
    parts = module_name.split(".") if not attrs else [module_name]
    if parts[0].split(".")[0] not in IMPORTABLE:
        return None
    rest = attrs.split(".") if attrs else []
    while parts:
        try:
            found: Any = importlib.import_module(".".join(parts))
            break
        except ImportError:
            rest.insert(0, parts.pop())
    else:
        return None
    for attr in rest:
        found = getattr(found, attr, None)
    return found


def encode_graph(graph: Graph, encoder: Encoder) -> dict[str, Any]:
    """``graph`` as data (its constants' tensors are saved with the weights, by name)."""
    return {
        "name": graph.name,
        "inputs": [
            [v.name, encoder.type(v.type), (v.kind or InputKind.USER).value, v.source]
            for v in graph.inputs
        ],
        "nodes": [encoder.node(node) for node in graph.nodes],
        "outputs": [value.name for value in graph.outputs],
        "mutations": [[target.name, new.name] for target, new in graph.mutations],
        "symbols": list(graph.symbols),
    }


def encode_symbols(encoder: Encoder) -> dict[str, list[Any]]:
    return {name: [s.hint, s.low, s.high] for name, s in encoder.symbols.items()}


class Decoder:
    """Reads what :class:`Encoder` wrote; the graph's values by name."""

    def __init__(self, symbols: dict[str, list[Any]]) -> None:
        self.symbols = {name: Symbol(name, *fields) for name, fields in symbols.items()}
        self.values: dict[str, Value] = {}

    def type(self, data: dict[str, Any]) -> TensorType:
        shape = tuple(self.value(dim) for dim in data["shape"])
        dtype = getattr(torch, data["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise GraphFormatError(f"unknown dtype {data['dtype']!r}")
        return TensorType(shape, dtype, torch.device(data["device"]), bool(data["requires_grad"]))

    def sym(self, terms: list[Any]) -> Sym:
        return Sym({tuple(self.atom(atom) for atom in mono): coef for mono, coef in terms})

    def atom(self, data: Any) -> Symbol | Division:
        if isinstance(data, str):
            return self.symbols[data]
        ((kind, (numerator, denominator)),) = data.items()
        return Division(self.sym(numerator), self.sym(denominator), kind == "mod")

    def value(self, data: Any) -> Any:
        if data is None or isinstance(data, bool | int | float | str):
            return data
        if isinstance(data, list):
            return [self.value(item) for item in data]
        kind, body = next(iter(data.items()))
        readers = {
            "value": lambda: self.values[body],
            "sym": lambda: self.sym(body),
            "float": lambda: _FLOATS[body],
            "tuple": lambda: tuple(self.value(item) for item in body),
            "dict": lambda: {self.value(k): self.value(v) for k, v in body},
            "device": lambda: torch.device(body),
            "slice": lambda: slice(*(self.value(item) for item in body)),
            "ellipsis": lambda: Ellipsis,
            "torch": lambda: getattr(torch, body),
            "enum": lambda: self.imported(body)[data["name"]],
            "dataclass": lambda: self.imported(body)(
                **{k: self.value(v) for k, v in data["fields"].items()}
            ),
            "callable": lambda: self.imported(body),
        }
        return readers[kind]()

    def imported(self, name: str) -> Any:
        found = _resolve(name)
        if found is None:
            raise GraphFormatError(f"{name} cannot be imported here")
        return found

    def relation(self, data: dict[str, Any]) -> Relation:
        return Relation(self.sym(data["sym"]), data["relation"], data["why"])


def decode_graph(data: dict[str, Any], decoder: Decoder) -> Graph:
    """The graph :func:`encode_graph` wrote (unverified: the caller verifies it)."""
    graph = Graph(name=data["name"])
    for name, kind, input_kind, source in data["inputs"]:
        value = Value(name, decoder.type(kind), kind=InputKind(input_kind), source=source)
        graph.inputs.append(value)
        decoder.values[name] = value
    for item in data["nodes"]:
        node = Node(
            Op[item["op"]],
            tuple(decoder.value(operand) for operand in item["inputs"]),
            decoder.value(item["attrs"]),
            origin=Origin(*item["origin"]),
            recompute=bool(item["recompute"]),
        )
        node.outputs = tuple(Value(name, decoder.type(t), node) for name, t in item["outputs"])
        decoder.values.update((out.name, out) for out in node.outputs)
        graph.nodes.append(node)
    graph.outputs = [decoder.values[name] for name in data["outputs"]]
    graph.mutations = [(decoder.values[a], decoder.values[b]) for a, b in data["mutations"]]
    graph.symbols = tuple(data["symbols"])
    graph._names = set(decoder.values)
    return graph
