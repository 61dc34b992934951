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

import operator
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kiln.capture.driver.cache import counters
from kiln.config import logger
from kiln.errors import KilnError
from kiln.frontends import from_fx, rebuild_outputs
from kiln.ir.graph import Graph, InputKind, Value
from kiln.options import Options
from kiln.pipeline import Pipeline

_log = logger("dynamo")


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
        self.compiled: dict[tuple[Any, ...], Compiled | None] = {}
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        key = _signature(args)
        if key not in self.compiled:
            with self._lock:
                if key not in self.compiled:
                    self.compiled[key] = self._compile(args)
        entry = self.compiled[key]
        return self.gm(*args) if entry is None else entry(args)

    def _compile(self, args: tuple[Any, ...]) -> Compiled | None:
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
        return Compiled(graph, self.pipeline(graph)[1], self.gm, _signature(args))


class Compiled:
    """A traced graph's compiled callable, fed straight from Dynamo's flat arguments."""

    def __init__(self, graph: Graph, run: Any, gm: torch.nn.Module, key: tuple[Any, ...]) -> None:
        self.graph = graph
        self.run = run
        self.output_count = len(graph.outputs)
        # The k-th distinct tensor argument is the k-th USER input (kiln.trace's order).
        positions = iter(sorted({k[-1] for k in key[1:] if isinstance(k, tuple)}))
        self.feed = [_feeder(value, graph, gm, positions) for value in graph.inputs]
        index = {value: i for i, value in enumerate(graph.inputs)}
        self.written = [index[target] for target, _ in graph.mutations]

    def __call__(self, args: tuple[Any, ...]) -> Any:
        inputs = [feed(args) for feed in self.feed]
        results = self.run(inputs)
        count = self.output_count
        with torch.no_grad():
            for position, new in zip(self.written, results[count:], strict=True):
                inputs[position].copy_(new)
        return rebuild_outputs(self.graph, results[:count])


def _feeder(
    value: Value, graph: Graph, gm: torch.nn.Module, positions: Iterator[int]
) -> Callable[[tuple[Any, ...]], torch.Tensor]:
    """How a call's arguments give the graph input ``value``."""
    if value.kind is InputKind.USER:
        return operator.itemgetter(next(positions))
    if value.kind is InputKind.RNG_SEED:
        return lambda args: torch.randint(0, 2**62, (), dtype=torch.int64)
    if value.kind is InputKind.CONSTANT:
        tensor = graph.constants[value.name]
    else:  # the GraphModule's own parameter or buffer (updated in place, never replaced)
        owner, _, attr = value.source.rpartition(".")
        tensor = getattr(gm.get_submodule(owner), attr)
    return lambda args: tensor


def _signature(args: Sequence[Any]) -> tuple[Any, ...]:
    """What a traced graph is specialized to: grad mode, then per argument a tensor's shape,
    dtype, device, requires_grad and first position (a tensor passed twice is one input),
    or another argument's value."""
    first: dict[int, int] = {}
    return (
        torch.is_grad_enabled(),
        *[
            (a.shape, a.dtype, a.device, a.requires_grad, first.setdefault(id(a), i))
            if isinstance(a, torch.Tensor)
            else a
            for i, a in enumerate(args)
        ],
    )
