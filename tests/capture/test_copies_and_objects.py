"""Objects user code copies or constructs inside a compiled function.

``copy.deepcopy(config)`` (transformers does it when building a cache) copies natively; what
the copy says was read from the original, so the original's state at the call is guarded and a
changed config recompiles. Parameter-free ``torch.nn`` modules made in a forward
(``CrossEntropyLoss(ignore_index=-100)``) are constructed natively and re-created after the
graph. Neither may make the frame run uncompiled.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any

import torch
from torch import nn

import kiln


@dataclasses.dataclass
class Config:
    scale: float = 2.0
    layers: int = 2
    names: list[str] = dataclasses.field(default_factory=lambda: ["a", "b"])


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = Config()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        settings = copy.deepcopy(self.config)
        settings.layers += 1  # the copy is the program's own: the original must not change
        for _ in range(settings.layers):
            x = self.lin(x) * settings.scale
        return x


def test_deepcopy_of_a_config_follows_the_original() -> None:
    kiln.reset()
    eager = Scaled()
    mine = copy.deepcopy(eager)
    compiled = kiln.compile(mine)
    for scale in (2.0, 2.0, 0.5):
        eager.config.scale = mine.config.scale = scale
        x = torch.randn(3, 4)
        torch.testing.assert_close(compiled(x), eager(x))
        assert mine.config == eager.config
    assert kiln.counters.fallbacks == []
    assert kiln.counters.graph_breaks == []
    assert kiln.counters.captures == 2  # the changed scale recompiled once


def test_deepcopy_of_a_dict_and_shallow_copy_of_a_list() -> None:
    def program(x: torch.Tensor, options: dict[str, Any], items: list[torch.Tensor]) -> Any:
        settings = copy.deepcopy(options)
        settings["offset"] = settings["offset"] + 1
        more = copy.copy(items)
        more.append(x)
        return sum(more) + settings["offset"], options

    kiln.reset()
    compiled = kiln.compile(program)
    for offset in (1.0, 1.0, 3.0):
        x, items = torch.randn(3), [torch.randn(3), torch.randn(3)]
        actual, returned = compiled(x, {"offset": offset}, items)
        expected, _ = program(x, {"offset": offset}, items)
        torch.testing.assert_close(actual, expected)
        assert returned == {"offset": offset} and len(items) == 2
    assert kiln.counters.fallbacks == []


def test_parameter_free_modules_constructed_in_forward() -> None:
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 5)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            loss = nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=0.1)
            return loss(self.head(x), labels) + nn.GELU()(x).sum()

    kiln.reset()
    eager = WithLoss()
    mine = copy.deepcopy(eager)
    compiled = kiln.compile(mine)
    for batch in (3, 3, 6):
        x, labels = torch.randn(batch, 4), torch.randint(0, 5, (batch,))
        labels[0] = -100
        expected, actual = eager(x, labels), compiled(x, labels)
        torch.testing.assert_close(actual, expected)
        expected.backward()
        actual.backward()
        for p, q in zip(eager.parameters(), mine.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad)
            p.grad = q.grad = None
    assert kiln.counters.fallbacks == []
    assert kiln.counters.graph_breaks == []


def test_module_with_weights_constructed_in_forward_breaks() -> None:
    """A Linear made per call has new random weights each time: never captured once."""

    def program(x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)
        return nn.Linear(4, 2)(x * 2)

    kiln.reset()
    compiled = kiln.compile(program)
    for _ in range(2):
        x = torch.randn(3, 4)
        torch.testing.assert_close(compiled(x), program(x))
    assert kiln.counters.fallbacks == []


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def test_comprehension_in_a_frame_that_runs_routed() -> None:
    """A break in a loop runs the frame as its original code with calls routed through
    compiled wrappers; a comprehension there (its own code object on 3.11) is compiled with
    those routed calls in it, which capture follows to the callee."""

    def program(x: torch.Tensor, scores: dict[str, torch.Tensor]) -> Any:
        for i in range(2):
            kiln.graph_break()
            x = x + i
        return x, {name: _double(value) + 1 for name, value in scores.items()}

    kiln.reset()
    compiled = kiln.compile(program)
    for size in (3, 3, 5):
        x, scores = torch.randn(size), {"a": torch.randn(size), "b": torch.randn(size)}
        actual, expected = compiled(x, scores), program(x, scores)
        torch.testing.assert_close(actual, expected)
    skips = {record.reason for record in kiln.counters.fallbacks}
    expected = {kiln.SkipReason.BREAK_IN_LOOP}
    if sys.version_info < (3, 12):  # (3.12 inlines comprehensions: no frame of their own)
        expected.add(kiln.SkipReason.ITERATOR_ARGUMENT)
    assert skips == expected, kiln.counters.fallbacks
