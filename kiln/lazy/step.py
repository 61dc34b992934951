"""A lazy step: the graph recorded since the last ``mark_step``, compiled once per structure.

:class:`PendingStep` is the graph under construction: every lazy tensor a recorded op reads
joins it as a ``USER`` input holding the tensor's data, tensors the program made from Python
data (``torch.tensor(0.5)``) as constants, random ops through the builder's seed input.
:func:`run_step` closes it: the given values become its outputs, inputs nothing reads are
dropped, and the graph is looked up by its structural hash (``kiln/ir/hashing.py``) among the
steps compiled before. Gradients were already recorded into the graph as prims (the reverse
sweep ran at ``backward()``), so the step is compiled as an inference graph: no autodiff, no
autograd at run time::

    step 1:  hash 3f9a.. miss -> pipeline (passes, schedule, codegen, build)   compiles == 1
    step 2:  hash 3f9a.. hit  -> the same compiled program, this step's data    cache_hits == 1
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from kiln.backends import CompiledGraph
from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, InputKind, Value
from kiln.ir.hashing import graph_hash
from kiln.ir.types import TensorType
from kiln.ir.verify import verify
from kiln.options import Options
from kiln.pipeline import Pipeline

_epochs = itertools.count(1)


@dataclass
class LazyCounters:
    """What the lazy frontend did (``kiln.lazy.counters``)."""

    compiles: int = 0  # steps whose graph structure was new: the pipeline ran
    cache_hits: int = 0  # steps that reused a compiled graph of the same structural hash
    steps: int = 0  # mark_steps that ran a graph
    syncs: int = 0  # of those, forced by reading a value (.item(), print, bool)
    eager_calls: int = 0  # calls PyTorch ran between steps (results shaped by data)

    def reset(self) -> None:
        self.compiles = self.cache_hits = self.steps = self.syncs = self.eager_calls = 0


counters = LazyCounters()


@dataclass
class StepReport:
    """The last step, as ``kiln.lazy.explain()`` shows it."""

    graph: Graph
    key: str
    cache_hit: bool
    reason: str  # "mark_step", or the value read that forced it ("item")

    def __str__(self) -> str:
        how = "cache hit" if self.cache_hit else "compiled"
        return (
            f"lazy step {self.key[:12]} ({how}, by {self.reason}): {len(self.graph.inputs)} "
            f"inputs, {len(self.graph.nodes)} nodes, {len(self.graph.outputs)} outputs\n"
            f"{self.graph}"
        )


@dataclass
class PendingStep:
    """The graph recorded since the last step, and the tensor each of its inputs holds."""

    graph: Graph = field(default_factory=lambda: Graph(name="lazy_step"))
    data: dict[Value, torch.Tensor] = field(default_factory=dict)
    epoch: int = field(default_factory=lambda: next(_epochs))

    def __post_init__(self) -> None:
        self.builder = GraphBuilder(self.graph)

    def bind(self, tensor: torch.Tensor, requires_grad: bool, name: str) -> Value:
        """A new input of the graph, holding ``tensor``."""
        kind = TensorType.of(tensor).with_(requires_grad=requires_grad)
        value = self.graph.add_input(kind, name=name)
        self.data[value] = tensor
        return value


@dataclass
class StepCache:
    """Compiled steps by structural hash, and the pipeline that compiles them."""

    options: Options = field(default_factory=Options)
    compiled: dict[str, CompiledGraph] = field(default_factory=dict)
    last: StepReport | None = None


cache = StepCache()


def run_step(step: PendingStep, outputs: list[Value], reason: str) -> list[torch.Tensor]:
    """Compile ``step``'s graph with ``outputs`` (or reuse the compiled graph of its structure)
    and run it on the step's data; the values of ``outputs``, in order."""
    graph = _closed(step.graph, outputs)
    key = graph_hash(graph)
    compiled = cache.compiled.get(key)
    hit = compiled is not None
    counters.steps += 1
    counters.syncs += reason != "mark_step"
    counters.cache_hits += hit
    if compiled is None:
        counters.compiles += 1
        _, compiled = Pipeline(cache.options)(verify(graph))
        cache.compiled[key] = compiled
    cache.last = StepReport(graph, key, hit, reason)
    return list(compiled([_feed(step, graph, value) for value in graph.inputs]))


def _closed(graph: Graph, outputs: list[Value]) -> Graph:
    """``graph`` with ``outputs``, without inputs nothing reads, as an inference graph (the
    gradients it needs are already among its nodes). Verified only when it compiles: a graph
    of a known structure was verified when its twin compiled."""
    graph.outputs = list(outputs)
    used = {value for node in graph.nodes for value in node.input_values()} | set(outputs)
    graph.inputs = [value for value in graph.inputs if value in used]
    for value in [*graph.inputs, *(out for node in graph.nodes for out in node.outputs)]:
        if value.type.requires_grad:
            value.type = value.type.with_(requires_grad=False)
    return graph


def _feed(step: PendingStep, graph: Graph, value: Value) -> torch.Tensor:
    if value.kind is InputKind.CONSTANT:
        return graph.constants[value.name]
    if value.kind is InputKind.RNG_SEED:
        return torch.randint(0, 2**62, (), dtype=torch.int64)
    return step.data[value]
