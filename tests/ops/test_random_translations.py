"""Statistics of the random translations (rand, randn, randint, bernoulli, dropout).

The table-driven test checks only their types; here the numbers: ranges, moments, the kept
fraction and scale of dropout, fresh draws on every call of one graph, and replay from a seed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kiln.ops  # noqa: F401  (registers translations)
from kiln.frontends import run_traced, trace
from kiln.ir import Op

N = 20_000


def _run(fn: Callable[..., Any], *args: torch.Tensor) -> Any:
    """Trace ``fn`` and run the graph, checking that no extern stood in for a translation."""
    graph = trace(fn, *args)
    assert not [node for node in graph.nodes if node.op is Op.EXTERN], str(graph)
    return run_traced(graph, fn, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rand_is_uniform_in_unit_interval(dtype: torch.dtype) -> None:
    values = _run(lambda: torch.rand(N, dtype=dtype)).float()
    assert values.min() >= 0 and values.max() < 1
    assert abs(values.mean().item() - 0.5) < 0.02
    assert abs(values.var().item() - 1 / 12) < 0.01


def test_randn_is_standard_normal() -> None:
    values = _run(lambda x: torch.randn(N) + torch.randn_like(x), torch.zeros(N))
    assert abs(values.mean().item()) < 0.05
    assert abs(values.std().item() - 2**0.5) < 0.05


def test_randint_covers_its_range() -> None:
    values = _run(lambda: torch.randint(-3, 4, (N,)))
    assert values.dtype == torch.int64
    assert set(values.unique().tolist()) == set(range(-3, 4))


def test_bernoulli_follows_its_probabilities() -> None:
    p = torch.full((N,), 0.25)
    values = _run(torch.bernoulli, p)
    assert set(values.unique().tolist()) <= {0.0, 1.0}
    assert abs(values.mean().item() - 0.25) < 0.02


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_keeps_one_minus_p_scaled(p: float) -> None:
    x = torch.rand(N) + 0.5
    out = _run(lambda t: F.dropout(t, p), x)
    kept = out != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.02
    torch.testing.assert_close(out[kept], x[kept] / (1 - p))


def test_feature_dropout_drops_whole_channels() -> None:
    x = torch.rand(8, 64, 5, 5) + 0.5
    out = _run(lambda t: F.dropout2d(t, 0.5), x)
    per_channel = (out != 0).float().mean(dim=(2, 3))
    assert set(per_channel.unique().tolist()) <= {0.0, 1.0}
    assert 0.3 < per_channel.mean().item() < 0.7


def test_dropout_in_eval_mode_is_identity() -> None:
    graph = trace(lambda t: F.dropout(t, 0.5, training=False), torch.rand(4))
    assert not [node for node in graph.nodes if node.op is Op.RANDOM_UNIFORM]


def test_each_call_draws_new_numbers() -> None:
    x = torch.ones(1000)

    def program(t: torch.Tensor) -> torch.Tensor:
        return F.dropout(t, 0.5)

    graph = trace(program, x)
    first, second = run_traced(graph, program, x), run_traced(graph, program, x)
    assert not torch.equal(first, second)


def test_two_draws_in_one_graph_differ() -> None:
    first, second = _run(lambda: (torch.rand(1000), torch.rand(1000)))
    assert not torch.equal(first, second)


def test_a_seed_replays_the_same_numbers() -> None:
    graph = trace(lambda: torch.randn(100))
    torch.manual_seed(0)
    first = run_traced(graph, lambda: None)
    torch.manual_seed(0)
    second = run_traced(graph, lambda: None)
    assert torch.equal(first, second)
