"""Reduction splitting: BatchNorm-style reductions become two, with the same results."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.frontends.trace import graph_inputs
from kiln.ir import Op, interpret, verify
from kiln.passes import split_reductions


def _reductions(graph: kiln.ir.Graph) -> list[tuple[Op, tuple[int, ...]]]:
    return [(n.op, tuple(n.attrs.dims)) for n in graph.nodes if n.op in (Op.SUM, Op.AMAX)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batchnorm_statistics_split(dtype: torch.dtype) -> None:
    x = torch.randn(8, 4, 12, 12, dtype=dtype)

    def stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum((0, 2, 3)), x.amax((0, 2, 3))

    graph = kiln.trace(stats, x)
    inputs = graph_inputs(graph, stats, x)
    expected = interpret(graph, inputs)
    split = verify(split_reductions(graph))
    assert ((Op.SUM, (2, 3)) in _reductions(split)) and ((Op.SUM, (0,)) in _reductions(split))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(interpret(split, inputs), expected, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_trailing_only_or_many_rows_are_left_alone() -> None:
    x = torch.randn(4, 8, 16)
    for fn in (lambda x: x.sum((1, 2)), lambda x: x.sum(0)):
        graph = kiln.trace(fn, x)
        assert _reductions(split_reductions(graph)) == _reductions(graph)


def test_training_batchnorm_gradients_match_after_the_split() -> None:
    bn = torch.nn.BatchNorm2d(4).train()
    x = torch.randn(6, 4, 10, 10, requires_grad=True)
    bn(x).square().mean().backward()
    expected = x.grad
    x.grad = None
    kiln.compile(bn)(x).square().mean().backward()
    assert x.grad is not None and expected is not None
    torch.testing.assert_close(x.grad, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "dims"), [((4096, 96), (0,)), ((3, 2048, 48), (0, 1)), ((1024, 2, 160), (0,))]
)
def test_column_reductions_are_chunked(
    dtype: torch.dtype,
    shape: tuple[int, ...],
    dims: tuple[int, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the GPU (claimed here: the rewrite is checked on the CPU) long column reductions
    are cut into chunks of rows."""
    from kiln.passes import reduction_split

    monkeypatch.setattr(reduction_split, "_chunks_columns", lambda value: True)
    x = torch.randn(*shape, dtype=dtype)

    def columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum(dims), x.amax(dims)

    graph = kiln.trace(columns, x)
    inputs = graph_inputs(graph, columns, x)
    expected = interpret(graph, inputs)
    split = verify(split_reductions(graph))
    reshapes = [n for n in split.nodes if n.op is Op.RESHAPE]
    assert len(reshapes) == 2  # one per reduction: [chunks, rows // chunks, *kept]
    chunks = reshapes[0].attrs.shape[0]
    rows = reshapes[0].attrs.shape[0] * reshapes[0].attrs.shape[1]
    assert chunks > 1 and rows // chunks >= 64
    assert (Op.SUM, (1,)) in _reductions(split) and (Op.SUM, (0,)) in _reductions(split)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(interpret(split, inputs), expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_columns_that_are_many_or_short_or_prime_are_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kiln.passes import reduction_split

    monkeypatch.setattr(reduction_split, "_chunks_columns", lambda value: True)
    for shape in ((4096, 20000), (100, 96), (4099, 96)):
        x = torch.randn(*shape)
        graph = kiln.trace(lambda x: x.sum(0), x)
        assert _reductions(split_reductions(graph)) == [(Op.SUM, (0,))]


def test_linear_bias_gradient_matches_after_the_column_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kiln.passes import reduction_split

    monkeypatch.setattr(reduction_split, "_chunks_columns", lambda value: True)
    linear = torch.nn.Linear(32, 48)
    x = torch.randn(8, 512, 32)
    linear(x).sin().sum().backward()
    expected = [p.grad for p in linear.parameters()]
    linear.zero_grad(set_to_none=True)
    kiln.compile(linear)(x).sin().sum().backward()
    for param, want in zip(linear.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_batchnorm_statistics_are_channels_last_columns(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU ``[N, C, H, W]`` is channels-last: the statistics reduce ``[N*H*W, C]``
    columns in chunks (the rewrite is checked on the CPU, claiming the GPU's layout)."""
    from kiln.passes import reduction_split

    monkeypatch.setattr(reduction_split, "_holds_channels_last", lambda value: True)
    x = torch.randn(8, 16, 48, 48, dtype=dtype)

    def stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum((0, 2, 3)), x.amin((0, 2, 3))

    graph = kiln.trace(stats, x)
    inputs = graph_inputs(graph, stats, x)
    expected = interpret(graph, inputs)
    split = verify(split_reductions(graph))
    permutes = [n.attrs.dims for n in split.nodes if n.op is Op.PERMUTE]
    assert permutes == [(0, 2, 3, 1)] * 2
    assert (Op.SUM, (1,)) in _reductions(split) and (Op.SUM, (0,)) in _reductions(split)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(interpret(split, inputs), expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_cpu_column_reductions_stay_whole() -> None:
    """The C++ kernels run columns in parallel already: no chunks on the CPU."""
    graph = kiln.trace(lambda x: x.sum(0), torch.randn(4096, 96))
    assert _reductions(split_reductions(graph)) == [(Op.SUM, (0,))]
