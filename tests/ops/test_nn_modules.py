"""Layers built on matmul, convolution, pooling, embedding and attention, traced end to end.

Each module is traced with ``kiln.frontends.trace`` (no extern nodes allowed) and run with
``run_traced``; the result must match the eager module on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln.ops  # noqa: F401  (registers translations)
from kiln.frontends import run_traced, trace
from kiln.ir import Graph, Op


def _x(*shape: int) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: (torch.randn(shape),)


def _tokens(count: int, *shape: int) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: (torch.randint(0, count, shape),)


def _qkv(batch_first: bool, masks: bool = False) -> Callable[[], tuple[Any, ...]]:
    def inputs() -> tuple[Any, ...]:
        shape = (2, 3, 8) if batch_first else (3, 2, 8)
        query = torch.randn(shape)
        if not masks:
            return (query, query, query)
        key = torch.randn(2, 5, 8) if batch_first else torch.randn(5, 2, 8)
        padding = torch.zeros(2, 5, dtype=torch.bool)
        padding[:, -1] = True
        return (query, key, key, padding)

    return inputs


def _mha(batch_first: bool, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: nn.MultiheadAttention(8, 2, batch_first=batch_first, **kwargs)


class _Attend(nn.Module):
    """nn.MultiheadAttention called with keyword arguments (masks, need_weights)."""

    def __init__(self, batch_first: bool, need_weights: bool) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=8, vdim=8)
        self.need_weights = need_weights

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, padding: torch.Tensor
    ) -> Any:
        return self.attention(
            query, key, value, key_padding_mask=padding, need_weights=self.need_weights
        )


MODULES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]]]] = {
    "linear": (lambda: nn.Linear(6, 4), _x(3, 6)),
    "linear_3d_no_bias": (lambda: nn.Linear(6, 4, bias=False), _x(2, 3, 6)),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), _x(2, 3, 10)),
    "conv2d": (lambda: nn.Conv2d(3, 6, 3, stride=2, groups=3), _x(2, 3, 9, 9)),
    "conv2d_same": (lambda: nn.Conv2d(3, 4, 4, padding="same", dilation=1), _x(1, 3, 7, 7)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2), _x(1, 2, 4, 4, 4)),
    "conv_transpose2d": (
        lambda: nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1),
        _x(2, 3, 5, 5),
    ),
    "max_pool2d": (lambda: nn.MaxPool2d(3, stride=2, padding=1), _x(2, 3, 9, 9)),
    "avg_pool2d": (lambda: nn.AvgPool2d(2, ceil_mode=True), _x(2, 3, 7, 7)),
    "adaptive_avg_pool2d_global": (lambda: nn.AdaptiveAvgPool2d((1, 1)), _x(2, 3, 14, 14)),
    "adaptive_avg_pool2d_7x7": (lambda: nn.AdaptiveAvgPool2d((7, 7)), _x(2, 3, 14, 14)),
    "adaptive_avg_pool2d_uneven": (lambda: nn.AdaptiveAvgPool2d((5, 3)), _x(1, 2, 14, 14)),
    "adaptive_max_pool2d": (lambda: nn.AdaptiveMaxPool2d(3), _x(1, 2, 8, 8)),
    "embedding": (lambda: nn.Embedding(10, 4, padding_idx=0), _tokens(10, 2, 5)),
    "pixel_shuffle": (lambda: nn.PixelShuffle(2), _x(1, 8, 3, 3)),
    "upsample_nearest": (lambda: nn.Upsample(scale_factor=2), _x(1, 2, 3, 3)),
    "mha_self": (_mha(False), _qkv(False)),
    "mha_self_batch_first": (_mha(True), _qkv(True)),
    "mha_masks_weights": (lambda: _Attend(False, True), _qkv(False, masks=True)),
    "mha_masks_no_weights_batch_first": (lambda: _Attend(True, False), _qkv(True, masks=True)),
}


def _externs(graph: Graph) -> list[Any]:
    return [node.attrs.fn for node in graph.nodes if node.op is Op.EXTERN]


@pytest.mark.parametrize("name", list(MODULES))
def test_nn_module(name: str) -> None:
    make, inputs = MODULES[name]
    module = make().eval()
    args = inputs()
    graph = trace(module, *args)
    assert not _externs(graph), f"{name} fell back to extern: {_externs(graph)}\n{graph}"
    expected = module(*args)
    actual = run_traced(graph, module, *args)
    torch.testing.assert_close(actual, expected)


def test_sdpa_dropout_draws_in_the_graph() -> None:
    """Attention dropout is decomposed: new numbers on every run, the expected scale kept."""
    q, k, v = (torch.randn(2, 2, 4, 8) for _ in range(3))

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)

    graph = trace(attend, q, k, v)
    assert not _externs(graph)
    assert any(node.op is Op.RANDOM_UNIFORM for node in graph.nodes)
    first, second = run_traced(graph, attend, q, k, v), run_traced(graph, attend, q, k, v)
    assert first.shape == (2, 2, 4, 8) and not torch.equal(first, second)
    ones = torch.ones(2, 2, 64, 8)
    graph = trace(attend, ones, ones, ones)
    mean = torch.stack([run_traced(graph, attend, ones, ones, ones).mean() for _ in range(20)])
    assert abs(float(mean.mean()) - 1.0) < 0.1  # dropout rescales by 1 / (1 - p)
