"""The backend partitioner: a graph split between a backend and the default one, by what the
backend declares it supports (:class:`~kiln.backends.registry.Capabilities`).

Each node gets a *stage*: the first stage, not before any of its operands' stages, of its
kind (even stages for supported nodes, odd ones for the rest), then the last such stage its
readers allow. Edges never go to an earlier stage, so running the stages in order is a valid
schedule, and each stage is as large as the dependencies allow: the supported nodes of one
stage form one subgraph for the backend, the others one subgraph for the default backend. A
backend that supports ``add`` and ``mul`` only::

    t0 = add(x, y)      stage 0  ──▶  part0(x, y) -> t0      on the backend
    t1 = erf(t0)        stage 1  ──▶  part1(t0) -> t1        on kiln
    t2 = mul(t1, x)     stage 2  ──▶  part2(t1, x) -> t2     on the backend

The parts are separate Kiln graphs; :class:`SplitProgram` runs them in order, passing values
across. Partitioning runs on each graph the pipeline compiles, after autodiff, so a training
graph's forward and backward are split alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.backends.registry import Backend, BackendRecord, Capabilities, CompiledGraph
from kiln.ir.graph import Graph, InputKind, Node, Value
from kiln.ir.printer import format_node
from kiln.options import Options
from kiln.recording import record


@dataclass
class Part:
    """One subgraph: its graph, backend, the original values it reads and defines, and its
    compiled callable."""

    graph: Graph
    backend: str
    sources: list[Value]
    results: list[Value]
    compiled: CompiledGraph


class SplitProgram:
    """Runs the parts of a split graph in order; called like the graph's compiled callable."""

    def __init__(self, graph: Graph, parts: list[Part]) -> None:
        self.graph, self.parts = graph, parts
        self.wanted = [*graph.outputs, *(new for _, new in graph.mutations)]
        # What to forget after each part: values no later part or output needs (peak memory).
        last = {value: index for index, part in enumerate(parts) for value in part.sources}
        self.dead: list[list[Value]] = [[] for _ in parts]
        for value, index in last.items():
            if value not in self.wanted and value not in graph.inputs:
                self.dead[index].append(value)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        env: dict[Value, torch.Tensor] = dict(zip(self.graph.inputs, inputs, strict=True))
        for part, dead in zip(self.parts, self.dead, strict=True):
            results = part.compiled([env[value] for value in part.sources])
            env.update(zip(part.results, results, strict=True))
            for value in dead:
                del env[value]
        return [env[value] for value in self.wanted]


def compile_split(
    graph: Graph, backend: Backend, options: Options, default: Backend
) -> CompiledGraph:
    """``graph`` compiled by ``backend`` where its capabilities allow, by ``default`` elsewhere."""
    capabilities: Capabilities | None = getattr(backend, "capabilities", None)
    if capabilities is None or backend.name == default.name or not graph.nodes:
        return backend.compile(graph, options)
    refusals = {node: capabilities.refusal(node) for node in graph.nodes}
    stages = assign_stages(graph, refusals)
    if len(stages) == 1:
        owner = default if refusals[graph.nodes[0]] else backend
        record(_record(graph, [(owner.name, graph.nodes)], refusals))
        return owner.compile(graph, options)
    groups = [(default if refusals[nodes[0]] else backend, nodes) for nodes in stages]
    needed = _needed_across(graph, stages)
    parts = []
    for index, (owner, nodes) in enumerate(groups):
        sub, sources, results = subgraph(graph, nodes, f"{graph.name}_part{index}", needed)
        parts.append(Part(sub, owner.name, sources, results, owner.compile(sub, options)))
    record(_record(graph, [(owner.name, nodes) for owner, nodes in groups], refusals))
    return SplitProgram(graph, parts)


def assign_stages(graph: Graph, refusals: dict[Node, str]) -> list[list[Node]]:
    """The graph's nodes grouped by stage (see the module docstring), in stage order: each
    node first in the earliest stage of its kind, then moved to the latest one its readers
    allow, so a node no earlier stage needs joins the part its readers are in."""
    stage_of: dict[Value, int] = {}
    stages: dict[Node, int] = {}
    for node in graph.nodes:
        kind = 1 if refusals[node] else 0
        stage = max((stage_of.get(value, 0) for value in node.input_values()), default=0)
        stages[node] = stage + (stage - kind) % 2
        stage_of.update((value, stages[node]) for value in node.outputs)
    last, readers = max(stages.values()), graph.users()
    for node in reversed(graph.nodes):
        kind = 1 if refusals[node] else 0
        users = [stages[user] for value in node.outputs for user in readers[value]]
        limit = min(users, default=last)
        stages[node] = limit - (limit - kind) % 2
    ordered = sorted(set(stages.values()))
    return [[node for node in graph.nodes if stages[node] == stage] for stage in ordered]


def _needed_across(graph: Graph, stages: list[list[Node]]) -> set[Value]:
    """Values read outside the stage defining them: by another stage, as an output or as a
    mutation's new value."""
    needed = {*graph.outputs, *(new for _, new in graph.mutations)}
    for nodes in stages:
        inside = {value for node in nodes for value in node.outputs}
        needed.update(v for node in nodes for v in node.input_values() if v not in inside)
    return needed


def subgraph(
    graph: Graph, nodes: list[Node], name: str, needed: set[Value]
) -> tuple[Graph, list[Value], list[Value]]:
    """``nodes`` (a stage of ``graph``) as a graph of their own; returns it, the original values
    its inputs stand for and the original values its outputs define."""
    sub = Graph(name=name)
    mapping: dict[Value, Value] = {}
    sources: list[Value] = []
    for node in nodes:
        for value in node.input_values():
            if value not in mapping:
                kind = value.kind if value.node is None and value.kind else InputKind.USER
                mapping[value] = sub.add_input(value.type, name=value.name, kind=kind)
                if kind is InputKind.CONSTANT:
                    sub.constants[mapping[value].name] = graph.constants[value.name]
                sources.append(value)
        operands = tuple(mapping[o] if isinstance(o, Value) else o for o in node.inputs)
        copy = Node(node.op, operands, node.attrs, origin=node.origin, recompute=node.recompute)
        copy.outputs = tuple(Value(sub.fresh_name(v.name), v.type, copy) for v in node.outputs)
        mapping.update(zip(node.outputs, copy.outputs, strict=True))
        sub.nodes.append(copy)
    results = [value for node in nodes for value in node.outputs if value in needed]
    sub.outputs = [mapping[value] for value in results]
    return sub, sources, results


def _record(
    graph: Graph, groups: list[tuple[str, list[Node]]], refusals: dict[Node, str]
) -> BackendRecord:
    """What ``kiln.explain`` shows of a split: each part's backend and ops, and why each op
    left to the default backend was left out."""
    ops_on: dict[str, int] = {}
    lines = []
    for index, (owner, nodes) in enumerate(groups):
        ops_on[owner] = ops_on.get(owner, 0) + len(nodes)
        names = ", ".join(dict.fromkeys(node.op.printed_name for node in nodes))
        where = f"part {index}" if len(groups) > 1 else "whole graph"
        lines.append(f"{where} on {owner}: {len(nodes)} op(s) ({names})")
        for node in nodes:
            if refusals[node]:
                origin = f"  [{node.origin}]" if node.origin.api else ""
                lines.append(
                    f"  left out: {format_node(node, origins=False)}: {refusals[node]}{origin}"
                )
    return BackendRecord(graph.name, lines, ops_on, [owner for owner, _ in groups])
