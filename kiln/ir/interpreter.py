"""The reference interpreter: run a graph with each op's reference implementation.

It is the oracle every backend is checked against, and the ``eager`` backend. It returns the
graph's outputs followed by the new values of mutated inputs, like the printed graph does;
:func:`run` also writes those mutations back into the input tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from kiln.errors import BackendError
from kiln.ir.graph import Graph, Value
from kiln.ir.op import op_def


def interpret(graph: Graph, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Outputs, then mutated-input values, of ``graph`` on ``inputs`` (``graph.inputs`` order)."""
    if len(inputs) != len(graph.inputs):
        raise BackendError(
            f"graph {graph.name} takes {len(graph.inputs)} inputs, got {len(inputs)}"
        )
    env: dict[Value, Any] = dict(zip(graph.inputs, inputs, strict=True))
    with _no_autocast():
        _run_nodes(graph, env)
    return [env[v] for v in graph.outputs] + [env[new] for _, new in graph.mutations]


def _no_autocast() -> contextlib.ExitStack:
    """The graph already holds autocast's casts: running it under autocast would cast twice."""
    stack = contextlib.ExitStack()
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def _dead_after(graph: Graph) -> list[list[Value]]:
    """For each node, the values no later node, output or mutation needs: freed right after
    it, so the interpreter's peak memory is eager's, not the sum of every intermediate."""
    keep = set(graph.outputs) | {new for _, new in graph.mutations} | set(graph.inputs)
    last: dict[Value, int] = {}
    for index, node in enumerate(graph.nodes):
        for operand in node.inputs:
            if isinstance(operand, Value):
                last[operand] = index
        for value in node.outputs:
            last.setdefault(value, index)
    dead: list[list[Value]] = [[] for _ in graph.nodes]
    for value, index in last.items():
        if value not in keep:
            dead[index].append(value)
    return dead


def _run_nodes(graph: Graph, env: dict[Value, Any]) -> None:
    dead = _dead_after(graph)
    for node, done in zip(graph.nodes, dead, strict=True):
        operands = [env[i] if isinstance(i, Value) else i for i in node.inputs]
        result = op_def(node.op).impl(node.attrs, *operands)
        results = result if isinstance(result, tuple) else (result,)
        for value, tensor in zip(node.outputs, results, strict=True):
            # Nodes captured under no_grad say so in their type; eager would not record them.
            if not value.type.requires_grad and getattr(tensor, "requires_grad", False):
                tensor = tensor.detach()
            env[value] = tensor
        for value in done:
            del env[value]


def run(graph: Graph, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Interpret ``graph``, write mutated inputs back in place, and return the outputs."""
    results = interpret(graph, inputs)
    outputs = results[: len(graph.outputs)]
    index = {value: i for i, value in enumerate(graph.inputs)}
    with torch.no_grad():
        for (target, _), new in zip(graph.mutations, results[len(graph.outputs) :], strict=True):
            inputs[index[target]].copy_(new)
    return outputs
