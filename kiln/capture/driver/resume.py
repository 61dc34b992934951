"""The end of a head function that stops at a graph break: the native step and the resume call.

At a break the root frame's state (stack and live locals, just before the instruction that
broke) is rebuilt from the graph's outputs; then, depending on the instruction:

* a call: ``___r = ___route(callee)(args...)`` -- Python callees go through a compiled wrapper
  of their own, so nested frames are still compiled -- then the resume function continues
  after the call with ``___r`` on the stack;
* a branch on a tensor: ``if cond: return resume_at_target(...) else: return resume_next(...)``;
* ``TO_BOOL`` (3.13): ``bool(cond)`` natively, then resume (before a jump, as a branch);
* anything else: the original code resumes *at* the instruction, uncompiled.

Resume functions are the original code with a prologue that rebuilds the stack (re-entering
known context managers) and jumps to the offset (``kiln/capture/bytecode/rewrite.py``); they are
created once per (code, offset, stack layout, live locals) and compiled like any function.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable
from typing import Any

from kiln.capture.bytecode.rewrite import StackSlot, live_locals, resume_code
from kiln.capture.calls.routing import Router
from kiln.capture.core.contexts import is_known_context
from kiln.capture.core.frame import NULL, PY, Frame
from kiln.capture.driver.reconstruct import Reconstructor

_RESUME_CODES: dict[tuple[Any, ...], types.CodeType] = {}


def forget_resume_codes() -> None:
    """Drop the resume functions built so far (``kiln.reset``)."""
    _RESUME_CODES.clear()


_BASE_NAMES: dict[int, str] = {}  # id(resume code) -> name of the function it continues


def emit_break(plan: Any, rebuild: Reconstructor, fn: types.FunctionType) -> list[str]:
    frame: Frame = plan.frame
    inst = frame.current
    assert inst is not None
    stack = list(frame.stack)
    contexts = [frame.entered[id(item)] for item in stack if _is_context_exit(frame, item)]
    after = frame.instructions[frame.index[inst.offset] + 1].offset
    lines = list(rebuild.lines)
    rebuild.lines.clear()
    handler = _handler_resume(plan, rebuild, fn, stack)  # a break inside a try body
    if plan.kind == "call":
        entered = [rebuild.value(ctx) for ctx in contexts]
        pre = _take(rebuild)
        call, stack = _native_call(frame, inst, stack, rebuild)
        step = _guarded([*_take(rebuild), f"___r = {call}"], handler)
        for ctx in reversed(entered):
            step = [f"with {ctx}:", *("    " + line for line in step)]
        resume = _resume(plan, rebuild, fn, after, [*stack, _RESULT])
        return [*lines, *pre, *step, *_take(rebuild), f"return {resume}"]
    if plan.kind == "branch":
        condition = stack.pop()
        name = inst.opname
        keep = "OR_POP" in name  # JUMP_IF_*_OR_POP keeps the value when it jumps
        jump_when = "TRUE" in name
        cond = rebuild.value(condition)
        jumped = _resume(plan, rebuild, fn, inst.argval, [*stack, condition] if keep else stack)
        fallthrough = _resume(plan, rebuild, fn, after, stack)
        test = cond if jump_when else f"not {cond}"
        return [
            *lines,
            *rebuild.lines,
            f"if {test}:",
            f"    return {jumped}",
            f"return {fallthrough}",
        ]
    if plan.kind == "bool":
        condition = stack.pop()
        cond = rebuild.value(condition)
        step = _guarded([f"___r = bool({cond})"], handler)
        jump = frame.instructions[frame.index[inst.offset] + 1]
        if jump.opname in ("POP_JUMP_IF_TRUE", "POP_JUMP_IF_FALSE"):
            # ``if tensor:`` (3.13: TO_BOOL, then the jump): a resume function per branch, as
            # on 3.11/3.12, not one resume entry per truth value
            beyond = frame.instructions[frame.index[jump.offset] + 1].offset
            jumped = _resume(plan, rebuild, fn, jump.argval, stack)
            fallthrough = _resume(plan, rebuild, fn, beyond, stack)
            test = "___r" if "TRUE" in jump.opname else "not ___r"
            branch = [f"if {test}:", f"    return {jumped}", f"return {fallthrough}"]
            return [*lines, *rebuild.lines, *step, *branch]
        resume = _resume(plan, rebuild, fn, after, [*stack, _RESULT])
        return [*lines, *rebuild.lines, *step, f"return {resume}"]
    if plan.kind == "operation":
        statement, pushes = _native_operation(inst, stack, rebuild)
        step = _guarded([*_take(rebuild), statement], handler)
        resume = _resume(plan, rebuild, fn, after, [*stack, *(pushes or [])])
        return [*lines, *step, *rebuild.lines, f"return {resume}"]
    resume = _resume(plan, rebuild, fn, inst.offset, stack, compiled=False)
    return [*lines, *rebuild.lines, f"return {resume}"]


# Operators of BINARY_OP (by its argrepr) and COMPARE_OP, performed natively at a break.
OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "//": operator.floordiv,
    "%": operator.mod,
    "**": operator.pow,
    "@": operator.matmul,
    "&": operator.and_,
    "|": operator.or_,
    "^": operator.xor,
    "<<": operator.lshift,
    ">>": operator.rshift,
    "+=": operator.iadd,
    "-=": operator.isub,
    "*=": operator.imul,
    "/=": operator.itruediv,
    "//=": operator.ifloordiv,
    "%=": operator.imod,
    "**=": operator.ipow,
    "@=": operator.imatmul,
    "&=": operator.iand,
    "|=": operator.ior,
    "^=": operator.ixor,
    "<<=": operator.ilshift,
    ">>=": operator.irshift,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    ">=": operator.ge,
}
_UNARY = {
    "UNARY_NEGATIVE": operator.neg,
    "UNARY_INVERT": operator.invert,
    "UNARY_NOT": operator.not_,
}
# The instructions a head can perform natively as one statement, and then resume after (any
# other breaking instruction makes the rest of the frame run uncompiled).
OPERATIONS = frozenset(
    {"BINARY_SUBSCR", "BINARY_SLICE", "STORE_SUBSCR", "BINARY_OP", "COMPARE_OP", "CONTAINS_OP"}
    | {"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR"}
    | set(_UNARY)
)


def _native_operation(
    inst: Any, stack: list[Any], rebuild: Reconstructor
) -> tuple[str, list[Any] | None]:
    """The statement performing ``inst`` on the stack's top values (popped from ``stack``), and
    what it pushes (``_RESULT`` for ``___r``; None: nothing)."""
    name = inst.opname
    value = rebuild.value
    if name in ("LOAD_ATTR", "LOAD_METHOD"):
        statement = f"___r = getattr({value(stack.pop())}, {inst.argval!r})"
        method = name == "LOAD_METHOD" or (PY >= (3, 12) and bool((inst.arg or 0) & 1))
        if not method:
            return statement, [_RESULT]
        return statement, [_RESULT, NULL] if PY >= (3, 13) else [NULL, _RESULT]
    if name == "STORE_ATTR":
        target, item = stack.pop(), stack.pop()
        return f"setattr({value(target)}, {inst.argval!r}, {value(item)})", None
    if name == "DELETE_ATTR":
        return f"delattr({value(stack.pop())}, {inst.argval!r})", None
    if name == "STORE_SUBSCR":
        key, container, item = stack.pop(), stack.pop(), stack.pop()
        return f"{value(container)}[{value(key)}] = {value(item)}", None
    if name == "BINARY_SLICE":
        stop, start, container = stack.pop(), stack.pop(), stack.pop()
        return f"___r = {value(container)}[{value(start)}:{value(stop)}]", [_RESULT]
    if name in _UNARY:
        function = _UNARY[name]
        bound = rebuild.binder.bind(function, function.__name__)
        return f"___r = {bound}({value(stack.pop())})", [_RESULT]
    right, left = stack.pop(), stack.pop()
    if name == "BINARY_SUBSCR":
        return f"___r = {value(left)}[{value(right)}]", [_RESULT]
    if name == "CONTAINS_OP":
        negate = "not " if inst.arg else ""
        return f"___r = {negate}({value(left)} in {value(right)})", [_RESULT]
    symbol = str(inst.argrepr)
    as_bool = symbol.startswith("bool(")  # 3.13: COMPARE_OP that also converts to bool
    function = OPERATORS[symbol.removeprefix("bool(").removesuffix(")")]
    call = f"{rebuild.binder.bind(function, function.__name__)}({value(left)}, {value(right)})"
    return f"___r = {'bool(' + call + ')' if as_bool else call}", [_RESULT]


def _handler_resume(
    plan: Any, rebuild: Reconstructor, fn: types.FunctionType, stack: list[Any]
) -> tuple[list[str], str] | None:
    """For a break inside a ``try`` body: the lines and the call that continue in the handler
    when the native step raises, with the stack the exception table says (its depth, then
    the exception), as CPython would have entered it."""
    entry = plan.handler
    if entry is None:
        return None
    call = _resume(plan, rebuild, fn, entry.target, [*stack[: entry.depth], _EXCEPTION])
    return _take(rebuild), call


def _guarded(step: list[str], handler: tuple[list[str], str] | None) -> list[str]:
    """``step``, sending an exception it raises to the ``try``'s handler when there is one."""
    if handler is None:
        return step
    setup, call = handler
    body = [f"    {line}" for line in step]
    return [*setup, "try:", *body, "except BaseException as ___e:", f"    return {call}"]


