"""Opcode handlers for the value stack, locals, constants, operators, containers and strings.

Operators run natively on the real values: on numbers they compute constants, on proxies they
go through ``__torch_function__`` into the graph. Mutation of a container that existed before
the call is journalled through the session first (see ``kiln/capture/core/session.py``).
"""

from __future__ import annotations

import collections.abc
import dis
import operator
from types import CellType
from typing import Any

import torch

from kiln.capture.calls.attributes import get_attribute
from kiln.capture.calls.dispatch import call_function
from kiln.capture.calls.iterate import dict_items, item_list
from kiln.capture.calls.native import (
    materialize,
    no_opaque,
    no_tensor,
    python_dunder,
    wrap_contents,
)
from kiln.capture.calls.operators import contains, operate, truth
from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.frame import NULL, PY, UNBOUND, Frame, handles
from kiln.capture.core.iteration import items_of
from kiln.capture.guards.sources import Attr, Item

_BINARY = {
    "+": operator.add,
    "&": operator.and_,
    "//": operator.floordiv,
    "<<": operator.lshift,
    "@": operator.matmul,
    "*": operator.mul,
    "%": operator.mod,
    "|": operator.or_,
    "**": operator.pow,
    ">>": operator.rshift,
    "-": operator.sub,
    "/": operator.truediv,
    "^": operator.xor,
    "+=": operator.iadd,
    "&=": operator.iand,
    "//=": operator.ifloordiv,
    "<<=": operator.ilshift,
    "@=": operator.imatmul,
    "*=": operator.imul,
    "%=": operator.imod,
    "|=": operator.ior,
    "**=": operator.ipow,
    ">>=": operator.irshift,
    "-=": operator.isub,
    "/=": operator.itruediv,
    "^=": operator.ixor,
}
_BINARY_BY_ARG = [_BINARY[symbol] for _, symbol in dis._nb_ops]  # type: ignore[attr-defined]
_COMPARE = [operator.lt, operator.le, operator.eq, operator.ne, operator.gt, operator.ge]
_MUTATORS = {operator.iadd, operator.imul, operator.ior, operator.iand, operator.ixor}


# --- stack ------------------------------------------------------------------------------
@handles("NOP", "RESUME", "EXTENDED_ARG", "CACHE", "COPY_FREE_VARS", "PRECALL", "TO_BOOL_NOP")
def nop(frame: Frame, inst: dis.Instruction) -> None:
    pass


@handles("POP_TOP")
def pop_top(frame: Frame, inst: dis.Instruction) -> None:
    frame.pop()


