"""Models of Python builtins whose native versions would hide work from capture.

A builtin that calls back into Python (``map``, ``sorted(key=)``, ``min(key=)``), iterates
(``zip``, ``enumerate``, ``list``), reads attributes (``getattr``, ``hasattr``) or needs a
tensor's data (``print``, ``str`` of a tensor) is modelled here; iteration is unrolled over
materialized items, callbacks are inlined. Pure builtins not listed run natively.
"""

from __future__ import annotations

import builtins
import copy
import functools
import itertools
import logging
import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch

from kiln.capture.calls.attributes import get_attribute, set_attribute, zero_arg_super
from kiln.capture.calls.dispatch import call_function
from kiln.capture.calls.iterate import dict_items, item_list, make_iterator
from kiln.capture.calls.native import holds_tensors, materialize, no_tensor, python_dunder
from kiln.capture.calls.operators import operate, plain, truth
from kiln.capture.calls.registry import MODELS, Model, model
from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.contexts import BackendFlags
from kiln.capture.core.frame import Frame
from kiln.capture.core.iteration import SymbolicIterator
from kiln.capture.core.session import Recipe, is_constant
from kiln.capture.guards.guards import Equals, HasAttr, Identity
from kiln.capture.guards.sources import Attr
from kiln.frontends.proxy import ProxyTensor


def _call(frame: Frame, fn: Any, *args: Any, **kwargs: Any) -> Any:
    return call_function(frame, fn, args, kwargs)


# --- I/O and explicit breaks ------------------------------------------------------------
def graph_break() -> None:
    """Mark a place where compiled code must end its graph (runs as a no-op otherwise)."""


@model(builtins.print, builtins.input, builtins.open)
def _io(frame: Frame, *args: Any, **kwargs: Any) -> Any:
    raise GraphBreak(BreakReason.IO, "print/input/open/logging")


@model(graph_break)
def _explicit(frame: Frame, *args: Any, **kwargs: Any) -> Any:
    raise GraphBreak(BreakReason.EXPLICIT, "kiln.graph_break()")


for _name in ("debug", "info", "warning", "error", "exception", "critical", "log"):
    MODELS[getattr(logging, _name)] = _io
    MODELS[getattr(logging.Logger, _name)] = _io
MODELS[warnings.warn] = _io


# --- backend flags ------------------------------------------------------------------------
def _backend_flags(flags: Any) -> Model:
    def make(frame: Frame, *args: Any, **kwargs: Any) -> Any:
        context = BackendFlags(flags, *args, **kwargs)
        return frame.session.new(context, Recipe(BackendFlags, (flags, *args), kwargs))

    return make


for _flags in (torch.backends.cudnn.flags, torch.backends.mkldnn.flags):
    MODELS[_flags] = _backend_flags(_flags)


# --- copy ---------------------------------------------------------------------------------


def _copy_of(frame: Frame, copier: Callable[[Any], Any], value: Any) -> Any:
    """``copy.copy``/``copy.deepcopy`` of a value without tensors (a model config): copied
    natively, re-created after the graph from its recipe; the original's state at the call
    is guarded, since what the copy says was read from it."""
    session = frame.session
    if is_constant(value):
        return value
    container = type(value) in (list, dict, set)
    if copier is copy.copy and container:
        return session.new(copy.copy(materialize(session, value)))
    if holds_tensors(value) or not (container or hasattr(value, "__dict__")):
        what = f"{copier.__name__} of a {type(value).__name__}"
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"{what} holding tensors or native state")
    source = session.source_of(value)
    if source is not None and not session.is_new(value):
        if container:
            effect = session.effects.get(("container", id(value)))
            entry = effect.snapshot if effect is not None else value
            session.add_guard(Equals(source, "contents copied", copy.deepcopy(entry)))
        else:
            state = copy.deepcopy(session.state_at_entry(value))
            session.add_guard(Equals(Attr(source, "__dict__"), "state copied", state))
    if container:  # rebuilt from its items after the graph, like any container the code made
        return session.new(copier(value))
    return session.new(copier(value), Recipe(copier, (value,), {}))


