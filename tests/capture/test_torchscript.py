"""TorchScript inside compiled code: a scripted function is followed through the Python
function it was made from (older transformers script DeBERTa's relative positions); a scripted
module keeps no Python forward, so its call is a graph break that runs it natively."""

from __future__ import annotations

import torch
from torch import nn

import kiln


@torch.jit.script
def _relative_positions(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(query.size(-2), dtype=torch.long, device=query.device)
    columns = torch.arange(key.size(-2), dtype=torch.long, device=key.device)
    return (rows[:, None] - columns.view(1, -1)).unsqueeze(0)


def test_scripted_function_is_captured_through_its_python_source() -> None:
    def program(x: torch.Tensor) -> torch.Tensor:
        positions = _relative_positions(x, x).to(x.dtype)
        return (x.sum(-1, keepdim=True) * positions).softmax(-1)

    kiln.reset()
    compiled = kiln.compile(program)
    for length in (3, 3, 5):
        x = torch.randn(2, length, 4, requires_grad=True)
        result, expected = compiled(x), program(x)
        torch.testing.assert_close(result, expected)
        cotangent = torch.randn_like(expected)
        torch.testing.assert_close(
            torch.autograd.grad(result, x, cotangent), torch.autograd.grad(expected, x, cotangent)
        )
    assert not kiln.counters.fallbacks and not kiln.counters.graph_breaks
    assert kiln.counters.graphs == 2  # (one per length)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * 2


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = torch.jit.script(_Block())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x) + 1)


def test_scripted_module_breaks_and_trains_like_eager() -> None:
    kiln.reset()
    model = _Model()
    compiled = kiln.compile(model)
    parameters = list(model.parameters())
    for rows in (3, 3, 5):
        x = torch.randn(rows, 4, requires_grad=True)
        result, expected = compiled(x), model(x)
        torch.testing.assert_close(result, expected)
        got = torch.autograd.grad(result.square().sum(), [x, *parameters])
        want = torch.autograd.grad(expected.square().sum(), [x, *parameters])
        torch.testing.assert_close(got, want)
    assert not kiln.counters.fallbacks
    details = {record.detail for record in kiln.counters.graph_breaks}
    assert details == {"TorchScript module _Block"}
