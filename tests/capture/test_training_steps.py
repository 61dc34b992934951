"""A whole training step compiled: forward, ``zero_grad``, ``backward`` (a graph break),
gradient clipping and the optimizer's step, called again and again, against the same step in
eager. Each of these once went silently wrong: ``zero_grad`` ran natively during capture, saw
no gradients, and was never replayed (gradients then accumulated over steps); clipping with
``model.parameters()`` computed its total norm from a stack whose last piece's reduction was
masked to one element."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln

CLIPS: dict[str, Callable[[nn.Module], Any]] = {
    "none": lambda model: None,
    "norm": lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3),
    "value": lambda model: torch.nn.utils.clip_grad_value_(model.parameters(), 0.01),
}
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
}


def _setup(optimizer: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, OPTIMIZERS[optimizer](model.parameters())


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, clip: str, x: Any, y: Any) -> Any:
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    CLIPS[clip](model)
    optimizer.step()
    return loss


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_compiled_training_steps_match_eager(clip: str, optimizer: str) -> None:
    kiln.reset()
    eager_model, eager_optimizer = _setup(optimizer)
    model, compiled_optimizer = _setup(optimizer)
    compiled = kiln.compile(_step)
    for step in range(4):
        x, y = torch.randn(5, 8), torch.randn(5, 4)
        expected = _step(eager_model, eager_optimizer, clip, x, y)
        torch.testing.assert_close(compiled(model, compiled_optimizer, clip, x, y), expected)
        pairs = zip(eager_model.named_parameters(), model.parameters(), strict=True)
        for (name, want), got in pairs:
            torch.testing.assert_close(got, want, msg=f"step {step}: {name}")
            torch.testing.assert_close(got.grad, want.grad, msg=f"step {step}: {name}.grad")
    assert kiln.counters.graphs >= 1  # (the forward at least: not a whole-frame fallback)
    assert not [r for r in kiln.counters.fallbacks if r.reason.name == "INTERNAL_ERROR"]


def test_zero_grad_after_a_forward_is_replayed_every_call() -> None:
    """The first call has no gradients yet: zero_grad inside the captured code must still run
    on later calls (it breaks the graph: torch's own code reading .grad runs natively)."""
    kiln.reset()
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def forward_then_zero(x: torch.Tensor) -> torch.Tensor:
        out = model(x).sum()
        optimizer.zero_grad()
        return out

    compiled = kiln.compile(forward_then_zero)
    for _ in range(3):
        compiled(torch.randn(4, 3))
        assert all(p.grad is None for p in model.parameters())
        for p in model.parameters():
            p.grad = torch.ones_like(p)


def test_an_iterator_inside_varargs_is_not_used_up_by_capture() -> None:
    """clip_grad_norm_ (behind a ``*args`` decorator) given ``model.parameters()``: capture must
    not consume the generator the call needs."""
    kiln.reset()
    eager_model, model = _setup("sgd")[0], _setup("sgd")[0]
    compiled = kiln.compile(torch.nn.utils.clip_grad_norm_)
    for _ in range(3):
        for want, got in zip(eager_model.parameters(), model.parameters(), strict=True):
            want.grad = torch.randn_like(want)
            got.grad = want.grad.clone()
        expected = torch.nn.utils.clip_grad_norm_(eager_model.parameters(), 0.3)
        torch.testing.assert_close(compiled(model.parameters(), 0.3), expected)
        for want, got in zip(eager_model.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("codegen", ["cpp", "triton", "evaluate"])
def test_a_stack_of_reductions_as_long_as_a_row(codegen: str) -> None:
    """``torch.stack([a.norm(), b.norm(), c.norm(), d.norm()])`` with ``d`` of 4 elements: the
    last norm shared the stack's kernel, whose position along the stack masked d's reads, so
    the norm saw one element (clip_grad_norm_'s total norm of a 4-parameter model)."""
    kiln.reset()
    options = {"codegen": codegen}

    def norms(a: Any, b: Any, c: Any, d: Any) -> torch.Tensor:
        return torch.stack([a.norm(), b.norm(), c.norm(), d.norm()])

    tensors = [torch.randn(16, 8), torch.randn(16), torch.randn(4, 16), torch.randn(4)]
    torch.testing.assert_close(kiln.compile(norms, options=options)(*tensors), norms(*tensors))
    sums = [torch.randn(3, 5), torch.randn(5)]
    stacked = kiln.compile(lambda p, q: torch.cat([p.sum(0), q.softmax(0)]), options=options)
    torch.testing.assert_close(stacked(*sums), torch.cat([sums[0].sum(0), sums[1].softmax(0)]))


def test_foreach_in_place_updates_of_parameters_run() -> None:
    """An EMA with ``torch._foreach_mul_``/``_foreach_add_`` on parameters: the in-place foreach
    ops (whose writes FakeTensors do not count) were an extern node nobody used, dropped, so
    the averages never moved. They break the graph and run natively."""
    kiln.reset()
    torch.manual_seed(0)
    model, average, expected = nn.Linear(3, 2), nn.Linear(3, 2), nn.Linear(3, 2)
    expected.load_state_dict(average.state_dict())

    def step(x: torch.Tensor) -> torch.Tensor:
        out = model(x).sum()
        with torch.no_grad():
            torch._foreach_mul_(list(average.parameters()), 0.5)
            torch._foreach_add_(list(average.parameters()), list(model.parameters()), alpha=0.5)
        return out

    compiled = kiln.compile(step)
    for _ in range(3):
        compiled(torch.randn(4, 3))
        with torch.no_grad():
            for want, source in zip(expected.parameters(), model.parameters(), strict=True):
                want.mul_(0.5).add_(source, alpha=0.5)
        for want, got in zip(expected.parameters(), average.parameters(), strict=True):
            torch.testing.assert_close(got, want)
    assert kiln.counters.graphs >= 1 and not kiln.counters.fallbacks
