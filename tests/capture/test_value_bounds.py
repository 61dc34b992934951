"""Branches a graph's ops decide alone (``kiln/ir/ranges.py``): ``torch.rand(...)`` lies in
``[0, 1]`` whatever the seed, so ``if torch.rand([]) < 0.0`` is False on every call and needs no
graph break. Anything the bounds do not decide still breaks, and still gives eager's result."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import kiln


class _LayerDrop(nn.Module):
    """LayerDrop as older transformers releases write it (no ``layerdrop > 0`` test first)."""

    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:  # skip the layer
                    continue
            x = torch.relu(layer(x)) + x
        return self.head(x)


def test_a_layerdrop_of_zero_trains_as_one_graph() -> None:
    kiln.reset()
    kiln.counters.reset()
    torch.manual_seed(0)
    model = _LayerDrop(0.0).train()
    compiled = kiln.compile(model)
    for batch in (8, 8, 8):
        x = torch.randn(batch, 16)
        expected = model(x)
        expected.square().sum().backward()
        wanted = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        out = compiled(x)
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        for got, want in zip((p.grad for p in model.parameters()), wanted, strict=True):
            torch.testing.assert_close(got, want)
        model.zero_grad(set_to_none=True)
    assert kiln.counters.graphs == 1
    assert not kiln.counters.graph_breaks and not kiln.counters.fallbacks


DECIDED: dict[str, tuple[Callable[[], torch.Tensor], bool]] = {
    "rand < 0": (lambda: torch.rand([]) < 0.0, False),
    "rand >= 0": (lambda: torch.rand(()) >= 0, True),
    "0 > rand (mirrored)": (lambda: 0.0 > torch.rand(1), False),  # noqa: SIM300
    "bf16 rand <= 1 (closed bound)": (lambda: torch.rand([]).to(torch.bfloat16) <= 1.0, True),
    "rand > 1 through a view": (lambda: torch.rand(1, 1).reshape(()) > 1.5, False),
}
UNDECIDED: dict[str, Callable[[], torch.Tensor]] = {
    "rand < 0.5": lambda: torch.rand([]) < 0.5,
    "rand < 1 (1.0 is within the closed bound)": lambda: torch.rand([]) < 1.0,
    "arithmetic is not followed": lambda: torch.rand([]) * 2 < 0.0,
    "randn": lambda: torch.randn([]) < -10.0,
}


def _branching(condition: Callable[[], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        if condition():
            return y * 2
        return y - 1

    return fn


@pytest.mark.parametrize("name", list(DECIDED))
def test_a_comparison_its_bounds_decide_needs_no_break(name: str) -> None:
    condition, truth = DECIDED[name]
    kiln.reset()
    kiln.counters.reset()
    fn = _branching(condition)
    compiled = kiln.compile(fn)
    for _ in range(3):
        x = torch.randn(5)
        torch.testing.assert_close(compiled(x), x.sin() * 2 if truth else x.sin() - 1)
    assert kiln.counters.graphs == 1 and not kiln.counters.graph_breaks


@pytest.mark.parametrize("name", list(UNDECIDED))
def test_a_comparison_its_bounds_leave_open_still_breaks(name: str) -> None:
    kiln.reset()
    kiln.counters.reset()
    torch.manual_seed(1)
    fn = _branching(UNDECIDED[name])
    compiled = kiln.compile(fn)
    for _ in range(4):
        x = torch.randn(5)
        out = compiled(x)  # (eager's branch, whichever the draw took)
        assert torch.allclose(out, x.sin() * 2) or torch.allclose(out, x.sin() - 1)
    reasons = [record.reason for record in kiln.counters.graph_breaks]
    assert reasons == [kiln.BreakReason.DATA_DEPENDENT]


def test_bool_of_several_decided_elements_still_raises_as_eager_does() -> None:
    fn = _branching(lambda: torch.rand(3) < 0.0)
    with pytest.raises(RuntimeError, match="ambiguous"):
        fn(torch.randn(2))
    with pytest.raises(RuntimeError, match="ambiguous"):
        kiln.compile(fn)(torch.randn(2))
