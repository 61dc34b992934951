"""The pipeline: every stage after capture, in order, in one place.

``kiln.compile`` builds one :class:`Pipeline` per :class:`~kiln.options.Options` and hands it to
capture as its graph compiler, so capture never imports a later stage. Each captured graph
then goes through, top to bottom:

1. **passes** (``kiln/passes``): pattern rewrites, CSE, DCE; on a graph autodiff will
   differentiate, without the passes that shape work for kernels (``AFTER_AUTODIFF``);
2. **autodiff** (``kiln/autodiff``), when an output requires grad: the joint forward/backward
   graph from the VJP rows, split by the save-or-recompute partitioner (inside a DDP
   module's forward, first cut into one training graph per gradient bucket, so that DDP's
   all-reduces overlap the backward: ``kiln/autodiff/buckets.py``);
3. **passes after autodiff**: the whole list, on the forward and on the backward graph;
4. **backend** (``kiln/backends``): the options' backend compiles each graph; a backend that
   declares its capabilities gets the largest subgraphs it supports and the default backend
   runs the rest (``kiln/backends/split.py``: after autodiff, so training graphs split too).
   The default ``kiln`` backend does so on the graph's first call, per layout of its inputs:
   **schedule** (``kiln/schedule``: fused kernels, extern calls, buffer plan) →
   **codegen** (``kiln/codegen``: Triton or C++ sources, and the host program) →
   **runtime** (``kiln/runtime``: build, load, launch);
5. **CUDA graphs** (``kiln/runtime/cudagraphs.py``), in ``reduce-overhead`` and
   ``max-autotune`` modes: each compiled graph (a training graph's forward and backward
   alike) is recorded on its second call and replayed after, one recording per size of a
   graph compiled for a range of sizes; the graphs of one pipeline share a memory pool.

The result is the graph as optimized (what ``kiln.explain`` prints) and the callable that runs
it: the backend's compiled graph, or a forward/backward pair inside one ``autograd.Function``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.autodiff.buckets import SplitGraph, active_bucket_bytes, bucket_cuts, split
from kiln.autodiff.partition import Partition, partition
from kiln.autodiff.reverse import build_joint
from kiln.autodiff.runtime import TrainingGraph, needs_autodiff
from kiln.backends import CompiledGraph, compile_split, lookup_backend
from kiln.config import logger
from kiln.ir.graph import Graph
from kiln.ir.specialize import rehint, size_places, specialize, symbols_of, used_symbols
from kiln.ir.symbolic import (
    ShapeEnv,
    Sym,
    active_env,
    bounded,
    current_env,
    pinned,
    relations_check,
)
from kiln.ir.verify import verify
from kiln.options import Options
from kiln.passes import optimize
from kiln.runtime.cudagraph_sizes import SizedRunners
from kiln.runtime.cudagraphs import CudaGraphRunner, Family, SizeBudget

_log_autodiff = logger("autodiff")
_log_dynamic = logger("dynamic")


@dataclass(frozen=True)
class Pipeline:
    """The stages after capture for one set of options; called with each captured graph."""

    options: Options
    # The CUDA graphs of this pipeline's graphs share one memory pool (reduce-overhead).
    family: Family = field(default_factory=Family, compare=False, hash=False, repr=False)

    def __call__(self, graph: Graph, sizes: SizeBudget | None = None) -> tuple[Graph, Any]:
        """The graph as optimized and its callable; ``sizes`` counts the CUDA graphs of a
        captured graph's sizes (:class:`PerSize` passes its own)."""
        if graph.symbols:
            return graph, PerSize(graph, self)
        return self.stages(graph, sizes)

    def stages(self, graph: Graph, sizes: SizeBudget | None = None) -> tuple[Graph, Any]:
        """Passes, autodiff and the backend on ``graph`` (a graph with symbols: under the
        :class:`ShapeEnv` of :class:`PerSize`, which records what they decide on its sizes)."""
        sizes = sizes or SizeBudget()
        if current_env() is not None and active_bucket_bytes():
            graph = specialized_here(graph)  # (DDP's bucket cuts measure concrete sizes)
        training = needs_autodiff(graph)
        graph = run_passes(graph, differentiating=training)
        if not training:
            graph.user_outputs = len(graph.outputs)
            compiled = self.compile_graph(graph)
            return graph, self.replayed(graph, compiled, len(graph.outputs), sizes)
        bucket_bytes = active_bucket_bytes()
        cuts = bucket_cuts(graph, bucket_bytes) if bucket_bytes and not graph.mutations else []
        if not cuts:
            return graph, self.train(graph, sizes)
        # Under DDP: one training graph per bucket region, so that each region's gradients
        # reach DDP's hooks as its backward returns (autodiff/buckets.py says why).
        pieces = split(graph, cuts)
        _log_autodiff.info("%s: split in %d at DDP's buckets", graph.name, len(pieces))
        runners = [
            self.train(p.graph, sizes) if needs_autodiff(p.graph) else self.compile_graph(p.graph)
            for p in pieces
        ]
        return graph, SplitGraph(graph, pieces, runners)

    def train(self, graph: Graph, sizes: SizeBudget) -> Any:
        """The callable of a graph whose outputs require grad (its passes have run)."""
        try:
            plan = differentiate(graph)
        except NotImplementedError as error:
            # No VJP for some node (an extern whose derivative PyTorch does not implement):
            # the reference interpreter runs the graph under eager autograd, which records
            # what each op's PyTorch call records (and raises at backward where eager does).
            _log_autodiff.info("%s: eager autograd through the graph (%s)", graph.name, error)
            graph = specialized_here(graph) if current_env() is not None else graph
            return lookup_backend("eager").compile(graph, self.options)
        plan.forward = run_passes(plan.forward)
        plan.backward = run_passes(plan.backward)
        plan.forward.user_outputs = len(graph.outputs)  # (the rest are saved for the backward)
        forward, backward = self.compile_graph(plan.forward), self.compile_graph(plan.backward)
        saved = range(len(graph.outputs), len(plan.forward.outputs))
        forward = self.replayed(
            plan.forward, forward, len(plan.forward.outputs), sizes, internal=saved, forward=True
        )
        backward = self.replayed(plan.backward, backward, len(plan.backward.outputs), sizes)
        return TrainingGraph(graph, plan, forward, backward)

    def compile_graph(self, graph: Graph) -> CompiledGraph:
        """The backend stage (it schedules, generates and loads code on the first call). A
        graph with symbols keeps them only for the ``kiln`` backend, which compiles kernels
        for a range of sizes; any other backend gets it specialized to the current sizes."""
        backend = lookup_backend(self.options.backend)
        if current_env() is not None and not self.keeps_symbols(graph):
            graph = specialized_here(graph)
        if getattr(backend, "capabilities", None) is None:
            return backend.compile(graph, self.options)
        return compile_split(graph, backend, self.options, lookup_backend("kiln"))

    def keeps_symbols(self, graph: Graph) -> bool:
        """Whether the backend may compile ``graph`` with its symbols: the ``kiln`` backend,
        every symbol readable off the graph's own inputs (a backward graph binds its sizes
        from what it is given). Under CUDA graphs the one program gets one recording per
        size (:class:`SizedRunners`)."""
        backend = lookup_backend(self.options.backend)
        if backend.name != "kiln" or getattr(backend, "capabilities", None) is not None:
            return False
        return used_symbols(graph) <= set(size_places(graph))

    def replayed(
        self,
        graph: Graph,
        compiled: CompiledGraph,
        output_count: int,
        sizes: SizeBudget,
        *,
        internal: range = range(0),
        forward: bool = False,
    ) -> CompiledGraph:
        """``compiled`` run through CUDA graphs when the mode asks for them: one recording per
        size of a graph with symbols in its inputs; ``internal``: a forward's saved values;
        ``forward``: a training graph's forward (its backward may borrow its static inputs)."""
        if not self.options.cudagraphs:
            return compiled
        if current_env() is not None and (places := size_places(graph)):
            return SizedRunners(
                graph,
                compiled,
                self.family,
                sizes=sizes,
                places=places,
                output_count=output_count,
                internal=internal,
                forward=forward,
            )
        return CudaGraphRunner(
            graph,
            compiled,
            self.family,
            sizes=sizes,
            output_count=output_count,
            internal=internal,
            forward=forward,
        )