@model(copy.copy)
def _copy(frame: Frame, value: Any) -> Any:
    return _copy_of(frame, copy.copy, value)


@model(copy.deepcopy)
def _deepcopy(frame: Frame, value: Any, memo: Any = None) -> Any:
    if memo is not None:
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, "copy.deepcopy with a memo")
    return _copy_of(frame, copy.deepcopy, value)


# --- attribute builtins -----------------------------------------------------------------
_MISSING = object()


@model(builtins.getattr)
def _getattr(frame: Frame, obj: Any, name: str, default: Any = _MISSING) -> Any:
    try:
        return get_attribute(frame, obj, name)
    except AttributeError:
        if default is _MISSING:
            raise
        _guard_hasattr(frame, obj, name, present=False)
        return default


@model(builtins.hasattr)
def _hasattr(frame: Frame, obj: Any, name: str) -> bool:
    try:
        get_attribute(frame, obj, name)
    except AttributeError:
        _guard_hasattr(frame, obj, name, present=False)
        return False
    _guard_hasattr(frame, obj, name, present=True)
    return True


def _guard_hasattr(frame: Frame, obj: Any, name: str, *, present: bool) -> None:
    source = frame.session.source_of(obj)
    if source is not None and not frame.session.is_new(obj):
        frame.session.add_guard(HasAttr(source, "hasattr", name, present))


@model(builtins.setattr)
def _setattr(frame: Frame, obj: Any, name: str, value: Any) -> None:
    set_attribute(frame, obj, name, value)


@model(builtins.delattr)
def _delattr(frame: Frame, obj: Any, name: str) -> None:
    frame.session.set_attribute(obj, name, None, delete=True)


@model(builtins.super)
def _super(frame: Frame, *args: Any) -> Any:
    return zero_arg_super(frame) if not args else super(*args)


@model(builtins.type)
def _type(frame: Frame, *args: Any) -> Any:
    if len(args) != 1:
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, "type() with 3 arguments")
    value = args[0]
    if isinstance(value, ProxyTensor):
        return _proxy_type(frame, value)
    return type(value)


def _proxy_type(frame: Frame, proxy: Any) -> type:
    """An input's own type (e.g. ``Parameter``, guarded); computed tensors are Tensors."""
    kind = getattr(proxy, "_input_type", torch.Tensor)
    return kind if isinstance(kind, type) else torch.Tensor


# --- iteration --------------------------------------------------------------------------
@model(builtins.iter)
def _iter(frame: Frame, value: Any, *sentinel: Any) -> Any:
    if sentinel:
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, "iter(callable, sentinel)")
    return make_iterator(frame, value)


@model(builtins.next)
def _next(frame: Frame, iterator: Any, *default: Any) -> Any:
    step = python_dunder(iterator, "__next__")
    try:
        return _call(frame, step, iterator) if step is not None else next(iterator)
    except StopIteration:
        if default:
            return default[0]
        raise


def _new_iterator(frame: Frame, items: list[Any]) -> SymbolicIterator:
    return frame.session.new(SymbolicIterator(items))


@model(builtins.enumerate)
def _enumerate(frame: Frame, value: Any, start: int = 0) -> Any:
    items = item_list(frame, value)
    return _new_iterator(
        frame, [frame.session.new((start + i, item)) for i, item in enumerate(items)]
    )


@model(builtins.zip)
def _zip(frame: Frame, *values: Any, strict: bool = False) -> Any:
    lists = [item_list(frame, value) for value in values]
    if strict and len({len(items) for items in lists}) > 1:
        raise ValueError("zip() arguments have different lengths")
    return _new_iterator(frame, [frame.session.new(group) for group in zip(*lists, strict=False)])


@model(builtins.reversed)
def _reversed(frame: Frame, value: Any) -> Any:
    return _new_iterator(frame, list(reversed(item_list(frame, value))))


@model(builtins.map)
def _map(frame: Frame, fn: Any, *values: Any) -> Any:
    lists = [item_list(frame, value) for value in values]
    return _new_iterator(frame, [_call(frame, fn, *group) for group in zip(*lists, strict=False)])


