"""Which input sizes a capture keeps symbolic, and the guard that checks symbolic sizes.

The policy is torch.compile's *automatic dynamic shapes*: the first capture of a code object is
static. When a later call of it has an input whose size changed in some dim, that dim is
symbolic from the recapture on (the reason says which sizes made it so). ``dynamic=True`` makes
every dim of every input tensor symbolic from the first call, ``dynamic=False`` none.
``kiln.mark_dynamic(t, dim, min, max)`` and ``kiln.mark_static(t, dim)`` decide per tensor.
Sizes 0 and 1 are always specialized; parameters and buffers are always static.

:class:`SizeGuard` binds each symbol from the first input dim it was read from, checks every
other dim it stands for against it, checks the range every symbol was assumed to be in, and
then the relations capture decided on (``s0 - 1024 < 0``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.capture.guards.guards import Guard
from kiln.capture.guards.sources import Binder, Source
from kiln.ir.symbolic import Relation, ShapeEnv, Sym


def mark_dynamic(
    tensor: torch.Tensor, dim: int | Sequence[int], min: int | None = None, max: int | None = None
) -> None:
    """Compile ``tensor``'s ``dim`` (or dims) as symbolic from its first call, for sizes in
    ``[min, max]`` (a call outside the range recompiles). Sizes 0 and 1 stay specialized."""
    dims = [dim] if isinstance(dim, int) else list(dim)
    if min is not None and max is not None and min > max:
        raise ValueError(f"mark_dynamic: min={min} is above max={max}")
    marked = dict(getattr(tensor, "_kiln_dynamic", {}))
    for d in dims:
        marked[_dim(tensor, d, "mark_dynamic")] = (min, max)
    tensor._kiln_dynamic = marked  # type: ignore[attr-defined]


def mark_static(tensor: torch.Tensor, dim: int | Sequence[int]) -> None:
    """Keep ``tensor``'s ``dim`` (or dims) static, even with ``dynamic=True``."""
    dims = [dim] if isinstance(dim, int) else list(dim)
    static = set(getattr(tensor, "_kiln_static", ()))
    static.update(_dim(tensor, d, "mark_static") for d in dims)
    tensor._kiln_static = static  # type: ignore[attr-defined]


def _dim(tensor: torch.Tensor, dim: int, api: str) -> int:
    if not -tensor.dim() <= dim < tensor.dim():
        raise IndexError(f"{api}: dim {dim} out of range for a tensor of {tensor.dim()} dims")
    return dim % tensor.dim()


@dataclass(frozen=True)
class DimChoice:
    """Why one dim is symbolic, and the range the user declared for it."""

    reason: str
    low: int = 2
    high: int | None = None


@dataclass
class SizePolicy:
    """The automatic-dynamic state of one code object's cache."""

    dynamic: bool | None = None
    seen: dict[str, tuple[int, ...]] = field(default_factory=dict)  # sizes at first capture
    automatic: dict[str, dict[int, str]] = field(default_factory=dict)

    def choose(self, source: str, tensor: torch.Tensor) -> dict[int, DimChoice]:
        """The dims of the input ``tensor`` read through ``source`` to keep symbolic."""
        sizes = tuple(tensor.shape)
        static = set(getattr(tensor, "_kiln_static", ()))
        marked: dict[int, tuple[int | None, int | None]] = getattr(tensor, "_kiln_dynamic", {})
        if self.dynamic is False:
            return {}
        chosen: dict[int, DimChoice] = {}
        if self.dynamic:
            for dim in range(len(sizes)):
                chosen[dim] = DimChoice("dynamic=True")
        previous = self.seen.setdefault(source, sizes)
        if len(previous) == len(sizes):
            changed = self.automatic.setdefault(source, {}) if previous != sizes else {}
            for dim, (before, now) in enumerate(zip(previous, sizes, strict=True)):
                if before != now and dim not in changed:
                    changed[dim] = f"size changed from {before} to {now} (a recompile)"
        for dim, reason in self.automatic.get(source, {}).items():
            chosen.setdefault(dim, DimChoice(reason))
        for dim, (low, high) in marked.items():
            chosen[dim] = DimChoice("kiln.mark_dynamic", max(low or 2, 2), high)
            if high is not None and not low_ok(sizes[dim], low, high):
                chosen.pop(dim)  # (outside the declared range: this call is static there)
        return {
            dim: choice
            for dim, choice in chosen.items()
            if dim not in static and dim < len(sizes) and sizes[dim] >= 2
        }


