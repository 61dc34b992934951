"""The ``eager`` backend: run the graph with the reference interpreter.

It is the oracle every other backend is compared with, and what a graph falls back to when a
backend cannot compile it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.backends.registry import CompiledGraph, add_backend
from kiln.ir.graph import Graph
from kiln.ir.interpreter import interpret
from kiln.options import Options


@dataclass(frozen=True)
class EagerBackend:
    name: str = "eager"

    def compile(self, graph: Graph, options: Options) -> CompiledGraph:
        def run(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            return interpret(graph, inputs)

        return run


add_backend(EagerBackend())
