"""Kiln as a ``torch.compile`` backend: ``torch.compile(model, backend="kiln")``.

Dynamo captures; Kiln does everything after capture. PyTorch finds :func:`backend` through the
``torch_dynamo_backends`` entry point in ``pyproject.toml`` (``kiln = "kiln.dynamo:backend"``);
:func:`register` registers it by hand where Kiln is installed without that metadata.

Dynamo hands the backend each captured torch-level FX graph, its parameters and buffers as
inputs, with FakeTensor examples (and ``SymInt`` sizes once it made a size dynamic)::

    def forward(self, L_self_weight_, s0: torch.SymInt, L_x_):
        return (torch._C._nn.linear(L_x_, L_self_weight_),)

The returned :class:`DynamoGraph` traces it on its first call with real inputs
(:func:`kiln.from_fx`) and runs the graph through Kiln's own :class:`~kiln.pipeline.Pipeline`:
passes, autodiff when an output requires grad (a ``TrainingGraph``, so ``.backward()`` runs
Kiln's backward), the backend. Sizes are specialized: a call whose tensors differ in shape,
dtype, device or ``requires_grad`` (or whose ints differ, or grad mode) from every earlier
call's traces and compiles again, logged under ``KILN_LOG=dynamo`` and counted in
``kiln.counters.dynamo_graphs``. A graph Kiln cannot trace runs as Dynamo's GraphModule
(eagerly), with a warning and an entry in ``kiln.counters.dynamo_fallbacks``; under
``strict`` it raises.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from kiln.capture.driver.cache import counters
from kiln.config import logger
from kiln.errors import KilnError
from kiln.frontends import from_fx, graph_inputs, rebuild_outputs
from kiln.ir.graph import Graph
from kiln.options import Options
from kiln.pipeline import Pipeline

_log = logger("dynamo")

Compiled = tuple[Graph, Any] | None  # the traced graph and its callable; None: run eagerly


def backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> DynamoGraph:
    """The ``torch.compile`` backend: ``mode`` and ``options`` are ``torch.compile``'s, read
    as ``kiln.compile``'s (``options={"codegen": "triton"}``)."""
    settings = Options.of(options, mode=mode)
    return DynamoGraph(gm, Pipeline(settings))


def register() -> None:
    """Register :func:`backend` as ``"kiln"`` with torch._dynamo (idempotent); needed only
    where the entry point is not installed."""
    from torch._dynamo.backends import registry

    if "kiln" not in registry._COMPILER_FNS:
        registry.register_backend(backend, "kiln")


class DynamoGraph:
    """One Dynamo graph, compiled by Kiln once per call signature (see the module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, pipeline: Pipeline) -> None:
        self.gm = gm
        self.pipeline = pipeline
        self.compiled: dict[tuple[Any, ...], Compiled] = {}
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        key = _signature(args)
        if key not in self.compiled:
            with self._lock:
                if key not in self.compiled:
                    self.compiled[key] = self._compile(args)
        entry = self.compiled[key]
        if entry is None:
            return self.gm(*args)
        graph, compiled = entry
        inputs = graph_inputs(graph, self.gm, *args)
        results = compiled(inputs)
        count = len(graph.outputs)
        position = {value: index for index, value in enumerate(graph.inputs)}
        with torch.no_grad():
            for (target, _), new in zip(graph.mutations, results[count:], strict=True):
                inputs[position[target]].copy_(new)
        return rebuild_outputs(graph, results[:count])

    def _compile(self, args: tuple[Any, ...]) -> Compiled:
        try:
            graph = from_fx(self.gm, args)
        except KilnError as error:
            if self.pipeline.options.strict:
                raise
            counters.dynamo_fallbacks.append(str(error))
            warnings.warn(
                f"kiln: running a torch.compile graph eagerly: {error}", RuntimeWarning, 2
            )
            return None
        _log.info("%s: compiling for %s", graph.name, _signature(args))
        counters.dynamo_graphs += 1
        return graph, self.pipeline(graph)[1]


def _signature(args: Sequence[Any]) -> tuple[Any, ...]:
    """What a traced graph is specialized to: each tensor's shape, dtype, device,
    requires_grad and first position (a tensor passed twice is one input), the other
    arguments' values, and grad mode."""
    first: dict[int, int] = {}
    key: list[Any] = [torch.is_grad_enabled()]
    for position, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            where = first.setdefault(id(arg), position)
            key.append((tuple(arg.shape), arg.dtype, arg.device, arg.requires_grad, where))
        else:
            key.append(arg)
    return tuple(key)