def run_passes(graph: Graph, *, differentiating: bool = False) -> Graph:
    """The pass list on a verified graph; the result is verified too."""
    return verify(optimize(verify(graph), differentiating=differentiating))


def differentiate(graph: Graph) -> Partition:
    """The joint forward/backward graph of ``graph``, split into what the forward computes and
    saves and what the backward recomputes (raises NotImplementedError without a VJP)."""
    return partition(build_joint(graph), graph)


class PerSize:
    """A graph with symbolic sizes, compiled for the sizes of a call and reused for every later
    call whose sizes satisfy what compiling decided on them.

    The stages after capture run on the graph with its symbols, hinted by the call's sizes,
    under a :class:`ShapeEnv`: a question about a size that holds for every size costs
    nothing, one answered by the hint is recorded as a relation (``s0 < 1024``), and a stage
    that needs a concrete size specializes it (``s0 == 7``). The result serves every later
    binding that satisfies those relations; the backend (``kiln/backends/kiln.py``) guards its
    own decisions per program the same way. At worst each size compiles once, as if static."""

    def __init__(self, graph: Graph, pipeline: Pipeline) -> None:
        self.graph = graph
        self.pipeline = pipeline
        self.compiled: dict[tuple[int, ...], Any] = {}  # by the symbols' values
        # (whether it holds for a binding of the symbols, the callable)
        self.entries: list[tuple[Callable[[dict[str, int]], bool], Any]] = []
        self.cudagraph_sizes = SizeBudget()  # (reduce-overhead: one CUDA graph per size)
        self._lock = threading.Lock()

    def __call__(self, inputs: list[Any], sizes: tuple[int, ...]) -> Any:
        """Run on ``inputs``, the graph's symbols having the values ``sizes`` (in
        ``graph.symbols`` order)."""
        compiled = self.compiled.get(sizes)
        if compiled is None:
            with self._lock:
                compiled = self.compiled.get(sizes)
                if compiled is None:
                    compiled = bounded(self.compiled)[sizes] = self._entry(sizes)
        return compiled(inputs)

    def _entry(self, sizes: tuple[int, ...]) -> Any:
        values = dict(zip(self.graph.symbols, sizes, strict=True))
        for holds, compiled in self.entries:
            if holds(values):
                return compiled
        _log_dynamic.info("%s: compiling for sizes %s", self.graph.name, values)
        symbols = {n: s for n, s in symbols_of(self.graph).items() if n in values}
        env = ShapeEnv(
            symbols={n: Sym.symbol(n, values[n], s.low, s.high) for n, s in symbols.items()}
        )
        try:
            with active_env(env):
                _, compiled = self.pipeline.stages(rehint(self.graph, values), self.cudagraph_sizes)
        except Exception as error:  # (a stage that cannot take symbols: this size alone)
            _log_dynamic.warning(
                "%s: compiled for sizes %s only: %s: %s",
                self.graph.name,
                values,
                type(error).__name__,
                str(error).splitlines()[0][:200] if str(error) else "",
            )
            _, compiled = self.pipeline.stages(specialize(self.graph, values), self.cudagraph_sizes)
            self.entries.append((relations_check(pinned(values)), compiled))
            return compiled
        relations = tuple(env.relations)
        if texts := [r.text() for r in relations] + list(env.checks):
            _log_dynamic.info("%s: compiled for %s", self.graph.name, ", ".join(texts))
        self.entries.append((relations_check(relations, tuple(env.checks.values())), compiled))
        return compiled


def specialized_here(graph: Graph) -> Graph:
    """``graph`` with its symbols replaced by their hints, each guarded in the active
    :class:`ShapeEnv` (what is compiled from it serves these sizes only)."""
    env = current_env()
    assert env is not None
    values = {}
    for name, symbol in symbols_of(graph).items():
        size = Sym.symbol(name, symbol.hint, symbol.low, symbol.high)
        env.specialized(size, "kept by a backend that compiles for one size")
        values[name] = symbol.hint
    return specialize(graph, values)
