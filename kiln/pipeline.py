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
   alike) is recorded on its second call and replayed after; the graphs of one pipeline share
   a memory pool.

The result is the graph as optimized (what ``kiln.explain`` prints) and the callable that runs
it: the backend's compiled graph, or a forward/backward pair inside one ``autograd.Function``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from kiln.autodiff.buckets import SplitGraph, active_bucket_bytes, bucket_cuts, split
from kiln.autodiff.partition import Partition, partition
from kiln.autodiff.reverse import build_joint
from kiln.autodiff.runtime import TrainingGraph, needs_autodiff
from kiln.backends import CompiledGraph, compile_split, lookup_backend
from kiln.config import logger
from kiln.ir.graph import Graph
from kiln.ir.specialize import specialize
from kiln.ir.verify import verify
from kiln.options import Options
from kiln.passes import optimize
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
        sizes = sizes or SizeBudget()
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
            return lookup_backend("eager").compile(graph, self.options)
        plan.forward = run_passes(plan.forward)
        plan.backward = run_passes(plan.backward)
        plan.forward.user_outputs = len(graph.outputs)  # (the rest are saved for the backward)
        forward, backward = self.compile_graph(plan.forward), self.compile_graph(plan.backward)
        saved = range(len(graph.outputs), len(plan.forward.outputs))
        forward = self.replayed(
            plan.forward, forward, len(plan.forward.outputs), sizes, internal=saved
        )
        backward = self.replayed(plan.backward, backward, len(plan.backward.outputs), sizes)
        return TrainingGraph(graph, plan, forward, backward)

    def compile_graph(self, graph: Graph) -> CompiledGraph:
        """The backend stage (it schedules, generates and loads code on the first call)."""
        backend = lookup_backend(self.options.backend)
        if getattr(backend, "capabilities", None) is None:
            return backend.compile(graph, self.options)
        return compile_split(graph, backend, self.options, lookup_backend("kiln"))

    def replayed(
        self,
        graph: Graph,
        compiled: CompiledGraph,
        output_count: int,
        sizes: SizeBudget,
        *,
        internal: range = range(0),
    ) -> CompiledGraph:
        """``compiled`` run through CUDA graphs when the mode asks for them."""
        if not self.options.cudagraphs:
            return compiled
        return CudaGraphRunner(
            graph,
            compiled,
            self.family,
            sizes=sizes,
            output_count=output_count,
            internal=internal,
        )


def run_passes(graph: Graph, *, differentiating: bool = False) -> Graph:
    """The pass list on a verified graph; the result is verified too."""
    return verify(optimize(verify(graph), differentiating=differentiating))


def differentiate(graph: Graph) -> Partition:
    """The joint forward/backward graph of ``graph``, split into what the forward computes and
    saves and what the backward recomputes (raises NotImplementedError without a VJP)."""
    return partition(build_joint(graph), graph)


class PerSize:
    """A graph with symbolic sizes, run through the pipeline once per distinct binding of its
    symbols: each call binds them from its inputs' sizes and runs the graph specialized to
    them (compiled on the first call with those sizes). Capture, guards and the cache entry
    are shared by every size; only the stages after capture run again for a new size."""

    def __init__(self, graph: Graph, pipeline: Pipeline) -> None:
        self.graph = graph
        self.pipeline = pipeline
        self.compiled: dict[tuple[int, ...], Any] = {}
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
                    values = dict(zip(self.graph.symbols, sizes, strict=True))
                    _log_dynamic.info("%s: compiling for sizes %s", self.graph.name, values)
                    specialized = specialize(self.graph, values)
                    _, compiled = self.pipeline(specialized, self.cudagraph_sizes)
                    self.compiled[sizes] = compiled
        return compiled(inputs)
