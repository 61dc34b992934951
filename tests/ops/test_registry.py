"""Table-driven test of every registry row x every dtype it supports, on CPU.

For each sample: the op's meta must predict the shape and dtype eager torch produces; a
one-node graph built through the prims must verify, interpret to eager's result, and print as
Python that runs to the same result.
"""

from __future__ import annotations

import pytest
import torch

import kiln.ops  # noqa: F401  (registers rows)
from kiln.ir import Graph, GraphBuilder, Op, Tag, TensorType, Value, load_printed, op_def
from kiln.ir import interpret, registered_ops, verify
from kiln.ops import prims

ROWS = [(row.op, dtype) for row in registered_ops() for dtype in sorted(row.dtypes, key=str)]


def test_every_op_has_a_row_with_samples() -> None:
    missing = [op.name for op in Op if op not in {row.op for row in registered_ops()}]
    assert not missing, f"ops without registry rows: {missing}"
    for row in registered_ops():
        assert row.samples is not None and row.dtypes, f"{row.op.name} has no samples"


def _graph_of(op: Op, inputs: tuple[object, ...], attrs: object) -> tuple[Graph, list[torch.Tensor]]:
    graph = Graph(name="one_op")
    tensors: list[torch.Tensor] = []
    operands: list[object] = []
    with GraphBuilder(graph):
        for index, item in enumerate(inputs):
            if isinstance(item, torch.Tensor):
                operands.append(graph.add_input(TensorType.of(item), name=f"x{index}"))
                tensors.append(item)
            elif isinstance(item, list | tuple) and item and isinstance(item[0], torch.Tensor):
                raise AssertionError("prims take flat operands")
            else:
                operands.append(item)
        kwargs = {}
        if attrs is not None:
            kwargs = {name: getattr(attrs, name) for name in attrs.__dataclass_fields__}
        result = prims.call(op, *operands, **kwargs)
        graph.outputs = list(result) if isinstance(result, tuple) else [result]
    return graph, tensors


def _same(actual: torch.Tensor, expected: torch.Tensor, random: bool) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    if not random:
        torch.testing.assert_close(actual, expected, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize(("op", "dtype"), ROWS, ids=[f"{o.name.lower()}-{d}" for o, d in ROWS])
def test_row(op: Op, dtype: torch.dtype) -> None:
    row = op_def(op)
    assert row.samples is not None
    samples = row.samples(dtype, torch.device("cpu"))
    assert samples, f"{op.name} has no samples for {dtype}"
    random = Tag.RANDOM in row.tags
    for sample in samples:
        expected = row.impl(sample.attrs, *sample.inputs)
        expected_list = list(expected) if isinstance(expected, tuple) else [expected]
        graph, tensors = _graph_of(op, sample.inputs, sample.attrs)
        verify(graph)
        for value, tensor in zip(graph.outputs, expected_list, strict=True):
            assert isinstance(value, Value)
            assert value.type.shape == tuple(tensor.shape), sample.note
            assert value.type.dtype == tensor.dtype, sample.note
        for actual, want in zip(interpret(graph, tensors), expected_list, strict=True):
            _same(actual, want, random)
        for actual, want in zip(load_printed(graph)(*tensors), expected_list, strict=True):
            _same(actual, want, random)
