"""Random state the user controls is honoured: a ``torch.Generator`` (made in the program or
passed in) draws its own numbers through PyTorch, and global seeding runs in program order.

Kiln's own random ops draw from a Philox stream of the graph's seed, which differs from eager's
(see RESULTS.md); a generator or ``torch.manual_seed`` is the user asking for eager's numbers,
so those calls break the graph and run natively.
"""

from __future__ import annotations

import torch

import kiln

CALL = kiln.BreakReason.UNSUPPORTED_CALL


def _seeded_in_frame(x: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return x + torch.randn(4, generator=g) * torch.rand(4, generator=g)


def _generator_argument(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    noise = torch.rand(x.shape, generator=g)
    return x * noise + torch.empty(4).normal_(generator=g)


def test_generator_made_in_the_program_matches_eager() -> None:
    kiln.reset()
    compiled = kiln.compile(_seeded_in_frame)
    for _ in range(3):
        x = torch.randn(4)
        torch.testing.assert_close(compiled(x), _seeded_in_frame(x))
    assert kiln.counters.fallbacks == []
    assert {r.reason for r in kiln.counters.graph_breaks} == {CALL}


def test_generator_argument_draws_and_advances_as_eager() -> None:
    kiln.reset()
    compiled = kiln.compile(_generator_argument)
    for seed in (1, 2, 1):
        x = torch.randn(4)
        mine, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        torch.testing.assert_close(compiled(x, mine), _generator_argument(x, theirs))
        assert torch.equal(mine.get_state(), theirs.get_state())
        # the same generator again: its state moved on, and so do the numbers
        torch.testing.assert_close(compiled(x, mine), _generator_argument(x, theirs))
    assert kiln.counters.fallbacks == []


def test_manual_seed_inside_the_program_runs_in_order() -> None:
    """Seeding then drawing from torch's global generator natively gives eager's numbers."""

    def program(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        torch.manual_seed(5)
        return y + torch.randn(4, generator=torch.default_generator)

    kiln.reset()
    compiled = kiln.compile(program)
    for _ in range(2):
        x = torch.randn(4)
        torch.testing.assert_close(compiled(x), program(x))
    assert kiln.counters.fallbacks == []


def test_random_values_of_a_constant_are_drawn_every_call() -> None:
    """``torch.empty(n).uniform_()`` must not be drawn once while capturing and replayed."""

    def program(x: torch.Tensor) -> torch.Tensor:
        return x + torch.empty(1000).uniform_()

    kiln.reset()
    compiled = kiln.compile(program)
    x = torch.zeros(1000)
    first, second = compiled(x), compiled(x)
    assert not torch.equal(first, second)
    assert 0.4 < float(first.mean()) < 0.6
