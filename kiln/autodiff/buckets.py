"""A training graph split at DDP's gradient buckets, so the all-reduce overlaps the backward.

A compiled training graph runs its backward as one ``autograd.Function``: every parameter's
gradient reaches its ``AccumulateGrad`` node, and so DDP's reducer hook, only when the whole
backward has returned, and no all-reduce can start before the backward ends. Splitting the
*graph* (as Dynamo's DDPOptimizer splits the FX graph) rather than staging one Function's
backward keeps each piece an ordinary ``TrainingGraph``: autograd runs the pieces' backwards
last piece first, and after each one the gradients of the parameters it used last are final,
their buckets fill and DDP launches their all-reduce while the earlier pieces' backwards run.

Walking the nodes from the last, a cut is made once the parameters first read since the last
cut hold ``bucket_bytes_cap`` bytes (DDP's bucket size: ``bucket_cap_mb``), so each piece's
backward completes about one bucket::

    graph: mm(x, w1) -> relu -> mm(., w2) -> relu -> mm(., w3)       (w* of one bucket each)
    pieces: [mm(x, w1)] [relu, mm(., w2)] [relu, mm(., w3)]
    backward: piece 2 -> all-reduce(w3) | piece 1 -> all-reduce(w2) | piece 0 -> all-reduce(w1)
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.ir.graph import Graph, InputKind, Node, Value
from kiln.ir.types import hint_shape


def active_bucket_bytes() -> int | None:
    """The bucket size of the DDP module whose forward is running (DDP marks itself active
    around its wrapped module's call), else None."""
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    active = getattr(ddp, "DistributedDataParallel", None)
    module = active._get_active_ddp_module() if active is not None else None
    return None if module is None else int(module.bucket_bytes_cap)


def bucket_cuts(graph: Graph, bucket_bytes: int) -> list[int]:
    """Node positions to cut ``graph`` before, so that each piece first reads about
    ``bucket_bytes`` of trainable parameters (the last piece's backward finishes them)."""
    first_read: dict[Value, int] = {}
    for position, node in enumerate(graph.nodes):
        for value in node.input_values():
            if value.kind is InputKind.PARAMETER and value.type.requires_grad:
                first_read.setdefault(value, position)
    read_at = [0] * len(graph.nodes)
    for value, position in first_read.items():
        read_at[position] += math.prod(hint_shape(value.type.shape)) * value.type.dtype.itemsize
    cuts, filled = [], 0
    for position in reversed(range(1, len(graph.nodes))):
        filled += read_at[position]
        if filled >= bucket_bytes:
            cuts.append(position)
            filled = 0
    return cuts[::-1]


@dataclass
class Piece:
    """One piece of a split graph: its graph, and which values of the whole graph it reads
    (its inputs, in order) and writes (its outputs, in order)."""

    graph: Graph
    reads: list[Value]
    writes: list[Value]


def split(graph: Graph, cuts: Sequence[int]) -> list[Piece]:
    """``graph`` cut before each node position in ``cuts``; each piece outputs the values it
    defines that later pieces or the graph's outputs use."""
    bounds = [0, *cuts, len(graph.nodes)]
    spans = [graph.nodes[start:end] for start, end in itertools.pairwise(bounds)]
    needed_after: list[set[Value]] = []
    later = set(graph.outputs)
    for nodes in reversed(spans):
        needed_after.append(set(later))
        later.update(v for node in nodes for v in node.input_values())
    needed_after.reverse()
    return [
        _piece(graph, f"{graph.name}_bucket{index}", nodes, needed_after[index])
        for index, nodes in enumerate(spans)
    ]


def _piece(graph: Graph, name: str, nodes: list[Node], needed: set[Value]) -> Piece:
    piece = Graph(name=name)
    mapping: dict[Value, Value] = {}
    reads: list[Value] = []
    for node in nodes:
        for value in node.input_values():
            if value not in mapping:
                kind = value.kind or InputKind.USER
                mapping[value] = piece.add_input(
                    value.type, name=value.name, kind=kind, source=value.source
                )
                reads.append(value)
                if kind is InputKind.CONSTANT:
                    piece.constants[mapping[value].name] = graph.constants[value.name]
        operands = tuple(mapping[i] if isinstance(i, Value) else i for i in node.inputs)
        types = tuple(out.type for out in node.outputs)
        copy = piece.append(node.op, operands, node.attrs, types, node.origin)
        copy.recompute = node.recompute
        mapping.update(zip(node.outputs, copy.outputs, strict=True))
    writes = [out for node in nodes for out in node.outputs if out in needed]
    piece.outputs = [mapping[value] for value in writes]
    return Piece(piece, reads, writes)


class SplitGraph:
    """Runs the compiled pieces of a split graph in order; called like the whole graph."""

    def __init__(self, graph: Graph, pieces: list[Piece], compiled: list[Callable[..., Any]]):
        self.inputs = list(graph.inputs)
        self.outputs = list(graph.outputs)
        self.pieces = list(zip(pieces, compiled, strict=True))

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        values: dict[Value, torch.Tensor] = dict(zip(self.inputs, inputs, strict=True))
        for piece, run in self.pieces:
            results = run([values[value] for value in piece.reads])
            values.update(zip(piece.writes, results, strict=True))
        return [values[value] for value in self.outputs]
