"""The conformance kit for backends: ``kiln.testing.check_backend(name)``.

It runs every op-table row (each registry row's samples, per sampled dtype) and a few small
models through a backend, compares with eager PyTorch, and reports coverage::

    >>> import kiln.testing
    >>> print(kiln.testing.check_backend("numpy"))
    backend numpy: 290/426 op rows run on it (290 pass, 0 fail), 136 fall back; models 3/3 pass

A row runs on the backend when its capabilities accept the row's nodes (without declared
capabilities, every row does); what they refuse runs on the ``eager`` backend and counts as
a fallback. The kit compiles in strict mode, so a backend that fails counts as failing, never
as silently replaced.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.api import compile as kiln_compile
from kiln.backends import Backend, compile_split, lookup_backend
from kiln.ir import Graph, GraphBuilder, OpDef, Tag, TensorType, registered_ops
from kiln.ops import prims
from kiln.options import Options

# (rtol, atol) against eager; 16-bit floats may round at other points than eager does.
TOLERANCES = {
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float32: (2e-5, 1e-6),
    torch.float64: (1e-9, 1e-12),
}


@dataclass
class Result:
    """One op row (``name`` is ``op-dtype``) or model: ``passed``, ``failed`` or ``fallback``."""

    name: str
    status: str
    note: str = ""

    def __str__(self) -> str:
        return f"{self.name}: {self.status}" + (f" ({self.note})" if self.note else "")


@dataclass
class Coverage:
    """What :func:`check_backend` found."""

    backend: str
    rows: list[Result] = field(default_factory=list)
    models: list[Result] = field(default_factory=list)

    def count(self, status: str, results: list[Result] | None = None) -> int:
        return sum(r.status == status for r in (self.rows if results is None else results))

    @property
    def on_backend(self) -> int:
        """Op rows the backend ran (passing or not)."""
        return len(self.rows) - self.count("fallback")

    @property
    def failures(self) -> list[Result]:
        return [r for r in [*self.rows, *self.models] if r.status == "failed"]

    def __str__(self) -> str:
        passed, models = self.count("passed"), self.count("passed", self.models)
        lines = [
            f"backend {self.backend}: {self.on_backend}/{len(self.rows)} op rows run on it "
            f"({passed} pass, {self.count('failed')} fail), {self.count('fallback')} fall "
            f"back; models {models}/{len(self.models)} pass"
        ]
        return "\n".join(lines + [f"  {failure}" for failure in self.failures])


def check_backend(name: str, *, models: bool = True) -> Coverage:
    """Run the op table and (``models``) the model checks through backend ``name``."""
    backend = lookup_backend(name)
    coverage = Coverage(name)
    for row in registered_ops():
        for dtype in sorted(row.dtypes, key=str) if row.samples else []:
            label = f"{row.op.printed_name}-{str(dtype).replace('torch.', '')}"
            coverage.rows.append(_check_row(backend, row, dtype, label))
    if models:
        coverage.models = [_check_model(name, *case) for case in MODELS]
    return coverage


def sample_graph(row: OpDef, samples: list[Any]) -> tuple[Graph, list[torch.Tensor]]:
    """One graph applying ``row``'s op to every sample, and its input tensors."""
    graph = Graph(name=f"{row.op.printed_name}_samples")
    tensors: list[torch.Tensor] = []
    with GraphBuilder(graph):
        for sample in samples:
            operands: list[Any] = []
            for item in sample.inputs:
                if isinstance(item, torch.Tensor):
                    operands.append(graph.add_input(TensorType.of(item), name="x"))
                    tensors.append(item)
                else:
                    operands.append(item)
            attrs = sample.attrs
            keywords = {k: getattr(attrs, k) for k in attrs.__dataclass_fields__} if attrs else {}
            result = prims.call(row.op, *operands, **keywords)
            graph.outputs += list(result) if isinstance(result, tuple) else [result]
    return graph, tensors


def _check_row(backend: Backend, row: OpDef, dtype: torch.dtype, label: str) -> Result:
    assert row.samples is not None
    samples = list(row.samples(dtype, torch.device("cpu")))
    graph, tensors = sample_graph(row, samples)
    capabilities = getattr(backend, "capabilities", None)
    refusals = [capabilities.refusal(node) for node in graph.nodes] if capabilities else []
    if refusals and all(refusals):
        return Result(label, "fallback", refusals[0])
    try:
        options = Options(backend=backend.name, strict=True)
        compiled = compile_split(graph, backend, options, lookup_backend("eager"))
        actual = compiled(tensors)
        expected = [out for s in samples for out in _as_list(row.impl(s.attrs, *s.inputs))]
        for got, want in zip(actual, expected, strict=True):
            _compare(got, want, random=Tag.RANDOM in row.tags)
    except Exception as error:
        return Result(label, "failed", f"{type(error).__name__}: {error}".splitlines()[0][:200])
    return Result(label, "passed", "partly on the default backend" if any(refusals) else "")


def _as_list(result: Any) -> list[Any]:
    return list(result) if isinstance(result, tuple) else [result]


def _compare(got: torch.Tensor, want: torch.Tensor, random: bool = False) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(
            f"got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
        )
    if random:  # other draws than eager's: types only
        return
    rtol, atol = TOLERANCES.get(want.dtype, (0, 0))
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _norm_softmax() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Softmax(dim=-1))


# (name, model factory, input shape, whether to train: compare every parameter's gradient)
MODELS: list[tuple[str, Callable[[], torch.nn.Module], tuple[int, ...], bool]] = [
    ("mlp inference", _mlp, (5, 8), False),
    ("mlp training", _mlp, (5, 8), True),
    ("layernorm softmax training", _norm_softmax, (3, 8), True),
]


def _check_model(
    backend: str,
    name: str,
    make: Callable[[], torch.nn.Module],
    shape: tuple[int, ...],
    train: bool,
) -> Result:
    """The model compiled by ``backend`` against eager: outputs and every parameter's
    gradient."""
    torch.manual_seed(0)
    eager = make()
    model = copy.deepcopy(eager)
    x = torch.randn(shape)
    try:
        compiled = kiln_compile(model, backend=backend, options={"strict": True})
        with torch.set_grad_enabled(train):
            got, want = compiled(x), eager(x)
            _compare(got, want)
        if train:
            (got * torch.cos(got)).sum().backward()
            (want * torch.cos(want)).sum().backward()
            for (label, mine), theirs in zip(
                model.named_parameters(), eager.parameters(), strict=True
            ):
                assert mine.grad is not None, f"no gradient for {label}"
                _compare(mine.grad, theirs.grad)  # type: ignore[arg-type]
    except Exception as error:
        return Result(name, "failed", f"{type(error).__name__}: {error}".splitlines()[0][:200])
    return Result(name, "passed")
