"""The op table through the ``kiln`` backend: every registry row x dtype x sample, compiled by
one code generator and compared with the row's reference implementation.

Each test module (one per code generator) parametrizes :func:`check_row`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import kiln.ops  # noqa: F401  (registers rows)
from kiln.backends.kiln import KilnProgram
from kiln.ir import Graph, GraphBuilder, Op, Tag, TensorType, op_def, registered_ops
from kiln.ops import prims
from kiln.options import Options

# The device samples are made on: CI runs CPU tensors (the Triton generator through Triton's
# interpreter); on a GPU machine, KILN_TEST_DEVICE=cuda runs the compiled Triton kernels.
DEVICE = torch.device(os.environ.get("KILN_TEST_DEVICE", "cpu"))

ROWS = [(row.op, dtype) for row in registered_ops() for dtype in sorted(row.dtypes, key=str)]
ROW_IDS = [f"{o.name.lower()}-{d}".replace("torch.", "") for o, d in ROWS]

# Tolerances of a generated kernel against eager: 16-bit floats are computed in float32 and
# rounded once at the store, where eager rounds after every op.
TOLERANCES = {
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float32: (2e-5, 1e-6),
    torch.float64: (1e-9, 1e-12),
}


def graph_of(
    op: Op, samples: list[tuple[tuple[object, ...], object]]
) -> tuple[Graph, list[torch.Tensor], list[int]]:
    """One graph applying ``op`` to every sample (one build per row and dtype); returns the
    graph, its input tensors, and how many outputs each sample has."""
    graph = Graph(name=f"{op.printed_name}_graph")
    tensors: list[torch.Tensor] = []
    counts: list[int] = []
    with GraphBuilder(graph):
        for number, (inputs, attrs) in enumerate(samples):
            operands: list[object] = []
            for index, item in enumerate(inputs):
                if isinstance(item, torch.Tensor):
                    name = f"s{number}_x{index}"
                    operands.append(graph.add_input(TensorType.of(item), name=name))
                    tensors.append(item)
                else:
                    operands.append(item)
            kwargs = {}
            if attrs is not None:
                kwargs = {name: getattr(attrs, name) for name in attrs.__dataclass_fields__}
            result = prims.call(op, *operands, **kwargs)
            results = list(result) if isinstance(result, tuple) else [result]
            graph.outputs += results
            counts.append(len(results))
    return graph, tensors, counts


def run_compiled(graph: Graph, tensors: list[torch.Tensor], codegen: str) -> list[torch.Tensor]:
    return KilnProgram(graph, Options(codegen=codegen, strict=True))(tensors)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, note: str, exact: bool) -> None:
    assert actual.shape == expected.shape, note
    assert actual.dtype == expected.dtype, note
    if exact or not expected.dtype.is_floating_point:
        torch.testing.assert_close(actual, expected, equal_nan=True, rtol=0, atol=0, msg=note)
        return
    rtol, atol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, equal_nan=True, rtol=rtol, atol=atol, msg=note)


def check_row(op: Op, dtype: torch.dtype, codegen: str, exact: bool = False) -> None:
    row = op_def(op)
    assert row.samples is not None
    random = Tag.RANDOM in row.tags
    samples = row.samples(dtype, DEVICE)
    graph, tensors, counts = graph_of(op, [(sample.inputs, sample.attrs) for sample in samples])
    actual = iter(run_compiled(graph, tensors, codegen))
    for sample, count in zip(samples, counts, strict=True):
        expected: Any = row.impl(sample.attrs, *sample.inputs)
        expected_list = list(expected) if isinstance(expected, tuple) else [expected]
        assert len(expected_list) == count
        note = f"{op.name} {dtype} {sample.note} attrs={sample.attrs}"
        for want in expected_list:
            got = next(actual)
            if random:
                assert got.shape == want.shape and got.dtype == want.dtype, note
                if got.numel() and op is Op.RANDOM_UNIFORM:
                    assert float(got.min()) >= 0 and float(got.max()) < 1, note
                continue
            assert_matches(got, want, note, exact)
