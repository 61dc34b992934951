"""Opcode handlers for control flow: jumps, loops, ``with``, exceptions and generators.

Branches on Python values are decided during capture (the value is a constant, guarded where
it was read). A branch on a tensor needs its data: ``bool(proxy)`` raises, which becomes a
data-dependent graph break. Known torch context managers (grad mode, autocast) are entered for
real during capture, so the builder sees their state; the session leaves them again if capture
stops inside the block.
"""

from __future__ import annotations

import dis
from typing import Any

from kiln.capture.calls.dispatch import call_function, invoke
from kiln.capture.calls.iterate import make_iterator
from kiln.capture.calls.operators import truth as python_truth
from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.contexts import is_known_context
from kiln.capture.core.frame import PY, Frame, handles


# --- jumps ------------------------------------------------------------------------------
@handles("JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP", "JUMP_NO_INTERRUPT")
def jump(frame: Frame, inst: dis.Instruction) -> None:
    frame.jump(inst.argval)


@handles("POP_JUMP_IF_TRUE", "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_TRUE")
def pop_jump_if_true(frame: Frame, inst: dis.Instruction) -> None:
    if truth(frame.pop(), frame):
        frame.jump(inst.argval)


@handles("POP_JUMP_IF_FALSE", "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_FALSE")
def pop_jump_if_false(frame: Frame, inst: dis.Instruction) -> None:
    if not truth(frame.pop(), frame):
        frame.jump(inst.argval)


@handles("POP_JUMP_IF_NONE", "POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_BACKWARD_IF_NONE")
def pop_jump_if_none(frame: Frame, inst: dis.Instruction) -> None:
    if frame.pop() is None:
        frame.jump(inst.argval)


@handles("POP_JUMP_IF_NOT_NONE", "POP_JUMP_FORWARD_IF_NOT_NONE", "POP_JUMP_BACKWARD_IF_NOT_NONE")
def pop_jump_if_not_none(frame: Frame, inst: dis.Instruction) -> None:
    if frame.pop() is not None:
        frame.jump(inst.argval)


@handles("JUMP_IF_TRUE_OR_POP")
def jump_if_true_or_pop(frame: Frame, inst: dis.Instruction) -> None:
    if truth(frame.top(), frame):
        frame.jump(inst.argval)
    else:
        frame.pop()


@handles("JUMP_IF_FALSE_OR_POP")
def jump_if_false_or_pop(frame: Frame, inst: dis.Instruction) -> None:
    if not truth(frame.top(), frame):
        frame.jump(inst.argval)
    else:
        frame.pop()


def truth(value: Any, frame: Frame | None = None) -> bool:
    """``bool(value)``; a proxy raises (data-dependent), a user class's Python ``__bool__``
    is inlined, builtin values answer natively."""
    if frame is not None and isinstance(value, list | dict):
        frame.session.guard_contents(value)
    return bool(value) if frame is None else python_truth(frame, value)


# --- loops ------------------------------------------------------------------------------
@handles("GET_ITER", "GET_YIELD_FROM_ITER")
def get_iter(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(make_iterator(frame, frame.pop()))


@handles("FOR_ITER")
def for_iter(frame: Frame, inst: dis.Instruction) -> None:
    iterator = frame.top()
    try:
        frame.push(next(iterator))
        return
    except StopIteration:
        pass
    frame.pop()
    frame.jump(inst.argval)
    # 3.12 jumps to END_FOR and 3.13 to END_FOR + POP_TOP, which CPython skips on exhaustion.
    if frame.instructions[frame.pc].opname == "END_FOR":
        frame.pc += 1
        if PY >= (3, 13) and frame.instructions[frame.pc].opname == "POP_TOP":
            frame.pc += 1


@handles("END_FOR")
def end_for(frame: Frame, inst: dis.Instruction) -> None:
    frame.pop()
    if PY == (3, 12):
        frame.pop()


# --- with -------------------------------------------------------------------------------
@handles("BEFORE_WITH")
def before_with(frame: Frame, inst: dis.Instruction) -> None:
    ctx = frame.pop()
    kind = type(ctx)
    if not hasattr(kind, "__enter__") or not hasattr(kind, "__exit__"):
        raise TypeError(f"'{kind.__name__}' object does not support the context manager protocol")
    exit_method = ctx.__exit__
    if is_known_context(ctx):
        result = ctx.__enter__()
        frame.session.enter_context(ctx)
        frame.entered[id(exit_method)] = ctx
        frame.session.keepalive.append(exit_method)
    else:
        result = call_function(frame, kind.__enter__, (ctx,), {})
    frame.push(exit_method)
    frame.push(result)


@handles("WITH_EXCEPT_START")
def with_except_start(frame: Frame, inst: dis.Instruction) -> None:
    error = frame.top()
    exit_method = frame.top(4)
    result = invoke(frame, exit_method, (type(error), error, error.__traceback__), {})
    frame.push(result)


# --- exceptions -------------------------------------------------------------------------
@handles("PUSH_EXC_INFO")
def push_exc_info(frame: Frame, inst: dis.Instruction) -> None:
    error = frame.pop()
    frame.push(frame.exc_stack[-1] if frame.exc_stack else None)
    frame.push(error)
    frame.exc_stack.append(error)


@handles("POP_EXCEPT")
def pop_except(frame: Frame, inst: dis.Instruction) -> None:
    frame.pop()
    if frame.exc_stack:
        frame.exc_stack.pop()


@handles("CHECK_EXC_MATCH")
def check_exc_match(frame: Frame, inst: dis.Instruction) -> None:
    kind = frame.pop()
    frame.push(isinstance(frame.top(), kind))


@handles("RERAISE")
def reraise(frame: Frame, inst: dis.Instruction) -> None:
    raise frame.pop()


@handles("RAISE_VARARGS")
def raise_varargs(frame: Frame, inst: dis.Instruction) -> None:
    count = inst.arg or 0
    if count == 0:
        if not frame.exc_stack:
            raise RuntimeError("No active exception to reraise")
        raise frame.exc_stack[-1]
    cause = frame.pop() if count == 2 else None
    error = frame.pop()
    if isinstance(error, type):
        error = error()
    if count == 2:
        raise error from (cause() if isinstance(cause, type) else cause)
    raise error


@handles("LOAD_ASSERTION_ERROR")
def load_assertion_error(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(AssertionError)


# --- generators (run to exhaustion when inlined) ----------------------------------------
@handles("RETURN_GENERATOR")
def return_generator(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(None)  # the value the first resume sends, popped by the next POP_TOP


@handles("YIELD_VALUE")
def yield_value(frame: Frame, inst: dis.Instruction) -> None:
    if frame.yielded is None:
        raise GraphBreak(BreakReason.UNSUPPORTED_BYTECODE, "yield outside an inlined generator")
    frame.yielded.append(frame.pop())
    frame.push(None)  # what next() sends back


@handles("SEND")
def send(frame: Frame, inst: dis.Instruction) -> None:
    frame.pop()  # the sent value: always None in a generator run to exhaustion
    receiver = frame.top()
    try:
        frame.push(next(receiver))
    except StopIteration as stop:
        if PY == (3, 11):
            frame.pop()
        frame.push(stop.value)
        frame.jump(inst.argval)


@handles("END_SEND")
def end_send(frame: Frame, inst: dis.Instruction) -> None:
    value = frame.pop()
    frame.pop()
    frame.push(value)


@handles("CLEANUP_THROW")
def cleanup_throw(frame: Frame, inst: dis.Instruction) -> None:
    raise frame.pop()
