"""Every registry row's VJP against torch.autograd on the row's reference implementation.

For each row x sample: a graph holding the forward node and its VJP (cotangents as graph
inputs) is built through the prims and interpreted; the input gradients must equal
``torch.autograd.grad`` of the reference impl with the same cotangents. Float64 where the row
supports it (tight tolerance, a gradcheck-grade comparison), else the row's own float dtypes
with dtype tolerances. Rows whose VJP is not written yet are listed by
``test_every_differentiable_row_has_a_vjp``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kiln.ops  # noqa: F401  (registers rows)
from kiln.autodiff.rules import differentiable_inputs, vjp_of
from kiln.ir import Graph, GraphBuilder, Op, Tag, TensorType, Value, interpret, op_def, verify
from kiln.ir.op import registered_ops
from kiln.ops import prims

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
TOLERANCE = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (5e-2, 5e-2),
    torch.float16: (1e-2, 1e-2),
}


def _gradient_dtype(op: Op) -> torch.dtype | None:
    """float64 when the row takes it, else its first float dtype; None: no float dtype."""
    dtypes = op_def(op).dtypes
    if torch.float64 in dtypes or (
        Tag.ELEMENTWISE in op_def(op).tags and dtypes & set(FLOAT_DTYPES)
    ):
        return torch.float64
    return next((d for d in FLOAT_DTYPES if d in dtypes), None)


DIFFERENTIABLE = [
    row.op
    for row in registered_ops()
    if Tag.NONDIFFERENTIABLE not in row.tags
    and Tag.RANDOM not in row.tags
    and Tag.CREATION not in row.tags
    and _gradient_dtype(row.op) is not None
]


def test_every_differentiable_row_has_a_vjp() -> None:
    missing = [op.name for op in DIFFERENTIABLE if op_def(op).vjp is None]
    assert not missing, f"rows without a VJP: {missing}"


def _samples(op: Op, dtype: torch.dtype) -> list[Any]:
    row = op_def(op)
    assert row.samples is not None
    sample_dtype = dtype if dtype in row.dtypes else next(iter(row.dtypes & set(FLOAT_DTYPES)))
    samples = list(row.samples(sample_dtype, torch.device("cpu")))
    if sample_dtype == dtype:
        return samples
    converted = []
    for sample in samples:
        inputs = tuple(
            item.to(dtype)
            if isinstance(item, torch.Tensor) and item.dtype == sample_dtype
            else item
            for item in sample.inputs
        )
        converted.append(type(sample)(inputs, sample.attrs, sample.note))
    return converted


def _check_sample(op: Op, sample: Any, dtype: torch.dtype) -> None:
    row = op_def(op)
    attrs = sample.attrs
    wrt = differentiable_inputs(op, sample.inputs)
    if not wrt:
        return
    leaves = [
        item.detach().clone().requires_grad_(i in wrt) if isinstance(item, torch.Tensor) else item
        for i, item in enumerate(sample.inputs)
    ]
    expected_out = row.impl(attrs, *leaves)
    outs = expected_out if isinstance(expected_out, tuple) else (expected_out,)
    cotangents = [
        torch.randn_like(o) if o.dtype.is_floating_point and o.requires_grad else None for o in outs
    ]
    if all(c is None for c in cotangents):
        return
    pairs = [(o, c) for o, c in zip(outs, cotangents, strict=True) if c is not None]
    try:
        expected = torch.autograd.grad(
            [o for o, _ in pairs],
            [leaves[i] for i in wrt],
            [c for _, c in pairs],
            allow_unused=True,
        )
    except RuntimeError as error:
        if "not implemented" in str(error):
            return  # eager itself has no derivative here (aminmax in torch 2.11): no oracle
        raise

    graph = Graph(name="vjp")
    feeds: list[torch.Tensor] = []
    with GraphBuilder(graph):
        operands: list[Any] = []
        for index, item in enumerate(sample.inputs):
            if isinstance(item, torch.Tensor):
                operands.append(graph.add_input(TensorType.of(leaves[index]), name=f"x{index}"))
                feeds.append(item)
            else:
                operands.append(item)
        kwargs = {}
        if attrs is not None:
            kwargs = {name: getattr(attrs, name) for name in attrs.__dataclass_fields__}
        result = prims.call(op, *operands, **kwargs)
        outputs = result if isinstance(result, tuple) else (result,)
        grads: list[Value | None] = []
        for cotangent in cotangents:
            if cotangent is None:
                grads.append(None)
                continue
            grads.append(graph.add_input(TensorType.of(cotangent), name="g"))
            feeds.append(cotangent)
        node = graph.nodes[-1]
        input_grads = vjp_of(node, tuple(grads))
        graph.outputs = [input_grads[i] if input_grads[i] is not None else outputs[0] for i in wrt]
    verify(graph)
    actual = interpret(graph, feeds)
    rtol, atol = TOLERANCE[dtype]
    for position, index in enumerate(wrt):
        want = expected[position]
        if want is None:
            assert input_grads[index] is None or not actual[position].any(), sample.note
            continue
        assert input_grads[index] is not None, f"{op.name} gave no gradient for input {index}"
        got = actual[position]
        assert got.shape == want.shape and got.dtype == want.dtype, sample.note
        torch.testing.assert_close(
            got, want, rtol=rtol, atol=atol, msg=lambda m: f"{sample.note}: {m}"
        )


@pytest.mark.parametrize("op", DIFFERENTIABLE, ids=[op.name.lower() for op in DIFFERENTIABLE])
def test_vjp_matches_autograd(op: Op) -> None:
    if op_def(op).vjp is None:
        pytest.skip("no VJP yet (listed by test_every_differentiable_row_has_a_vjp)")
    dtype = _gradient_dtype(op)
    assert dtype is not None
    for sample in _samples(op, dtype):
        _check_sample(op, sample, dtype)


LOW_PRECISION = [
    (op, dtype)
    for op in DIFFERENTIABLE
    for dtype in (torch.float32, torch.bfloat16)
    if dtype in op_def(op).dtypes and dtype != _gradient_dtype(op)
]


@pytest.mark.parametrize(
    ("op", "dtype"), LOW_PRECISION, ids=[f"{op.name.lower()}-{d}" for op, d in LOW_PRECISION]
)
def test_vjp_in_the_rows_own_dtypes(op: Op, dtype: torch.dtype) -> None:
    """The same comparison in float32 and bfloat16, with those dtypes' tolerances."""
    if op_def(op).vjp is None:
        pytest.skip("no VJP yet (listed by test_every_differentiable_row_has_a_vjp)")
    for sample in _samples(op, dtype):
        _check_sample(op, sample, dtype)