def low_ok(size: int, low: int | None, high: int | None) -> bool:
    return (low is None or size >= low) and (high is None or size <= high)


@dataclass(frozen=True)
class SizeGuard(Guard):
    """The symbolic sizes of one capture: bindings, ranges and decided relations."""

    bindings: tuple[tuple[str, tuple[tuple[Source, int], ...], int, int | None], ...] = ()
    relations: tuple[Relation, ...] = ()

    rank = 4

    @staticmethod
    def of(env: ShapeEnv) -> SizeGuard | None:
        if not env.symbols:
            return None
        bindings = []
        for name, sym in env.symbols.items():
            ((monomial, _),) = sym.terms
            symbol = monomial[0]
            places = tuple(dict.fromkeys(env.sources[name]))
            bindings.append((name, places, symbol.low, symbol.high))  # type: ignore[union-attr]
        return SizeGuard(None, "symbolic sizes", tuple(bindings), tuple(env.relations))

    def check(self, binder: Binder) -> str:
        names = {name: binder.fresh(name) for name, *_ in self.bindings}
        parts: list[str] = []
        for name, places, low, high in self.bindings:
            (first, dim), *others = places
            local = names[name]
            parts.append(f"({local} := {first.expr(binder)}.size({dim})) >= {low}")
            if high is not None:
                parts.append(f"{local} <= {high}")
            parts += [f"{source.expr(binder)}.size({d}) == {local}" for source, d in others]
        for relation in self.relations:
            parts.append(relation.text(lambda symbol: names[symbol.name]))
        return " and ".join(parts) or "True"

    def reads(self, binder: Binder) -> str:
        """Every size the guard reads, in binding order (for :meth:`mismatch`, on a miss)."""
        sizes = [
            f"{source.expr(binder)}.size({dim})"
            for _, places, _, _ in self.bindings
            for source, dim in places
        ]
        return "(" + "".join(f"{size}, " for size in sizes) + ")"

    def mismatch(self, sizes: Sequence[int]) -> str:
        """The first check that fails for these sizes, naming the dim."""
        read = iter(sizes)
        values: dict[str, int] = {}
        for name, places, low, high in self.bindings:
            (source, dim), *others = places
            value = values[name] = next(read)
            if value < low or (high is not None and value > high):
                bound = f"{low} <= {name}" + (f" <= {high}" if high is not None else "")
                return f"{source}.size({dim}) is {value}, outside {bound} ({name})"
            for other, other_dim in others:
                size = next(read)
                if size != value:
                    return (
                        f"{other}.size({other_dim}) is {size}, not {source}.size({dim}) = {value}"
                    )
        for relation in self.relations:
            if not relation.holds(values):
                return f"{relation.text()} fails for {values}"
        return self.describe()

    def describe(self) -> str:
        lines = []
        for name, places, low, high in self.bindings:
            where = places_text(places)
            bound = f"{low} <= {name}" + (f" <= {high}" if high is not None else "")
            lines.append(f"{name} = {where} ({bound})")
        lines += [relation.text() for relation in self.relations]
        return "sizes: " + "; ".join(lines)


def places_text(places: Sequence[tuple[Any, int]]) -> str:
    """Where a symbol is read: the first place, and how many others must equal it."""
    (source, dim), *others = places
    more = f" (== {len(others)} other dim{'s' * (len(others) > 1)})" if others else ""
    return f"{source}.size({dim}){more}"


def size_expression(value: Sym, env: ShapeEnv, tensor_expression: Any) -> str:
    """Python source computing ``value`` on a call: each symbol read off the input it was
    bound from (``tensor_expression(source)`` gives that tensor's expression)."""

    def name_of(symbol: Any) -> str:
        source, dim = env.sources[symbol.name][0]
        return f"{tensor_expression(source)}.size({dim})"

    return f"({value.format(name_of)})"