@model(builtins.filter)
def _filter(frame: Frame, fn: Any, value: Any) -> Any:
    items = item_list(frame, value)
    keep = [item for item in items if (bool(item) if fn is None else bool(_call(frame, fn, item)))]
    return _new_iterator(frame, keep)


@model(builtins.list)
def _list(frame: Frame, *value: Any) -> Any:
    return frame.session.new(list(item_list(frame, value[0])) if value else [])


@model(builtins.tuple)
def _tuple(frame: Frame, *value: Any) -> Any:
    return frame.session.new(tuple(item_list(frame, value[0])) if value else ())


@model(builtins.set)
def _set(frame: Frame, *value: Any) -> Any:
    return frame.session.new(set(item_list(frame, value[0])) if value else set())


@model(builtins.frozenset)
def _frozenset(frame: Frame, *value: Any) -> Any:
    return frozenset(item_list(frame, value[0])) if value else frozenset()


@model(builtins.dict)
def _dict(frame: Frame, *value: Any, **kwargs: Any) -> Any:
    result: dict[Any, Any] = {}
    if value:
        source = value[0]
        if isinstance(source, dict):
            result.update(dict_items(frame, source))
        else:
            result.update(item_list(frame, source))
    result.update(kwargs)
    return frame.session.new(result)


@model(builtins.sorted)
def _sorted(frame: Frame, value: Any, *, key: Any = None, reverse: bool = False) -> Any:
    items = item_list(frame, value)
    if key is None:
        return frame.session.new(sorted(items, reverse=reverse))
    keys = [_call(frame, key, item) for item in items]
    order = sorted(range(len(items)), key=lambda i: keys[i], reverse=reverse)
    return frame.session.new([items[i] for i in order])


def _reduce_builtin(native: Callable[..., Any]) -> Model:
    def reduce(frame: Frame, *args: Any, key: Any = None, **kwargs: Any) -> Any:
        items = item_list(frame, args[0]) if len(args) == 1 else list(args)
        for item in items:
            no_tensor(item, native.__name__)
        if key is None and items and any(not plain(item) for item in items):
            # a user class's Python comparison, inlined: item < best (min), item > best (max)
            better = operator.lt if native is builtins.min else operator.gt
            best = items[0]
            for item in items[1:]:
                if truth(frame, operate(frame, better, item, best)):
                    best = item
            return best
        if key is None:
            return native(items, **kwargs)
        keys = [_call(frame, key, item) for item in items]
        if not items and "default" in kwargs:
            return kwargs["default"]
        best = native(range(len(items)), key=lambda i: keys[i])
        return items[best]

    return reduce


MODELS[builtins.min] = _reduce_builtin(builtins.min)
MODELS[builtins.max] = _reduce_builtin(builtins.max)


@model(builtins.pow)
def _pow(frame: Frame, base: Any, exponent: Any, modulus: Any = None) -> Any:
    if modulus is None:
        return operate(frame, operator.pow, base, exponent)
    return pow(base, exponent, modulus)


@model(builtins.sum)
def _sum(frame: Frame, value: Any, start: Any = 0) -> Any:
    total = start
    for item in item_list(frame, value):
        total = total + item
    return total


@model(builtins.any)
def _any(frame: Frame, value: Any) -> bool:
    return any(bool(item) for item in item_list(frame, value))


@model(builtins.all)
def _all(frame: Frame, value: Any) -> bool:
    return all(bool(item) for item in item_list(frame, value))


@model(builtins.len)
def _len(frame: Frame, value: Any) -> Any:
    if isinstance(value, ProxyTensor) and value.dim() > 0:
        return value.size(0)  # a symbolic size stays symbolic: only Python's len() needs an int
    method = python_dunder(value, "__len__")
    if method is not None:
        return int(_call(frame, method, value))
    frame.session.guard_contents(value)
    return len(value)


