"""Builtins that call a dunder method of their argument (``float(obj)``, ``int``, ``bool``,
``str``, ``round``, ...) inline a Python dunder, so the state it reads is guarded: changing
that state recompiles instead of replaying the value captured the first time. Immutable value
types from the standard library (``Fraction``, ``Decimal``) are constants guarded by value."""

from __future__ import annotations

import decimal
import fractions
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kiln


class Knob:
    """A user object whose conversions read mutable state."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __float__(self) -> float:
        return self.value

    def __int__(self) -> int:
        return int(self.value * 10)

    def __index__(self) -> int:
        return int(self.value * 10)

    def __bool__(self) -> bool:
        return self.value > 0.3

    def __abs__(self) -> float:
        return abs(self.value) + 1

    def __round__(self, digits: int = 0) -> float:
        return round(self.value * 3, digits)

    def __str__(self) -> str:
        return f"knob{self.value}"

    def __hash__(self) -> int:
        return int(self.value * 100)


KNOB = Knob(0.5)
FRACTION = fractions.Fraction(1, 2)
DECIMAL = decimal.Decimal("0.5")

PROGRAMS: dict[str, Callable[[torch.Tensor], Any]] = {
    "float": lambda x: x * float(KNOB),
    "int": lambda x: x + int(KNOB),
    "complex": lambda x: x * complex(KNOB).real,
    "bool": lambda x: x * 2 if bool(KNOB) else x - 1,
    "abs": lambda x: x * abs(KNOB),
    "round": lambda x: x + round(KNOB, 1),
    "str": lambda x: x * len(str(KNOB)),
    "hash": lambda x: x + hash(KNOB),
    "fraction": lambda x: x * float(FRACTION),
    "decimal": lambda x: x * float(DECIMAL),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_conversion_follows_the_objects_state(name: str) -> None:
    global KNOB, FRACTION, DECIMAL
    kiln.reset()
    program = PROGRAMS[name]
    compiled = kiln.compile(program)
    x = torch.randn(5)
    saved = KNOB, FRACTION, DECIMAL
    try:
        for step in range(3):
            torch.testing.assert_close(compiled(x), program(x))
            # change what the conversion reads: in place, then by rebinding the global
            if step == 0:
                KNOB.value = 0.25
            else:
                KNOB = Knob(0.75)
            FRACTION = fractions.Fraction(1, 3 + step)
            DECIMAL = decimal.Decimal("0.25") * (step + 1)
            x = torch.randn(5)
        assert kiln.counters.fallbacks == []
    finally:
        KNOB, FRACTION, DECIMAL = saved
        KNOB.value = 0.5
