"""Builtins and operators that call a dunder method of their operands (``float(obj)``,
``int``, ``bool``, ``str``, ``round``, ``obj * 3``, ``3 * obj``, ``a < b``, ``-obj``,
``if obj:``, ``x in obj``, ``operator.mul``, ``max``, ``pow``) inline a Python dunder of a user
class, so the state it reads is guarded: changing that state recompiles instead of replaying
the value captured the first time. Immutable value types from the standard library
(``Fraction``, ``Decimal``) are constants guarded by value."""

from __future__ import annotations

import decimal
import fractions
import operator
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

    def __format__(self, spec: str) -> str:
        return f"k{self.value:{spec}}"

    def __hash__(self) -> int:
        return int(self.value * 100)

    def __mul__(self, other: float) -> float:
        return self.value * other

    def __rmul__(self, other: float) -> float:
        return other * self.value + 1

    def __add__(self, other: float) -> Knob:
        return Knob(self.value + other)

    def __lt__(self, other: Knob) -> bool:
        return self.value < other.value

    def __gt__(self, other: Knob) -> bool:
        return self.value > other.value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Knob) and self.value == other.value

    def __neg__(self) -> float:
        return -2 * self.value

    def __contains__(self, item: float) -> bool:
        return item < self.value

    def __pow__(self, other: float) -> float:
        return self.value**other


KNOB = Knob(0.5)
OTHER = Knob(0.6)
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
    "f-string": lambda x: x * len(f"{KNOB}|{KNOB:.3f}"),
    "hash": lambda x: x + hash(KNOB),
    "fraction": lambda x: x * float(FRACTION),
    "binary": lambda x: x * (KNOB * 3),
    "reflected": lambda x: x * (3 * KNOB),
    "inplace falls back": lambda x: x * _inplace(KNOB).value,
    "less": lambda x: x * 2 if KNOB < OTHER else x,
    "equal": lambda x: x * 2 if KNOB == OTHER else x,
    "not equal": lambda x: x * 2 if KNOB != OTHER else x,
    "negative": lambda x: x * -KNOB,
    "truth": lambda x: x * 2 if KNOB else x,
    "contains": lambda x: x * 2 if 0.4 in KNOB else x,
    "operator.mul": lambda x: x * operator.mul(KNOB, 2),
    "max": lambda x: x * max(KNOB, OTHER).value,
    "pow": lambda x: x * pow(KNOB, 2),
    "decimal": lambda x: x * float(DECIMAL),
}


def _inplace(knob: Knob) -> Knob:
    knob += 0.5  # no __iadd__: knob = knob + 0.5, a new object
    return knob


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_conversion_follows_the_objects_state(name: str) -> None:
    global KNOB, FRACTION, DECIMAL
    kiln.reset()
    program = PROGRAMS[name]
    compiled = kiln.compile(program)
    x = torch.randn(5)
    saved = KNOB, FRACTION, DECIMAL
    assert program(x).shape == x.shape
    try:
        for step in range(3):
            torch.testing.assert_close(compiled(x), program(x))
            # change what the conversion reads: in place, then by rebinding the global
            if step == 0:
                KNOB.value = 0.25
            else:
                KNOB = Knob(0.75 if step == 1 else 0.6)
            FRACTION = fractions.Fraction(1, 3 + step)
            DECIMAL = decimal.Decimal("0.25") * (step + 1)
            x = torch.randn(5)
        assert kiln.counters.fallbacks == []
    finally:
        KNOB, FRACTION, DECIMAL = saved
        KNOB.value = 0.5