def _take(rebuild: Reconstructor) -> list[str]:
    lines = list(rebuild.lines)
    rebuild.lines.clear()
    return lines


class _Result:
    """Marks the stack slot that holds the native step's result (``___r``)."""


_RESULT = _Result()
_EXCEPTION = _Result()  # the exception a native step raised (``___e``), for a handler


def _is_context_exit(frame: Frame, item: Any) -> bool:
    return (
        isinstance(item, types.MethodType)
        and id(item) in frame.entered
        and is_known_context(frame.entered[id(item)])
    )


def _native_call(
    frame: Frame, inst: Any, stack: list[Any], rebuild: Reconstructor
) -> tuple[str, list[Any]]:
    """The call expression for the CALL instruction at ``inst``, and the stack below it."""
    route = rebuild.binder.bind(rebuild.session.router, "route")
    if inst.opname == "CALL_FUNCTION_EX":
        # The argument tuple and dict are passed whole (``f(*args, **kwargs)``): an argument
        # tuple read from outside (a ``*args`` parameter) is re-read through its source on
        # every call; its items were never read, so they have no sources of their own.
        kwargs = stack.pop() if (inst.arg or 0) & 1 else None
        packed = stack.pop()
        upper = stack.pop()
        lower = stack.pop()
        callee = lower if upper is NULL else upper
        spread = [f"*{rebuild.value(packed)}"]
        if kwargs is not None:
            spread.append(f"**{rebuild.value(kwargs)}")
        return f"{route}({rebuild.value(callee)})({', '.join(spread)})", stack
    names = tuple(stack.pop()) if inst.opname == "CALL_KW" else frame.kw_names
    total = inst.arg or 0
    values = stack[len(stack) - total :] if total else []
    del stack[len(stack) - total :]
    count = total - len(names)
    upper = stack.pop()
    lower = stack.pop()
    if PY >= (3, 13):
        callee, self_ = lower, upper
    else:
        callee, self_ = (upper, NULL) if lower is NULL else (lower, upper)
    if self_ is not NULL:
        values = [self_, *values]
        count += 1
    args = [rebuild.value(v) for v in values[:count]]
    args += [f"{name}={rebuild.value(v)}" for name, v in zip(names, values[count:], strict=True)]
    return f"{route}({rebuild.value(callee)})({', '.join(args)})", stack


