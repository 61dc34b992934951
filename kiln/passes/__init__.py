"""Graph -> Graph passes, one per module, and the ordered pipeline that runs them.

Every pass maps a verified graph to a verified graph computing the same outputs and mutations.
Passes share Values with their input (a rewritten node re-points its outputs), so the input
graph must not be used afterwards. ``optimize`` runs the pipeline; capture and autodiff call
it before a backend compiles a graph.
"""

from __future__ import annotations

from kiln.ir.graph import Graph
from kiln.passes.cse import eliminate_common_subexpressions
from kiln.passes.dce import eliminate_dead_code

PIPELINE = [eliminate_common_subexpressions, eliminate_dead_code]


def optimize(graph: Graph) -> Graph:
    for run in PIPELINE:
        graph = run(graph)
    return graph


__all__ = ["PIPELINE", "eliminate_common_subexpressions", "eliminate_dead_code", "optimize"]
