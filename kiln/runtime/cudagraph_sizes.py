"""Dynamic shapes under CUDA graphs: a program compiled for a range of sizes gets one
:class:`~kiln.runtime.cudagraphs.CudaGraphRunner` per binding of its symbols, up to
``SIZE_LIMIT`` per captured graph (``cudagraphs.py`` records and replays each)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.ir.graph import Graph
from kiln.runtime import cudagraphs
from kiln.runtime.cudagraphs import CompiledGraph, CudaGraphRunner, Family, SizeBudget


class SizedRunners:
    """A program for a range of sizes run through CUDA graphs: one :class:`CudaGraphRunner`
    per binding of its symbols (the first ``SIZE_LIMIT`` of the captured graph), all running
    the one program; later bindings run it without CUDA graphs."""

    def __init__(
        self,
        graph: Graph,
        compiled: CompiledGraph,
        family: Family,
        *,
        sizes: SizeBudget,
        places: dict[str, tuple[int, int]],
        output_count: int,
        internal: Sequence[int] = (),
        forward: bool = False,
    ) -> None:
        """``places``: the (input, dim) of each symbol, by name; the rest as
        :class:`CudaGraphRunner`'s."""
        self.graph = graph
        self.compiled = compiled
        self.family = family
        self.sizes = sizes
        self.names = list(places)
        self.places = list(places.values())
        self.output_count = output_count
        self.internal = internal
        self.forward = forward
        self.runners: dict[tuple[int, ...], CudaGraphRunner] = {}
        self.overflow: CudaGraphRunner | None = None  # (the sizes past the limit)
        self.last: CudaGraphRunner | None = None  # the runner of the last call

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        key = tuple(inputs[at].shape[dim] for at, dim in self.places)
        self.last = self.runners.get(key) or self._runner(key)
        return self.last(inputs)

    def static_input(self, position: int) -> torch.Tensor | None:
        return self.last.static_input(position) if self.last is not None else None

    def _runner(self, key: tuple[int, ...]) -> CudaGraphRunner:
        with self.family.lock:
            runner = self.runners.get(key)
            if runner is not None:
                return runner
            if self.sizes.take(self.graph.name):
                label = ", ".join(f"{n}={size}" for n, size in zip(self.names, key, strict=True))
                self.runners[key] = self._make(f"{self.graph.name} at {label}")
                return self.runners[key]
            if self.overflow is None:
                self.overflow = self._make(f"{self.graph.name} at other sizes")
                self.overflow._turn_off(
                    f"{cudagraphs.SIZE_LIMIT} sizes of this graph already have one"
                )
            return self.overflow

    def _make(self, name: str) -> CudaGraphRunner:
        return CudaGraphRunner(
            self.graph,
            self.compiled,
            self.family,
            sizes=None,
            output_count=self.output_count,
            internal=self.internal,
            forward=self.forward,
            name=name,
        )
