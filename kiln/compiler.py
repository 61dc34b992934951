"""The compile sequence after capture, one named call per stage: passes, autodiff, backend.

Capture hands each graph it made to :func:`graph_compiler`'s function, which returns the graph
as optimized (what ``explain`` shows) and the callable that runs it: the backend's compiled
graph, or, when the graph's outputs require grad, a forward/backward pair inside one
``autograd.Function``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.autodiff.runtime import compile_training, needs_autodiff
from kiln.backends import get_backend
from kiln.config import logger
from kiln.ir.graph import Graph
from kiln.ir.verify import verify
from kiln.passes import optimize

_log_autodiff = logger("autodiff")

GraphCompiler = Callable[[Graph], tuple[Graph, Any]]


def graph_compiler(backend_name: str) -> GraphCompiler:
    """The compile function of one backend."""
    backend = get_backend(backend_name)

    def compile_graph(graph: Graph) -> tuple[Graph, Any]:
        training = needs_autodiff(graph)
        graph = verify(optimize(verify(graph), differentiating=training))
        if not training:
            return graph, backend.compile(graph)
        try:
            return graph, compile_training(graph, backend.compile)
        except NotImplementedError as error:
            # No VJP for some node (an extern whose derivative PyTorch does not implement):
            # the reference interpreter runs the graph under eager autograd, which records
            # what each op's PyTorch call records (and raises at backward where eager does).
            _log_autodiff.info("%s: eager autograd through the graph (%s)", graph.name, error)
            return graph, get_backend("eager").compile(graph)

    return compile_graph
