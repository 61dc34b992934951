"""``kiln.register_lowering``: custom ops with and without a lowering, forward and backward
against eager, fusion with neighbours, and a custom op that mutates its argument."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import kiln
from kiln.errors import OpError
from kiln.ir.op import Op


@torch.library.custom_op("kiln_test::scaled_sin", mutates_args=())
def scaled_sin(x: torch.Tensor, k: float) -> torch.Tensor:
    return torch.sin(x) * k


@scaled_sin.register_fake
def _(x: torch.Tensor, k: float) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_sin_backward(ctx, grad):  # type: ignore[no-untyped-def]
    (x,) = ctx.saved_tensors
    return grad * torch.cos(x) * ctx.k, None


def _scaled_sin_setup(ctx, inputs, output):  # type: ignore[no-untyped-def]
    ctx.save_for_backward(inputs[0])
    ctx.k = inputs[1]


scaled_sin.register_autograd(_scaled_sin_backward, setup_context=_scaled_sin_setup)


@torch.library.custom_op("kiln_test::accumulate", mutates_args=("total",))
def accumulate(total: torch.Tensor, x: torch.Tensor) -> None:
    total.add_(x * x)


@accumulate.register_fake
def _(total: torch.Tensor, x: torch.Tensor) -> None:
    return None


def program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (scaled_sin(x * w, 2.5) + 1.0).tanh()


@pytest.fixture
def lowered() -> Iterator[None]:
    kiln.register_lowering(scaled_sin, lambda x, k: torch.sin(x) * k)
    try:
        yield
    finally:
        kiln.register_lowering(scaled_sin, None)


def _check_forward_backward(fn: object) -> None:
    x, w = torch.randn(64), torch.randn(64, requires_grad=True)
    w_eager = w.detach().clone().requires_grad_()
    compiled = kiln.compile(fn)
    out = compiled(x, w)
    expected = program(x, w_eager)
    torch.testing.assert_close(out, expected)
    grad = torch.randn(64)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(w.grad, w_eager.grad)


def test_without_lowering_the_op_is_an_extern_with_eager_gradients() -> None:
    graph = kiln.trace(program, torch.randn(8), torch.randn(8))
    assert [node.op for node in graph.nodes].count(Op.EXTERN) == 1
    kiln.reset()
    _check_forward_backward(lambda x, w: program(x, w))
    assert kiln.counters.graphs >= 1 and not kiln.counters.fallbacks


def test_a_lowered_op_is_prims_and_fuses_with_its_neighbours(lowered: None) -> None:
    graph = kiln.trace(program, torch.randn(8), torch.randn(8))
    ops = [node.op for node in graph.nodes]
    assert Op.EXTERN not in ops and Op.SIN in ops
    report = kiln.explain(program, torch.randn(64), torch.randn(64))
    assert not report.externs
    assert len(report.kernels) == 1, report.kernels  # mul, sin, mul, add, tanh: one kernel
    assert "sin" in report.kernels[0]


def test_a_lowered_op_differentiates_through_its_prims(lowered: None) -> None:
    kiln.reset()
    _check_forward_backward(lambda x, w: program(x, w))
    assert kiln.counters.graphs >= 1 and not kiln.counters.fallbacks


def _accumulating_step(total: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    accumulate(total, x.cos())
    return total * 3.0


def _check_accumulating_step() -> None:
    compiled = kiln.compile(lambda total, x: _accumulating_step(total, x))
    for _ in range(2):  # the second call reads what the first wrote
        total, x = torch.randn(16), torch.randn(16)
        total_eager = total.clone()
        out = compiled(total, x)
        torch.testing.assert_close(out, _accumulating_step(total_eager, x))
        torch.testing.assert_close(total, total_eager)


def test_without_lowering_a_mutating_custom_op_runs_eagerly_at_a_graph_break() -> None:
    kiln.reset()
    _check_accumulating_step()
    assert kiln.counters.graph_breaks


def test_a_mutating_custom_op_writes_its_argument_back() -> None:
    step = _accumulating_step
    kiln.register_lowering(accumulate, lambda total, x: total.add_(x * x))
    try:
        graph = kiln.trace(step, torch.randn(16), torch.randn(16))
        assert Op.EXTERN not in [node.op for node in graph.nodes]
        assert len(graph.mutations) == 1
        kiln.reset()
        _check_accumulating_step()
        assert not kiln.counters.graph_breaks and not kiln.counters.fallbacks
    finally:
        kiln.register_lowering(accumulate, None)


def test_a_lowering_that_forgets_the_mutation_is_an_error() -> None:
    kiln.register_lowering(accumulate, lambda total, x: total + x * x)
    try:
        with pytest.raises(OpError, match="does not write its mutated argument 'total'"):
            kiln.trace(lambda t, x: accumulate(t, x), torch.randn(4), torch.randn(4))
    finally:
        kiln.register_lowering(accumulate, None)


def test_a_torch_function_can_be_lowered_too() -> None:
    def entropy(x: torch.Tensor) -> torch.Tensor:
        return torch.special.entr(x)

    kiln.register_lowering(torch.special.entr, lambda x: -x * torch.log(x))
    try:
        graph = kiln.trace(entropy, torch.rand(8) + 0.1)
        assert Op.EXTERN not in [node.op for node in graph.nodes]
        x = torch.rand(8) + 0.1
        torch.testing.assert_close(kiln.run_traced(graph, entropy, x), torch.special.entr(x))
    finally:
        kiln.register_lowering(torch.special.entr, None)
    graph = kiln.trace(entropy, torch.rand(8) + 0.1)
    assert Op.EXTERN in [node.op for node in graph.nodes]  # (removed: back to the extern)
