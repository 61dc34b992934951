"""Iterating values during capture: the items of a value, listed by ``items_of`` where capture
can, else by inlining Python ``__iter__``/``__next__`` or exhausting a native iterator.
"""

from __future__ import annotations

from typing import Any

from kiln.capture.calls.inline import inline
from kiln.capture.calls.native import no_opaque, python_dunder
from kiln.capture.core.frame import Frame
from kiln.capture.core.iteration import SymbolicIterator, collect, items_of
from kiln.capture.guards.sources import Item


def iterate(frame: Frame, value: Any) -> list[Any]:
    """The items of ``value`` when ``items_of`` cannot list them: Python ``__iter__`` is
    inlined; native iterators are exhausted natively."""
    items = items_of(frame.session, value)
    if items is not None:
        return items
    method = python_dunder(value, "__iter__")
    if method is not None:
        iterator = inline(frame, method, (value,), {})
        listed = items_of(frame.session, iterator)
        return listed if listed is not None else _exhaust(frame, iterator)
    if python_dunder(value, "__next__") is not None:
        return _exhaust(frame, value)
    try:
        iterator = iter(value)
    except TypeError:
        raise TypeError(f"'{type(value).__name__}' object is not iterable") from None
    return collect(iterator)


def _exhaust(frame: Frame, iterator: Any) -> list[Any]:
    step = python_dunder(iterator, "__next__")
    if step is None:
        return collect(iterator)
    items = []
    while True:
        try:
            items.append(inline(frame, step, (iterator,), {}))
        except StopIteration:
            return items


def dict_items(frame: Frame, mapping: Any) -> dict[Any, Any]:
    """A dict's items, each value read through its ``Item`` source when it has one."""
    session = frame.session
    source = session.source_of(mapping)
    if source is None or session.is_new(mapping):
        return dict(mapping)
    session.guard_contents(mapping)
    return {key: session.wrap(mapping[key], Item(source, key)) for key in mapping}


def item_list(frame: Frame, value: Any) -> list[Any]:
    """The items iterating ``value`` yields (unpacking, ``*args``, ``zip``...)."""
    items = items_of(frame.session, value)
    if items is None:
        items = iterate(frame, value)
    return items


def make_iterator(frame: Frame, value: Any) -> Any:
    """``iter(value)`` for capture: materialized items where the capture can list them."""
    if isinstance(value, SymbolicIterator):
        return value
    items = items_of(frame.session, value)
    if items is None:
        items = iterate(frame, no_opaque(frame, "iteration", value))
    return frame.session.new(SymbolicIterator(items))