# Builtins that call a dunder method of their argument: a Python one is inlined, so what it
# reads is guarded (run natively, ``float(obj)`` baked ``obj.value`` into the code: a stale
# result once it changed). The second item turns the dunder's result into the builtin's.
_CONVERSIONS: dict[Any, tuple[tuple[str, Callable[[Any], Any]], ...]] = {
    builtins.float: (("__float__", float), ("__index__", float)),
    builtins.int: (("__int__", int), ("__index__", int), ("__trunc__", int)),
    builtins.complex: (("__complex__", complex), ("__float__", complex), ("__index__", complex)),
    builtins.bool: (("__bool__", bool), ("__len__", bool)),
    builtins.abs: (("__abs__", lambda value: value),),
    builtins.round: (("__round__", lambda value: value),),
    builtins.hash: (("__hash__", int),),
    builtins.str: (("__str__", str), ("__repr__", str)),
    builtins.repr: (("__repr__", str),),
    builtins.format: (("__format__", str),),
    builtins.ascii: (("__repr__", ascii),),
}


def _conversion_model(native: Callable[..., Any]) -> Model:
    texts = (builtins.str, builtins.repr, builtins.format, builtins.ascii)

    def convert(frame: Frame, *args: Any, **kwargs: Any) -> Any:
        if args and native in texts:
            no_tensor(args[0], native.__name__ + "()")
        if len(args) >= 1 and not kwargs and not isinstance(args[0], ProxyTensor):
            for name, result in _CONVERSIONS[native]:
                method = python_dunder(args[0], name)
                if method is not None:
                    extra = args[1:] if native in (builtins.round, builtins.format) else ()
                    if native is builtins.format and not extra:
                        extra = ("",)
                    return result(_call(frame, method, args[0], *extra))
        return native(*args, **kwargs)

    return convert


for _native in _CONVERSIONS:
    MODELS[_native] = _conversion_model(_native)


@model(builtins.isinstance)
def _isinstance(frame: Frame, value: Any, kinds: Any) -> bool:
    return isinstance(value, kinds)


@model(builtins.callable)
def _callable(frame: Frame, value: Any) -> bool:
    return callable(value)


@model(builtins.vars)
def _vars(frame: Frame, *args: Any) -> Any:
    if len(args) != 1:  # (``vars()`` is ``locals()``)
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, "vars() of the frame")
    return get_attribute(frame, args[0], "__dict__")  # (TypeError where eager raises it)


@model(builtins.locals, builtins.globals, builtins.eval, builtins.exec)
def _introspection(frame: Frame, *args: Any, **kwargs: Any) -> Any:
    raise GraphBreak(BreakReason.UNSUPPORTED_CALL, "locals/globals/eval/exec")


@model(functools.reduce)
def _functools_reduce(frame: Frame, fn: Any, value: Any, *initial: Any) -> Any:
    items = item_list(frame, value)
    if initial:
        items = [initial[0], *items]
    if not items:
        raise TypeError("reduce() of empty iterable with no initial value")
    total = items[0]
    for item in items[1:]:
        total = _call(frame, fn, total, item)
    return total


@model(itertools.chain)
def _chain(frame: Frame, *values: Any) -> Any:
    return _new_iterator(frame, [item for value in values for item in item_list(frame, value)])


@model(itertools.product)
def _product(frame: Frame, *values: Any, repeat: int = 1) -> Any:
    lists = [item_list(frame, value) for value in values]
    return _new_iterator(
        frame, [frame.session.new(group) for group in itertools.product(*lists, repeat=repeat)]
    )


@model(itertools.islice)
def _islice(frame: Frame, value: Any, *args: Any) -> Any:
    return _new_iterator(frame, list(itertools.islice(item_list(frame, value), *args)))


@model(torch.Tensor.__format__)
def _tensor_format(frame: Frame, tensor: Any, spec: str) -> Any:
    no_tensor(tensor, "format()")
    return format(tensor, spec)


@model(builtins.id)
def _id(frame: Frame, value: Any) -> int:
    """``id()`` of an object that exists before the call, pinned by an identity guard; ids of
    objects the call creates differ on every call, so they cannot be baked into a graph."""
    session = frame.session
    real = session.caller_tensor(value) if isinstance(value, ProxyTensor) else value
    source = session.source_of(value)
    if real is None or source is None or session.is_new(value):
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, "id() of an object created in the call")
    session.add_guard(Identity(source, "id()", real))
    return id(real)