@handles("PUSH_NULL")
def push_null(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(NULL)


@handles("COPY")
def copy(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.top(inst.arg or 1))


@handles("SWAP")
def swap(frame: Frame, inst: dis.Instruction) -> None:
    depth = inst.arg or 2
    stack = frame.stack
    stack[-1], stack[-depth] = stack[-depth], stack[-1]


@handles("LOAD_CONST")
def load_const(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(inst.argval)


@handles("RETURN_VALUE")
def return_value(frame: Frame, inst: dis.Instruction) -> None:
    frame.return_value = frame.pop()
    frame.returned = True


@handles("RETURN_CONST")
def return_const(frame: Frame, inst: dis.Instruction) -> None:
    frame.return_value = inst.argval
    frame.returned = True


# --- locals -----------------------------------------------------------------------------
def _load_local(frame: Frame, name: str) -> Any:
    if name in frame.cells and _is_cell_slot(frame, name):
        return frame.cells[name]  # 3.13 builds closures with LOAD_FAST on cells
    value = frame.locals.get(name, UNBOUND)
    if value is UNBOUND:
        raise UnboundLocalError(
            f"cannot access local variable '{name}' where it is not associated with a value"
        )
    return value


def _is_cell_slot(frame: Frame, name: str) -> bool:
    return name in frame.code.co_cellvars or name in frame.code.co_freevars


@handles("LOAD_FAST", "LOAD_FAST_CHECK")
def load_fast(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(_load_local(frame, inst.argval))


@handles("LOAD_FAST_AND_CLEAR")
def load_fast_and_clear(frame: Frame, inst: dis.Instruction) -> None:
    # 3.12+ inlined comprehensions save the outer variable (a cell, for a cell variable).
    name = inst.argval
    if name in frame.cells and name in frame.code.co_cellvars:
        frame.push(frame.cells.pop(name))
    else:
        frame.push(frame.locals.pop(name, UNBOUND))


@handles("STORE_FAST")
def store_fast(frame: Frame, inst: dis.Instruction) -> None:
    value = frame.pop()
    name = inst.argval
    if name in frame.code.co_cellvars and (name in frame.cells or isinstance(value, CellType)):
        frame.cells.pop(name, None)  # restoring a cell variable's slot after a comprehension
        if isinstance(value, CellType):
            frame.cells[name] = value
            return
    if value is UNBOUND:
        frame.locals.pop(name, None)
    else:
        frame.locals[name] = value


@handles("DELETE_FAST")
def delete_fast(frame: Frame, inst: dis.Instruction) -> None:
    if frame.locals.pop(inst.argval, UNBOUND) is UNBOUND:
        raise UnboundLocalError(f"cannot access local variable '{inst.argval}'")


def _pair(frame: Frame, inst: dis.Instruction) -> tuple[str, str]:
    names = frame.code.co_varnames + frame.code.co_cellvars + frame.code.co_freevars
    arg = inst.arg or 0
    return names[arg >> 4], names[arg & 15]


@handles("LOAD_FAST_LOAD_FAST")
def load_fast_load_fast(frame: Frame, inst: dis.Instruction) -> None:
    first, second = _pair(frame, inst)
    frame.push(_load_local(frame, first))
    frame.push(_load_local(frame, second))


@handles("STORE_FAST_LOAD_FAST")
def store_fast_load_fast(frame: Frame, inst: dis.Instruction) -> None:
    store, load = _pair(frame, inst)
    frame.locals[store] = frame.pop()
    frame.push(_load_local(frame, load))


@handles("STORE_FAST_STORE_FAST")
def store_fast_store_fast(frame: Frame, inst: dis.Instruction) -> None:
    first, second = _pair(frame, inst)
    frame.locals[first] = frame.pop()
    frame.locals[second] = frame.pop()


# --- operators --------------------------------------------------------------------------
@handles("BINARY_OP")
def binary_op(frame: Frame, inst: dis.Instruction) -> None:
    right = frame.pop()
    left = frame.pop()
    no_opaque(frame, "an operator", left, right)
    fn = _BINARY_BY_ARG[inst.arg or 0]
    if fn in _MUTATORS and isinstance(left, list | dict | set):
        frame.session.touch_container(left)
    frame.push(operate(frame, fn, left, right))


@handles("UNARY_NEGATIVE")
def unary_negative(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(operate(frame, operator.neg, no_opaque(frame, "an operator", frame.pop())))


@handles("UNARY_POSITIVE")
def unary_positive(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(operate(frame, operator.pos, no_opaque(frame, "an operator", frame.pop())))


@handles("UNARY_INVERT")
def unary_invert(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(operate(frame, operator.invert, no_opaque(frame, "an operator", frame.pop())))


@handles("UNARY_NOT")
def unary_not(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(not truth(frame, no_opaque(frame, "a truth test", frame.pop())))


@handles("TO_BOOL")
def to_bool(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(truth(frame, no_opaque(frame, "a truth test", frame.pop())))


@handles("COMPARE_OP")
def compare_op(frame: Frame, inst: dis.Instruction) -> None:
    right = frame.pop()
    left = frame.pop()
    no_opaque(frame, "a comparison", left, right)
    left, right = materialize(frame.session, left), materialize(frame.session, right)
    arg = inst.arg or 0
    shift = {(3, 11): 0, (3, 12): 4}.get(PY, 5)
    result = operate(frame, _COMPARE[arg >> shift], left, right)
    if PY >= (3, 13) and arg & 16 and not isinstance(result, torch.Tensor):
        # 3.13's "coerce to bool" form feeds a branch; a tensor result stays a tensor, so
        # the branch (not this comparison) is where a data-dependent break happens.
        result = bool(result)
    frame.push(result)


@handles("IS_OP")
def is_op(frame: Frame, inst: dis.Instruction) -> None:
    right = frame.pop()
    left = frame.pop()
    frame.push((left is not right) if inst.arg else (left is right))


@handles("CONTAINS_OP")
def contains_op(frame: Frame, inst: dis.Instruction) -> None:
    container = frame.pop()
    item = frame.pop()
    no_opaque(frame, "'in'", item, container)
    if isinstance(container, list | tuple | dict):
        frame.session.guard_contents(container)
        if not isinstance(container, dict):
            container = item_list(frame, container)  # guards each item the test compares
    result = contains(frame, container, item)
    frame.push((not result) if inst.arg else result)


@handles("CALL_INTRINSIC_1")
def call_intrinsic_1(frame: Frame, inst: dis.Instruction) -> None:
    name = inst.argrepr
    value = frame.pop()
    if name == "INTRINSIC_UNARY_POSITIVE":
        frame.push(+value)
    elif name == "INTRINSIC_LIST_TO_TUPLE":
        frame.push(frame.session.new(tuple(value)))
    elif name == "INTRINSIC_STOPITERATION_ERROR":
        raise value
    else:
        raise GraphBreak(BreakReason.UNSUPPORTED_BYTECODE, f"CALL_INTRINSIC_1 {name}")


# --- containers -------------------------------------------------------------------------
@handles("BUILD_TUPLE")
def build_tuple(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.session.new(tuple(frame.popn(inst.arg or 0))))


@handles("BUILD_LIST")
def build_list(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.session.new(list(frame.popn(inst.arg or 0))))


@handles("BUILD_SET")
def build_set(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.session.new(set(frame.popn(inst.arg or 0))))


@handles("BUILD_MAP")
def build_map(frame: Frame, inst: dis.Instruction) -> None:
    items = frame.popn(2 * (inst.arg or 0))
    frame.push(frame.session.new(dict(zip(items[::2], items[1::2], strict=True))))


@handles("BUILD_CONST_KEY_MAP")
def build_const_key_map(frame: Frame, inst: dis.Instruction) -> None:
    keys = frame.pop()
    values = frame.popn(inst.arg or 0)
    frame.push(frame.session.new(dict(zip(keys, values, strict=True))))


@handles("BUILD_STRING")
def build_string(frame: Frame, inst: dis.Instruction) -> None:
    frame.push("".join(frame.popn(inst.arg or 0)))


@handles("BUILD_SLICE")
def build_slice(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(slice(*frame.popn(inst.arg or 2)))


@handles("LIST_APPEND")
def list_append(frame: Frame, inst: dis.Instruction) -> None:
    value = frame.pop()
    frame.top(inst.arg or 1).append(value)


@handles("SET_ADD")
def set_add(frame: Frame, inst: dis.Instruction) -> None:
    value = frame.pop()
    frame.top(inst.arg or 1).add(value)


@handles("MAP_ADD")
def map_add(frame: Frame, inst: dis.Instruction) -> None:
    value = frame.pop()
    key = frame.pop()
    frame.top(inst.arg or 1)[key] = value


@handles("LIST_EXTEND")
def list_extend(frame: Frame, inst: dis.Instruction) -> None:
    values = frame.pop()
    items = items_of(frame.session, values)
    frame.top(inst.arg or 1).extend(items if items is not None else values)


@handles("SET_UPDATE")
def set_update(frame: Frame, inst: dis.Instruction) -> None:
    values = frame.pop()
    frame.top(inst.arg or 1).update(values)


@handles("DICT_UPDATE", "DICT_MERGE")
def dict_update(frame: Frame, inst: dis.Instruction) -> None:
    mapping = frame.pop()
    target = frame.top(inst.arg or 1)
    if inst.opname == "DICT_MERGE":
        duplicate = set(target) & set(mapping.keys())
        if duplicate:
            raise TypeError(f"got multiple values for keyword argument '{duplicate.pop()}'")
    target.update(dict_items(frame, mapping))


@handles("LIST_TO_TUPLE")
def list_to_tuple(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.session.new(tuple(frame.pop())))


@handles("UNPACK_SEQUENCE")
def unpack_sequence(frame: Frame, inst: dis.Instruction) -> None:
    value = frame.pop()
    items = item_list(frame, value)
    count = inst.arg or 0
    if len(items) != count:
        if len(items) > count:
            raise ValueError(f"too many values to unpack (expected {count})")
        raise ValueError(f"not enough values to unpack (expected {count}, got {len(items)})")
    frame.stack.extend(reversed(items))


@handles("UNPACK_EX")
def unpack_ex(frame: Frame, inst: dis.Instruction) -> None:
    value = frame.pop()
    items = item_list(frame, value)
    before, after = (inst.arg or 0) & 0xFF, (inst.arg or 0) >> 8
    if len(items) < before + after:
        raise ValueError(
            f"not enough values to unpack (expected at least {before + after}, got {len(items)})"
        )
    middle = frame.session.new(items[before : len(items) - after])
    parts = [*items[:before], middle, *items[len(items) - after :]]
    frame.stack.extend(reversed(parts))


# --- subscripts -------------------------------------------------------------------------
@handles("BINARY_SUBSCR")
def binary_subscr(frame: Frame, inst: dis.Instruction) -> None:
    key = frame.pop()
    container = frame.pop()
    frame.push(subscript(frame, container, key))


@handles("BINARY_SLICE")
def binary_slice(frame: Frame, inst: dis.Instruction) -> None:
    stop = frame.pop()
    start = frame.pop()
    container = frame.pop()
    frame.push(subscript(frame, container, slice(start, stop)))


def subscript(frame: Frame, container: Any, key: Any) -> Any:
    """``container[key]``: sourced reads are wrapped; Python ``__getitem__`` is inlined."""
    session = frame.session
    no_opaque(frame, "indexing", container, key)
    source = session.source_of(container)
    if isinstance(container, torch.nn.ModuleList | torch.nn.Sequential) and isinstance(key, int):
        modules = list(container._modules.items())
        name, module = modules[key]  # IndexError as eager's
        if source is None:
            return module
        return session.wrap(module, Item(Attr(source, "_modules"), name))
    if isinstance(container, torch.nn.ModuleDict) and isinstance(key, str):
        module = container._modules[key]
        if source is None:
            return module
        return session.wrap(module, Item(Attr(source, "_modules"), key))
    method = python_dunder(container, "__getitem__")
    if method is not None and not isinstance(container, torch.Tensor):
        return call_function(frame, method, (container, key), {})
    if isinstance(container, list) and source is not None:
        session.guard_contents(container)  # IndexError (or not) depends on the length
    result = container[key]
    if (
        source is not None
        and not session.is_new(container)
        and isinstance(container, list | tuple | dict)
        and isinstance(key, int | str)
    ):
        return session.wrap(result, Item(source, key))
    if isinstance(key, slice) and isinstance(result, list | tuple):
        session.new(result)
    return result


@handles("STORE_SUBSCR")
def store_subscr(frame: Frame, inst: dis.Instruction) -> None:
    key = frame.pop()
    container = frame.pop()
    value = frame.pop()
    store_item(frame, container, key, value)


@handles("STORE_SLICE")
def store_slice(frame: Frame, inst: dis.Instruction) -> None:
    stop = frame.pop()
    start = frame.pop()
    container = frame.pop()
    value = frame.pop()
    store_item(frame, container, slice(start, stop), value)


def store_item(frame: Frame, container: Any, key: Any, value: Any) -> None:
    method = python_dunder(container, "__setitem__")
    if method is not None and not isinstance(container, torch.Tensor):
        call_function(frame, method, (container, key, value), {})
        return
    if isinstance(container, list | dict | set):
        frame.session.touch_container(container)
        if isinstance(container, list):
            frame.session.guard_contents(container)  # IndexError depends on the length
    elif not isinstance(container, torch.Tensor) and not frame.session.is_new(container):
        raise GraphBreak(
            BreakReason.UNSUPPORTED_CALL,
            f"item assignment on a {type(container).__name__} that existed before the call",
        )
    container[key] = value


@handles("DELETE_SUBSCR")
def delete_subscr(frame: Frame, inst: dis.Instruction) -> None:
    key = frame.pop()
    container = frame.pop()
    if isinstance(container, list | dict | set):
        frame.session.touch_container(container)
        if isinstance(container, list) and frame.session.source_of(container) is not None:
            wrap_contents(frame.session, container)
    del container[key]


# --- strings ----------------------------------------------------------------------------


_CONVERSIONS = {0: None, 1: str, 2: repr, 3: ascii}


@handles("FORMAT_VALUE")
def format_value(frame: Frame, inst: dis.Instruction) -> None:
    flags = inst.arg or 0
    spec = frame.pop() if flags & 0x04 else ""
    value = no_opaque(frame, "formatting", frame.pop())
    no_tensor(value, "formatting")
    conversion = _CONVERSIONS[flags & 0x03]
    if conversion is not None:
        value = call_function(frame, conversion, (value,), {})
    frame.push(call_function(frame, format, (value, spec), {}))  # (a Python __format__ inlined)


@handles("CONVERT_VALUE")
def convert_value(frame: Frame, inst: dis.Instruction) -> None:
    conversion = _CONVERSIONS[inst.arg or 0]
    value = no_opaque(frame, "formatting", frame.pop())
    no_tensor(value, "formatting")
    frame.push(value if conversion is None else call_function(frame, conversion, (value,), {}))


@handles("FORMAT_SIMPLE")
def format_simple(frame: Frame, inst: dis.Instruction) -> None:
    value = no_opaque(frame, "formatting", frame.pop())
    no_tensor(value, "formatting")
    frame.push(call_function(frame, format, (value, ""), {}))


@handles("FORMAT_WITH_SPEC")
def format_with_spec(frame: Frame, inst: dis.Instruction) -> None:
    spec = frame.pop()
    value = no_opaque(frame, "formatting", frame.pop())
    no_tensor(value, "formatting")
    frame.push(call_function(frame, format, (value, spec), {}))


@handles("GET_LEN")
def get_len(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(call_function(frame, len, (no_opaque(frame, "len()", frame.top()),), {}))


# --- match statements -------------------------------------------------------------------
_SELF_MATCHING = (bool, bytearray, bytes, dict, float, frozenset, int, list, set, str, tuple)


@handles("MATCH_MAPPING")
def match_mapping(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(isinstance(frame.top(), collections.abc.Mapping))


@handles("MATCH_SEQUENCE")
def match_sequence(frame: Frame, inst: dis.Instruction) -> None:
    subject = frame.top()
    frame.push(
        isinstance(subject, collections.abc.Sequence)
        and not isinstance(subject, str | bytes | bytearray)
    )


@handles("MATCH_KEYS")
def match_keys(frame: Frame, inst: dis.Instruction) -> None:
    keys = frame.top()
    subject = frame.top(2)
    if all(key in subject for key in keys):
        frame.push(tuple(subject[key] for key in keys))
    else:
        frame.push(None)


@handles("COPY_DICT_WITHOUT_KEYS")
def copy_dict_without_keys(frame: Frame, inst: dis.Instruction) -> None:
    keys = frame.pop()
    rest = {k: v for k, v in frame.top().items() if k not in keys}
    frame.push(keys)
    frame.push(frame.session.new(rest))


@handles("MATCH_CLASS")
def match_class(frame: Frame, inst: dis.Instruction) -> None:
    names = frame.pop()
    cls = frame.pop()
    subject = frame.pop()
    if not isinstance(subject, cls):
        frame.push(None)
        return
    count = inst.arg or 0
    if count and issubclass(cls, _SELF_MATCHING) and not hasattr(cls, "__match_args__"):
        if count > 1:
            raise TypeError(f"{cls.__name__}() accepts 1 positional sub-pattern ({count} given)")
        positional: list[str] = []
        values = [subject]
    else:
        positional = list(getattr(cls, "__match_args__", ()))[:count]
        if len(positional) < count:
            raise TypeError(f"{cls.__name__}() accepts {len(positional)} positional sub-patterns")
        values = []
    try:
        values += [get_attribute(frame, subject, name) for name in (*positional, *names)]
    except AttributeError:
        frame.push(None)
        return
    frame.push(frame.session.new(tuple(values)))
