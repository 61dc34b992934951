"""Iterating symbolic values: the items of containers, modules and tensors, with their sources.

Loops over Python values are unrolled during capture. When the container was read from outside
the frame, each item is read through :meth:`Session.wrap` with an ``Item`` source, so that a
tensor in an argument list becomes a graph input and a module in a ``ModuleList`` is guarded.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import torch

from kiln.capture.core.session import Session
from kiln.capture.guards.sources import Attr, Item

# At most this many items are materialized from an iterator of unknown length.
MAX_ITEMS = 100_000


class SymbolicIterator:
    """An iterator over items the capture already materialized (and wrapped)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.position = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.position >= len(self.items):
            raise StopIteration
        item = self.items[self.position]
        self.position += 1
        return item

    def __length_hint__(self) -> int:
        return len(self.items) - self.position


def module_items(session: Session, module: torch.nn.Module) -> list[Any] | None:
    """The submodules a container module iterates over, each guarded through its table
    (``_modules``, or ``_parameters`` of a ParameterList), whose keys are guarded too: a
    module appended after the call compiled must not be skipped."""
    source = session.source_of(module)
    if isinstance(module, torch.nn.ModuleDict | torch.nn.ParameterDict):
        name = "_modules" if isinstance(module, torch.nn.ModuleDict) else "_keys"
        if source is not None:
            session.guard_contents(session.wrap(getattr(module, name), Attr(source, name)))
        return list(module.keys())
    if isinstance(module, torch.nn.ModuleList | torch.nn.Sequential | torch.nn.ParameterList):
        name = "_parameters" if isinstance(module, torch.nn.ParameterList) else "_modules"
        items = list(getattr(module, name).items())
        if source is None:
            return [value for _, value in items]
        table = session.wrap(getattr(module, name), Attr(source, name))
        session.guard_contents(table)
        return [session.wrap(value, Item(Attr(source, name), key)) for key, value in items]
    return None


def items_of(session: Session, value: Any) -> list[Any] | None:
    """The items iterating ``value`` yields, or None when the capture cannot list them here
    (the caller then iterates natively or inlines ``__iter__``)."""
    if isinstance(value, SymbolicIterator):
        items = value.items[value.position :]
        value.position = len(value.items)
        return items
    source = session.source_of(value)
    if isinstance(value, list | tuple | collections.deque):
        if source is None or session.is_new(value):
            return list(value)
        session.guard_contents(value)
        return [session.wrap(item, Item(source, i)) for i, item in enumerate(value)]
    if isinstance(value, dict):
        session.guard_contents(value)
        return list(value)
    if isinstance(value, set | frozenset):
        session.guard_contents(value)
        return list(value)
    if isinstance(value, range | str | bytes):
        return list(value)
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    if isinstance(value, torch.nn.Module):
        return module_items(session, value)
    if type(value).__name__ in ("dict_keys", "dict_values", "dict_items", "odict_keys"):
        return list(value)
    return None


def collect(iterator: Iterator[Any]) -> list[Any]:
    """Exhaust a native iterator (bounded), e.g. ``zip`` of materialized lists."""
    items: list[Any] = []
    for item in iterator:
        items.append(item)
        if len(items) > MAX_ITEMS:
            raise ValueError("iterator too long to unroll")
    return items
