"""Errors and unusual devices at run time: an error raised inside a compiled graph's host
program names the step and the user's source line; tensors without data (``meta``) give
eager's meta results instead of reaching a kernel."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

import kiln


def _program(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    a = x.sin() + 1
    b = a @ y
    return b.relu().sum(0) * 2  # the line a failing allocation must name (not in place)


def test_an_error_in_the_host_program_names_the_user_line(monkeypatch: Any) -> None:
    """A simulated out-of-memory error keeps its type and gets a note with the kernel that
    allocated and the user line it computes."""
    real = torch.empty_strided
    armed = [False]

    def allocate(*args: Any, **kwargs: Any) -> torch.Tensor:
        if armed[0]:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty_strided", allocate)
    kiln.reset()
    compiled = kiln.compile(_program)
    x, y = torch.randn(3, 4), torch.randn(4, 5)
    torch.testing.assert_close(compiled(x, y), _program(x, y))
    armed[0] = True
    with pytest.raises(torch.OutOfMemoryError) as raised:
        compiled(x, y)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "kiln: raised by kernel" in notes
    lines, first = inspect.getsourcelines(_program)
    line = first + next(i for i, text in enumerate(lines) if "b.relu()" in text)
    assert f"test_kiln_errors.py:{line}" in notes, notes


def test_meta_tensors_give_meta_results() -> None:
    kiln.reset()
    compiled = kiln.compile(lambda x: (x * 2 + 1).sum(0))
    out = compiled(torch.empty(3, 4, device="meta"))
    assert out.device.type == "meta"
    assert out.shape == (4,)
    assert kiln.counters.fallbacks == []


def test_meta_module_trains_to_meta_gradients() -> None:
    kiln.reset()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to("meta")
    out = kiln.compile(model)(torch.empty(3, 4, device="meta"))
    assert out.shape == (3, 2) and out.device.type == "meta"
    out.sum().backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert parameter.grad.shape == parameter.shape and parameter.grad.device.type == "meta"
