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
from typing import Any

import torch

from kiln.backends import CompiledGraph
from kiln.config import logger
from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, InputKind, Value
from kiln.ir.hashing import graph_hash
from kiln.ir.specialize import specialize
from kiln.ir.types import TensorType
from kiln.ir.verify import verify
from kiln.options import Options
from kiln.passes.dce import eliminate_dead_code
from kiln.pipeline import Pipeline

_epochs = itertools.count(1)
_log = logger("lazy")


@dataclass
class LazyCounters:
    """What the lazy frontend did (``kiln.lazy.counters``)."""

    compiles: int = 0  # steps whose graph structure was new: the pipeline ran
    cache_hits: int = 0  # steps that reused a compiled graph of the same structural hash
    steps: int = 0  # graphs run (by mark_step and by value reads)
    syncs: int = 0  # of those, value reads (.item(), print, bool): only their work, kept pending
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
    seed: torch.Tensor | None = None  # the random seed of every run of this step

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


def run_step(
    step: PendingStep, outputs: list[Value], reason: str, *, keep: bool = False
) -> list[torch.Tensor]:
    """Compile ``step``'s graph with ``outputs`` (or reuse the compiled graph of its structure)
    and run it on the step's data; the values of ``outputs``, in order. ``keep``: the step
    stays pending (a value was read), so a copy of its graph is compiled (passes rewrite nodes
    in place), and only the work ``outputs`` depend on runs."""
    graph, feed = _closed(step, outputs, keep)
    key = graph_hash(graph)
    compiled = cache.compiled.get(key)
    hit = compiled is not None
    counters.steps += 1
    counters.syncs += keep
    counters.cache_hits += hit
    if compiled is None:
        counters.compiles += 1
        _log.info("step %s (%s): a new structure, compiling", key[:12], reason)
        _, compiled = Pipeline(cache.options)(verify(graph))
        cache.compiled[key] = compiled
    cache.last = StepReport(graph, key, hit, reason)
    return list(compiled(feed))


def _closed(step: PendingStep, outputs: list[Value], keep: bool) -> tuple[Graph, list[Any]]:
    """The step's graph with ``outputs``, without work or inputs they do not need, as an
    inference graph (the gradients it needs are among its nodes), and the tensors its inputs
    take. Verified only when it compiles: a graph of a known structure was verified when its
    twin compiled."""
    step.graph.outputs = list(outputs)
    live = eliminate_dead_code(step.graph)  # (what runs is what is hashed and reported)
    graph = specialize(live, {}) if keep else live
    used = {value for node in graph.nodes for value in node.input_values()} | set(graph.outputs)
    kept = [pair for pair in zip(graph.inputs, step.graph.inputs, strict=True) if pair[0] in used]
    graph.inputs = [value for value, _ in kept]
    for value in [*graph.inputs, *(out for node in graph.nodes for out in node.outputs)]:
        if value.type.requires_grad:
            value.type = value.type.with_(requires_grad=False)
    return graph, [_feed(step, value) for _, value in kept]


def _feed(step: PendingStep, value: Value) -> torch.Tensor:
    if value.kind is InputKind.CONSTANT:
        return step.graph.constants[value.name]
    if value.kind is InputKind.RNG_SEED:  # (one seed a step: a value read sees its numbers)
        if step.seed is None:
            step.seed = torch.randint(0, 2**62, (), dtype=torch.int64)
        return step.seed
    return step.data[value]