def _resume(
    plan: Any,
    rebuild: Reconstructor,
    fn: types.FunctionType,
    offset: int,
    stack: list[Any],
    compiled: bool = True,
) -> str:
    """A call of the resume function at ``offset`` with ``stack`` and the live locals."""
    frame: Frame = plan.frame
    slots: list[StackSlot] = []
    args: list[str] = []
    for item in stack:
        if item is NULL:
            slots.append(StackSlot.NULL)
        elif item is _RESULT:
            slots.append(StackSlot.VALUE)
            args.append("___r")
        elif item is _EXCEPTION:
            slots.append(StackSlot.VALUE)
            args.append("___e")
        elif _is_context_exit(frame, item):
            slots.append(StackSlot.CONTEXT)
            args.append(rebuild.value(frame.entered[id(item)]))
        else:
            slots.append(StackSlot.VALUE)
            args.append(rebuild.value(item))
    code = frame.code
    live = sorted(
        name
        for name in live_locals(code, offset)
        if name in frame.locals or (name in code.co_cellvars and name in frame.cells)
    )
    cells = tuple(name for name in live if name in code.co_cellvars and name in frame.cells)
    for name in live:
        # A cell variable travels as its cell: closures made before the break share it.
        value = frame.cells[name] if name in cells else frame.locals[name]
        args.append(rebuild.value(value))
    key = (code, offset, tuple(slots), tuple(live), cells)
    resume = _RESUME_CODES.get(key)
    if resume is None:
        base = _BASE_NAMES.get(id(code), code.co_name)
        name = f"<kiln resume in {base} at line {_line_at(frame, offset)}>"
        resume = resume_code(code, offset, slots, live, name=name, cells=cells)
        _RESUME_CODES[key] = resume
        _BASE_NAMES[id(resume)] = base
    router = rebuild.session.router
    assert isinstance(router, Router)
    target = ResumeTarget(resume, router if compiled else None)
    plan.resumes.append(target)
    return f"{rebuild.binder.bind(target, 'resume')}(___f)({', '.join(args)})"


def _line_at(frame: Frame, offset: int) -> int:
    for inst in reversed(frame.instructions[: frame.index[offset] + 1]):
        if inst.positions is not None and inst.positions.lineno is not None:
            return inst.positions.lineno
    return frame.code.co_firstlineno


class ResumeTarget:
    """The resume function for the calling function's closure (compiled, or raw)."""

    def __init__(self, code: types.CodeType, router: Router | None) -> None:
        self.code = code
        self.router = router  # None: the resume runs uncompiled
        self._by_closure: dict[int, tuple[Any, Any]] = {}

    def __call__(self, fn: types.FunctionType) -> Any:
        closure = fn.__closure__
        known = self._by_closure.get(id(closure))
        if known is not None and known[0] is closure:
            return known[1]
        resume = types.FunctionType(self.code, fn.__globals__, self.code.co_name, None, closure)
        resume.__qualname__ = self.code.co_qualname
        target: Any = resume
        if self.router is not None:
            target = self.router.compiled_function(resume)
        self._by_closure[id(closure)] = (closure, target)
        return target
