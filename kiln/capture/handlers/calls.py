"""Opcode handlers for calls and function creation, in each CPython version's stack layout.

3.11 and 3.12 put ``[NULL or method, callable or self, args...]`` under a CALL; 3.13 puts
``[callable, NULL or self, args...]``. Keyword names come from ``KW_NAMES`` (3.11, 3.12) or
from a tuple on the stack (``CALL_KW``, 3.13).
"""

from __future__ import annotations

import dis
import types
from typing import Any

from kiln.capture.calls.dispatch import invoke
from kiln.capture.calls.iterate import dict_items, item_list
from kiln.capture.core.frame import NULL, PY, Frame, handles


@handles("KW_NAMES")
def kw_names(frame: Frame, inst: dis.Instruction) -> None:
    frame.kw_names = tuple(frame.code.co_consts[inst.arg or 0])


def _callee(frame: Frame, args: list[Any]) -> tuple[Any, list[Any]]:
    """Pop the two slots under the arguments: the callable, and ``self`` for method calls."""
    upper = frame.pop()
    lower = frame.pop()
    if PY >= (3, 13):
        fn, self_ = lower, upper
        return fn, (args if self_ is NULL else [self_, *args])
    if lower is NULL:
        return upper, args
    return lower, [upper, *args]


def _call(frame: Frame, count: int, names: tuple[str, ...]) -> None:
    args = frame.popn(count)
    fn, args = _callee(frame, args)
    kwargs: dict[str, Any] = {}
    if names:
        values = args[len(args) - len(names) :]
        args = args[: len(args) - len(names)]
        kwargs = dict(zip(names, values, strict=True))
    frame.push(invoke(frame, fn, tuple(args), kwargs))


@handles("CALL")
def call(frame: Frame, inst: dis.Instruction) -> None:
    names, frame.kw_names = frame.kw_names, ()
    _call(frame, inst.arg or 0, names)


@handles("CALL_KW")
def call_kw(frame: Frame, inst: dis.Instruction) -> None:
    names = tuple(frame.pop())
    _call(frame, inst.arg or 0, names)


@handles("CALL_FUNCTION_EX")
def call_function_ex(frame: Frame, inst: dis.Instruction) -> None:
    kwargs = dict_items(frame, frame.pop()) if (inst.arg or 0) & 1 else {}
    positional = item_list(frame, frame.pop())
    upper = frame.pop()
    lower = frame.pop()
    fn = lower if upper is NULL else upper
    frame.push(invoke(frame, fn, tuple(positional), kwargs))


@handles("MAKE_FUNCTION")
def make_function(frame: Frame, inst: dis.Instruction) -> None:
    code = frame.pop()
    flags = 0 if PY >= (3, 13) else (inst.arg or 0)
    closure = frame.pop() if flags & 0x08 else None
    annotations = frame.pop() if flags & 0x04 else None
    kwdefaults = frame.pop() if flags & 0x02 else None
    defaults = frame.pop() if flags & 0x01 else None
    if closure is None and code.co_freevars:  # 3.13 sets it next (SET_FUNCTION_ATTRIBUTE)
        closure = tuple(types.CellType() for _ in code.co_freevars)
    fn = types.FunctionType(code, frame.globals, code.co_name, defaults, closure)
    fn.__qualname__ = code.co_qualname
    if kwdefaults:
        fn.__kwdefaults__ = kwdefaults
    if annotations:
        fn.__annotations__ = _annotations(annotations)
    frame.push(frame.session.new(fn))


def _annotations(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    return dict(zip(value[::2], value[1::2], strict=True))


@handles("SET_FUNCTION_ATTRIBUTE")
def set_function_attribute(frame: Frame, inst: dis.Instruction) -> None:
    fn = frame.pop()
    value = frame.pop()
    flag = inst.arg or 0
    if flag == 0x01:
        fn.__defaults__ = value
    elif flag == 0x02:
        fn.__kwdefaults__ = value
    elif flag == 0x04:
        fn.__annotations__ = _annotations(value)
    elif flag == 0x08:
        fn = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, value)
        fn.__qualname__ = fn.__code__.co_qualname
        frame.session.new(fn)
    frame.push(fn)
