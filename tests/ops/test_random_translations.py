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


def test_inplace_bernoulli_fills_with_its_probability() -> None:
    def draw(x: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x).bernoulli_(0.8), torch.empty_like(x).bernoulli_(p)

    x = torch.randn(N)
    p = torch.rand(N)
    fixed, varying = _run(draw, x, p)
    assert set(fixed.unique().tolist()) <= {0.0, 1.0} and abs(fixed.mean().item() - 0.8) < 0.02
    assert abs(varying.mean().item() - p.mean().item()) < 0.02
    assert varying[p < 0.1].mean() < 0.15 and varying[p > 0.9].mean() > 0.85


def test_stochastic_depth_trains_compiled_without_breaks() -> None:
    """torchvision's and timm's stochastic depth: ``x.new_empty(...).bernoulli_(keep)`` per
    sample, scaled; in-place, it broke the graph inside every residual loop (a frame fallback)."""
    import kiln

    def drop_path(x: torch.Tensor, keep: float = 0.75) -> torch.Tensor:
        noise = x.new_empty([x.shape[0]] + [1] * (x.ndim - 1)).bernoulli_(keep)
        return x * noise.div_(keep)

    def blocks(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = x + drop_path(torch.tanh(x @ weight))
        return x

    kiln.reset()
    compiled = kiln.compile(blocks)
    x, weight = torch.randn(512, 8), torch.randn(8, 8, requires_grad=True)
    first = compiled(x, weight)
    first.sum().backward()
    assert weight.grad is not None and torch.isfinite(weight.grad).all()
    assert not kiln.counters.graph_breaks and not kiln.counters.fallbacks
    # one layer: each sample's branch is dropped (x unchanged) or scaled by 1 / keep
    kiln.reset()
    one = kiln.compile(lambda t, w: t + drop_path(torch.tanh(t @ w)))
    result = one(x, weight.detach())
    branch = torch.tanh(x @ weight.detach())
    kept = torch.isclose(result, x + branch / 0.75, atol=1e-5).all(1)
    dropped = torch.isclose(result, x, atol=1e-6).all(1)
    assert bool((kept | dropped).all()) and 0.65 < kept.float().mean().item() < 0.85
