"""Sample-call factories for elementwise translations (math, activations, conversions).

One factory per calling shape, so every op gets the same coverage: equal shapes, broadcasting on
both sides, 0-size and 0-d tensors, Python scalars, a second dtype (promotion), keyword variants::

    samples=binary_calls(rhs=Span(nonzero=True), kwargs=lambda dtype: [{"rounding_mode": "floor"}])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.ops.sampling import make_tensor
from kiln.ops.translations.table import Call, CallFn

KwargsFn = Callable[[torch.dtype], Sequence[dict[str, Any]]]

UNARY_SHAPES: tuple[tuple[int, ...], ...] = ((3, 5), (), (0, 4), (2, 1, 3))
# (lhs, rhs) shapes: equal, both sides broadcast, 0-size, 0-d, tensor with a 0-d tensor.
BINARY_SHAPES: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((3, 4), (3, 4)),
    ((2, 1, 3), (4, 3)),
    ((0, 4), (4,)),
    ((), ()),
    ((3, 4), ()),
)
# In-place: the first argument already has the broadcast shape.
INPLACE_SHAPES: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((3, 4), (3, 4)),
    ((2, 3, 4), (3, 1)),
    ((0, 4), (4,)),
    ((), ()),
)
# A second dtype of the same kind, to exercise promotion (f16 + bf16 -> f32, i32 + i64 -> i64).
_PARTNER = {
    torch.float32: torch.float16,
    torch.float16: torch.bfloat16,
    torch.bfloat16: torch.float32,
    torch.int32: torch.int64,
    torch.int64: torch.int32,
    torch.bool: torch.int32,
}
# A second dtype the result can be cast back into, for in-place ops.
_INPLACE_PARTNER = {
    torch.float32: torch.int64,
    torch.float16: torch.int64,
    torch.bfloat16: torch.int64,
    torch.int32: torch.int64,
    torch.int64: torch.int32,
}


@dataclass(frozen=True)
class Span:
    """The values a sample operand takes: uniform in [low, high), optionally never zero."""

    low: float | None = None
    high: float | None = None
    nonzero: bool = False

    def tensor(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        low, high = self.low, self.high
        if self.nonzero and low is None and dtype.is_floating_point:
            low = 0.1  # keeps a float divisor (and reduced-precision quotients) away from zero
        if not dtype.is_floating_point and low is not None and high is not None:
            low, high = math.floor(low), max(math.ceil(high), math.floor(low) + 1)
        return make_tensor(shape, dtype, device, low=low, high=high, nonzero=self.nonzero)

    def scalar(self, dtype: torch.dtype, floating: bool = False) -> bool | int | float:
        """A Python scalar in the span; an int for an integer ``dtype`` unless ``floating``."""
        if dtype == torch.bool and not floating:
            return True
        value: float = 1.5 if floating or dtype.is_floating_point else 3
        if self.high is not None and value >= self.high:
            value = ((self.low or 0) + self.high) / 2
        if self.low is not None and value < self.low:
            value = self.low
        return value if floating or dtype.is_floating_point else int(value)


ANYWHERE = Span()


def _variants(kwargs: KwargsFn | None, dtype: torch.dtype) -> list[dict[str, Any]]:
    return [{}, *(kwargs(dtype) if kwargs is not None else ())]


def unary_calls(span: Span = ANYWHERE, kwargs: KwargsFn | None = None) -> CallFn:
    """``f(x)`` on every shape of :data:`UNARY_SHAPES`, then ``f(x, **kw)`` per keyword variant."""

    def samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
        calls = [Call((span.tensor(shape, dtype, device),)) for shape in UNARY_SHAPES]
        for extra in _variants(kwargs, dtype)[1:]:
            calls.append(Call((span.tensor((3, 4), dtype, device),), extra, note=str(extra)))
        return calls

    return samples


def binary_calls(
    lhs: Span = ANYWHERE,
    rhs: Span = ANYWHERE,
    *,
    scalar: bool = True,
    float_scalar: bool = False,
    partners: frozenset[torch.dtype] = frozenset(),
    kwargs: KwargsFn | None = None,
) -> CallFn:
    """``f(x, y)``: tensors of :data:`BINARY_SHAPES`, a Python scalar ``y`` (and a float scalar for
    integer tensors when ``float_scalar``), a ``y`` of a second dtype among ``partners`` (also
    0-d), and every keyword variant of ``kwargs(dtype)``."""

    def samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
        def pair(
            a: tuple[int, ...], b: tuple[int, ...], other: torch.dtype = dtype
        ) -> tuple[Any, ...]:
            return lhs.tensor(a, dtype, device), rhs.tensor(b, other, device)

        calls = [Call(pair(a, b)) for a, b in BINARY_SHAPES]
        if scalar:
            calls.append(
                Call((lhs.tensor((4, 3), dtype, device), rhs.scalar(dtype)), note="scalar")
            )
        if float_scalar and not dtype.is_floating_point:
            floating = rhs.scalar(dtype, floating=True)
            calls.append(Call((lhs.tensor((4, 3), dtype, device), floating), note="float scalar"))
        partner = _PARTNER.get(dtype)
        if partner in partners:
            calls.append(Call(pair((3, 4), (4,), partner), note=f"with {partner}"))
            calls.append(Call(pair((3, 4), (), partner), note=f"with 0-d {partner}"))
        for extra in _variants(kwargs, dtype)[1:]:
            calls.append(Call(pair((2, 3, 4), (3, 1)), extra, note=str(extra)))
            if scalar:
                args = (lhs.tensor((5,), dtype, device), rhs.scalar(dtype))
                calls.append(Call(args, extra, note=f"scalar {extra}"))
        return calls

    return samples


def inplace_calls(
    rhs: Span = ANYWHERE,
    *,
    scalar: bool = True,
    partner: bool = True,
    kwargs: KwargsFn | None = None,
) -> CallFn:
    """``x.f_(y)``: ``y`` broadcast to ``x``'s shape, a Python scalar, a second dtype whose
    promotion still casts back into ``x`` (when ``partner``), and keyword variants."""

    def samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
        def pair(
            a: tuple[int, ...], b: tuple[int, ...], other: torch.dtype = dtype
        ) -> tuple[Any, ...]:
            return make_tensor(a, dtype, device), rhs.tensor(b, other, device)

        calls = [Call(pair(a, b)) for a, b in INPLACE_SHAPES]
        if scalar:
            calls.append(
                Call((make_tensor((4, 3), dtype, device), rhs.scalar(dtype)), note="scalar")
            )
        other = _INPLACE_PARTNER.get(dtype)
        if partner and other is not None:
            calls.append(Call(pair((3, 4), (4,), other), note=f"with {other}"))
        for extra in _variants(kwargs, dtype)[1:]:
            calls.append(Call(pair((2, 3, 4), (3, 1)), extra, note=str(extra)))
        return calls

    return samples


def concat_calls(*factories: CallFn) -> CallFn:
    """One ``samples=`` function running several factories."""

    def samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
        return [call for factory in factories for call in factory(dtype, device)]

    return samples
