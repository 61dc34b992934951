"""Code objects Kiln derives from user code, built by editing the decoded original.

* `resume_code` -- the continuation of a function after a graph break: the original code plus a
  prefix that rebuilds the value stack from arguments and jumps to the break offset, so the rest
  of the function runs (its handlers, cells and line numbers intact) as CPython compiled it::

      def f(x):                      resume at "b = a + 1", stack [], live ["a"]:
          a = x * 2                    <kiln resume in f at line 3>(a):
          graph_break()                    RESUME; JUMP_FORWARD -> L      (prefix)
          b = a + 1                        LOAD_FAST x; ... (original, unreachable)
          return b                     L:  LOAD_FAST a; LOAD_CONST 1; ...

* `route_calls` -- a copy of a frame Kiln cannot compile in which every call's callee first goes
  through a router function (``f(x)`` runs as ``router(f)(x)``), so callees can still be
  compiled.

Both rest on analyses of the original code the capture layer uses too: `live_locals` (the
locals the rest of the function may read) and `stack_depth_at`.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Any

from kiln.capture.bytecode.assembler import assemble, stack_depths, stack_effect
from kiln.capture.bytecode.decode import (
    LOCAL_OPNAMES,
    PACKED_LOCAL_OPNAMES,
    PY_VERSION,
    TERMINATOR_OPNAMES,
    Instruction,
    code_localsplus,
    decode,
    find_instruction,
    localsplus_names,
)

__all__ = [
    "CallRouting",
    "StackSlot",
    "live_locals",
    "plan_call_routing",
    "resume_code",
    "route_calls",
    "stack_depth_at",
]

_GENERATOR_FLAGS = (
    inspect.CO_GENERATOR
    | inspect.CO_COROUTINE
    | inspect.CO_ASYNC_GENERATOR
    | inspect.CO_ITERABLE_COROUTINE
)
# 3.13 superinstructions and the two plain instructions each one stands for, in order.
_SPLIT_PACKED = {
    "LOAD_FAST_LOAD_FAST": ("LOAD_FAST", "LOAD_FAST"),
    "STORE_FAST_LOAD_FAST": ("STORE_FAST", "LOAD_FAST"),
    "STORE_FAST_STORE_FAST": ("STORE_FAST", "STORE_FAST"),
}


class StackSlot(enum.Enum):
    """What one value-stack entry at the resume point is, and how the prefix rebuilds it."""

    VALUE = "value"  # passed as an argument
    NULL = "null"  # the NULL of a pending call, re-pushed with PUSH_NULL
    CONTEXT = "context"  # a context manager, passed and re-entered (its __exit__ stays pushed)


# ---------------------------------------------------------------------------------------------
# Analyses


def _local_events(inst: Instruction, names: Sequence[str]) -> list[tuple[bool, str]]:
    """The (is_read, name) local accesses of one instruction, in execution order.

    Deleting reads (``del x`` of an unbound x raises); LOAD_FAST_AND_CLEAR (3.12 inlined
    comprehensions) reads the value it saves and then clears the slot; loading a cell to build a
    closure counts as a read, since the closure may read it.
    """
    name, arg = inst.opname, inst.arg
    if name not in LOCAL_OPNAMES or arg is None or name == "MAKE_CELL":
        return []
    if name in PACKED_LOCAL_OPNAMES:
        first, second = _SPLIT_PACKED[name]
        pair = (names[arg >> 4], names[arg & 15])
        return [(op == "LOAD_FAST", local) for op, local in zip((first, second), pair, strict=True)]
    local = names[arg]
    if name.startswith("STORE_"):
        return [(False, local)]
    if name.startswith("DELETE_") or name == "LOAD_FAST_AND_CLEAR":
        return [(True, local), (False, local)]
    return [(True, local)]


def _live_in(code: CodeType, insts: list[Instruction]) -> list[set[str]]:
    """Backward may-liveness per instruction over fall-through, jump and exception edges."""
    names, super_self = code_localsplus(code), _super_reads(code)
    index_of = {id(inst): i for i, inst in enumerate(insts)}
    events = [_local_events(inst, names) for inst in insts]
    if super_self is not None:  # super() reads the first argument, see _explicit_super
        for i in _zero_arg_supers(insts):
            events[i] = [(True, super_self)]
    live: list[set[str]] = [set() for _ in insts]
    changed = True
    while changed:
        changed = False
        for i in reversed(range(len(insts))):
            inst = insts[i]
            now: set[str] = set()
            if inst.opname not in TERMINATOR_OPNAMES and i + 1 < len(insts):
                now |= live[i + 1]
            if inst.target is not None:
                now |= live[index_of[id(inst.target)]]
            for is_read, local in reversed(events[i]):
                if is_read:
                    now.add(local)
                else:
                    now.discard(local)
            if inst.handler is not None:  # the exception may come before any store
                now |= live[index_of[id(inst.handler.target)]]
            if now != live[i]:
                live[i], changed = now, True
    return live


def _super_reads(code: CodeType) -> str | None:
    """The local a zero-argument ``super()`` in ``code`` reads: the frame's first argument."""
    arguments = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)
    if "__class__" in code.co_freevars and "super" in code.co_names and arguments:
        return code.co_varnames[0]
    return None


def _zero_arg_supers(insts: list[Instruction]) -> list[int]:
    """Indices of the ``LOAD_GLOBAL super`` of each ``super()`` call without arguments."""
    found = []
    for i, inst in enumerate(insts):
        if inst.opname == "LOAD_GLOBAL" and inst.argval == "super" and (inst.arg or 0) & 1:
            call = insts[i + 1 : i + 3] if PY_VERSION == (3, 11) else insts[i + 1 : i + 2]
            if [(c.opname, c.arg) for c in call][-1:] == [("CALL", 0)]:
                found.append(i)
    return found


def live_locals(code: CodeType, offset: int) -> set[str]:
    """Locals (cells included, freevars not) that some path from ``offset`` reads before writing.

    A name can be live yet unbound at ``offset`` -- e.g. a 3.12+ comprehension variable saved by
    LOAD_FAST_AND_CLEAR; pass only the bound ones to `resume_code`.
    """
    insts = decode(code)
    live = _live_in(code, insts)[find_instruction(insts, offset)]
    return live - set(code.co_freevars)


def stack_depth_at(code: CodeType, offset: int) -> int:
    """Value-stack depth before the instruction at ``offset`` (NULLs count as entries).

    On 3.11 the depth inside a call sequence follows CPython's accounting, where PRECALL already
    removed the arguments; resume points are never between KW_NAMES/PRECALL and CALL.
    """
    insts = decode(code)
    depth = stack_depths(insts)[find_instruction(insts, offset)]
    if depth is None:
        raise ValueError(f"offset {offset} of {code.co_name} is unreachable")
    return depth


# ---------------------------------------------------------------------------------------------
# Resume functions


def resume_code(
    code: CodeType,
    offset: int,
    stack: Sequence[StackSlot],
    live: Sequence[str],
    *,
    name: str,
    cells: Sequence[str] = (),
) -> CodeType:
    """The code of a function that continues ``code`` at byte ``offset``.

    Positional parameters: ``__stack0, __stack1, ...`` for the VALUE/CONTEXT slots of ``stack``
    (bottom first), then the ``live`` locals; a cell's *contents* are passed and re-wrapped by
    MAKE_CELL, except for the cell variables named in ``cells``, whose cell objects themselves
    are passed (so closures made before the break share them).  The freevars are the original's, so
    ``types.FunctionType(resume, f.__globals__, name, None, f.__closure__)`` runs it.  Every
    original instruction is kept, so exception handlers (a ``with`` block's ``__exit__`` call
    included) and positions behave as in the original.
    """
    if code.co_flags & _GENERATOR_FLAGS:
        raise ValueError("resume functions for generators and coroutines are not supported")
    insts = decode(code)
    at = find_instruction(insts, offset)
    _check_resume_point(code, insts, at, stack)
    prologue = _prologue_length(insts)
    if at < prologue:
        raise ValueError(f"offset {offset} is inside the prologue of {code.co_name}")
    stack_names = _stack_names(code, sum(s is not StackSlot.NULL for s in stack))
    varnames = _resume_varnames(code, stack_names, live)
    old_names = code_localsplus(code)
    new_names = localsplus_names(varnames, code.co_cellvars, code.co_freevars)
    argcount = len(stack_names) + len(live)
    may_be_unbound = {
        i for i in range(argcount, len(varnames)) if varnames[i] not in code.co_cellvars
    }
    body = _relayout_locals(insts, old_names, new_names, may_be_unbound)
    if super_self := _super_reads(code):
        body = _explicit_super(body, super_self in code.co_cellvars, super_self, new_names)
    prefix = _stack_prefix(stack, new_names, stack_names, insts[at])
    flags = code.co_flags & ~(inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
    head = [
        inst
        for inst in body[:prologue]
        if not (inst.opname == "MAKE_CELL" and inst.argval in cells)
    ]
    return assemble(
        head + prefix + body[prologue:],
        code,
        co_argcount=argcount,
        co_posonlyargcount=0,
        co_kwonlyargcount=0,
        co_nlocals=len(varnames),
        co_varnames=tuple(varnames),
        co_flags=flags,
        co_name=name,
        co_qualname=name,
    )


def _check_resume_point(
    code: CodeType, insts: list[Instruction], at: int, stack: Sequence[StackSlot]
) -> None:
    if at > 0 and insts[at - 1].opname in ("KW_NAMES", "PRECALL"):
        raise ValueError(
            f"cannot resume between {insts[at - 1].opname} and {insts[at].opname}: resume at "
            "the first instruction of the call sequence"
        )
    depth = stack_depths(insts)[at]
    if depth is None:
        raise ValueError(f"offset {insts[at].offset} of {code.co_name} is unreachable")
    if depth != len(stack):
        raise ValueError(f"the stack at offset {insts[at].offset} holds {depth}, not {len(stack)}")


def _prologue_length(insts: list[Instruction]) -> int:
    """Instructions up to and including the first RESUME (MAKE_CELL, COPY_FREE_VARS ...)."""
    for i, inst in enumerate(insts):
        if inst.opname == "RESUME":
            return i + 1
    raise ValueError("code has no RESUME instruction")


def _resume_varnames(code: CodeType, stack_names: list[str], live: Sequence[str]) -> list[str]:
    known = set(code.co_varnames) | set(code.co_cellvars)
    for local in live:
        if local not in known:
            raise ValueError(f"{local!r} is not a local or cell variable of {code.co_name}")
    if len(set(live)) != len(live):
        raise ValueError(f"duplicate names in live: {list(live)}")
    if clash := set(stack_names) & (known | set(code.co_freevars)):
        raise ValueError(f"{code.co_name} already uses the names {sorted(clash)}")
    rest = [v for v in code.co_varnames if v not in live]
    return stack_names + list(live) + rest


def _stack_names(code: CodeType, count: int) -> list[str]:
    """``__stack0, __stack1, ...``; a resume of a resume function (whose code already has those
    names) uses ``__stack_1_0, ...`` and so on."""
    taken = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
    stem, level = "__stack", 0
    while any(f"{stem}{k}" in taken for k in range(count)):
        level += 1
        stem = f"__stack_{level}_"
    return [f"{stem}{k}" for k in range(count)]


def _stack_prefix(
    stack: Sequence[StackSlot], names: list[str], stack_names: list[str], target: Instruction
) -> list[Instruction]:
    """Push the stack slots bottom first, then jump to ``target``.  Positions are the target's,
    so an error while re-entering a context manager points at the resume line."""
    out: list[Instruction] = []
    arg_index = 0
    for slot in stack:
        if slot is StackSlot.NULL:
            out.append(Instruction("PUSH_NULL"))
            continue
        local = stack_names[arg_index]
        arg_index += 1
        out.append(Instruction("LOAD_FAST", names.index(local), local))
        if slot is StackSlot.CONTEXT:
            out += [Instruction("BEFORE_WITH"), Instruction("POP_TOP")]  # keep __exit__ only
    out.append(Instruction("JUMP_FORWARD", target=target))
    for inst in out:
        inst.positions, inst.line = target.positions, target.line
    return out


def _explicit_super(
    insts: list[Instruction], is_cell: bool, first: str, names: list[str]
) -> list[Instruction]:
    """Make every ``super()`` explicit: without arguments it reads the frame's first local slot,
    which in a resume function is ``__stack0`` or another live local (a TypeError, or the wrong
    object).  Bare calls become ``super(__class__, <first argument>)``; LOAD_SUPER_ATTR (3.12+)
    gets its two-argument flag, because its generic path calls ``super()`` bare too."""
    out = list(insts)
    for inst in insts:
        if inst.opname == "LOAD_SUPER_ATTR":
            inst.arg = (inst.arg or 0) | 2
    for i in reversed(_zero_arg_supers(insts)):
        load = insts[i]
        cls = Instruction("LOAD_DEREF", names.index("__class__"), "__class__")
        load_local = "LOAD_FAST" if PY_VERSION == (3, 11) else "LOAD_FAST_CHECK"
        self_ = Instruction("LOAD_DEREF" if is_cell else load_local, names.index(first), first)
        for extra in (cls, self_):
            extra.handler, extra.positions, extra.line = load.handler, load.positions, load.line
        for call in insts[i + 1 : i + (3 if PY_VERSION == (3, 11) else 2)]:
            call.arg = 2  # 3.11: PRECALL 0; CALL 0.  3.12+: CALL 0
        out[i + 1 : i + 1] = [cls, self_]
    return out


def _relayout_locals(
    insts: list[Instruction],
    old_names: Sequence[str],
    new_names: Sequence[str],
    may_be_unbound: set[int],
) -> list[Instruction]:
    """Renumber local/cell/free accesses for a new localsplus layout (by name), splitting a
    3.13 superinstruction whose indices no longer fit in 4 bits.  On 3.12+ a LOAD_FAST of a
    local that may be unbound becomes LOAD_FAST_CHECK, so a local the caller failed to pass
    raises UnboundLocalError instead of crashing the interpreter."""
    index = {local: i for i, local in enumerate(new_names)}
    out: list[Instruction] = []
    for inst in insts:
        if inst.opname not in LOCAL_OPNAMES or inst.arg is None:
            out.append(inst)
            continue
        if inst.opname not in PACKED_LOCAL_OPNAMES:
            inst.arg = index[old_names[inst.arg]]
            out.append(_checked(inst, may_be_unbound))
            continue
        high, low = index[old_names[inst.arg >> 4]], index[old_names[inst.arg & 15]]
        loads = [op == "LOAD_FAST" for op in _SPLIT_PACKED[inst.opname]]
        unsafe = any(ld and i in may_be_unbound for ld, i in zip(loads, (high, low), strict=True))
        if high < 16 and low < 16 and not (unsafe and PY_VERSION >= (3, 12)):
            inst.arg = high << 4 | low
            out.append(inst)
            continue
        first, second = _SPLIT_PACKED[inst.opname]
        extra = Instruction(second, low, new_names[low], handler=inst.handler)
        extra.positions, extra.line = inst.positions, inst.line
        inst.opname, inst.arg, inst.argval = first, high, new_names[high]
        out += [_checked(inst, may_be_unbound), _checked(extra, may_be_unbound)]
    return out


def _checked(inst: Instruction, may_be_unbound: set[int]) -> Instruction:
    if PY_VERSION >= (3, 12) and inst.opname == "LOAD_FAST" and inst.arg in may_be_unbound:
        inst.opname = "LOAD_FAST_CHECK"
    return inst


# ---------------------------------------------------------------------------------------------
# Call routing: where does each call's callable come from?
#
# A forward simulation tracks, for every stack slot, the set of (instruction index, output
# number) that may have produced it.  Instructions are modelled exactly when their inputs and
# outputs are known; any other instruction "consumes" the whole stack and produces unknown
# values, which only costs coverage.  A producer is rewritten only if every consumer of its
# output is a routed call's callee position, so a value that is also tested, stored or passed
# elsewhere is never replaced by router(value).

_Slot = frozenset[tuple[int, int]]
_UNKNOWN: _Slot = frozenset({(-1, 0)})
_CALL_OPNAMES = frozenset({"CALL", "CALL_KW", "CALL_FUNCTION_EX"})
# Consume their inputs and push nothing.
_NO_RESULT = frozenset(
    {
        "POP_TOP", "POP_EXCEPT", "NOP", "RESUME", "MAKE_CELL", "COPY_FREE_VARS",
        "STORE_FAST", "STORE_FAST_STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF",
        "STORE_ATTR", "STORE_SUBSCR", "STORE_SLICE", "DELETE_FAST", "DELETE_NAME",
        "DELETE_GLOBAL", "DELETE_DEREF", "DELETE_ATTR", "DELETE_SUBSCR",
        "RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE", "JUMP_FORWARD",
        "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "POP_JUMP_IF_TRUE", "POP_JUMP_IF_FALSE",
        "POP_JUMP_IF_NONE", "POP_JUMP_IF_NOT_NONE", "POP_JUMP_FORWARD_IF_TRUE",
        "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_FORWARD_IF_NOT_NONE",
        "POP_JUMP_BACKWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_NONE",
        "POP_JUMP_BACKWARD_IF_NOT_NONE", "SETUP_ANNOTATIONS", "PRINT_EXPR", "IMPORT_STAR",
        "END_FOR", "END_ASYNC_FOR", "EXIT_INIT_CHECK",
    }
)  # fmt: skip
# Consume their inputs and push exactly one new value (or, for GET_LEN, IMPORT_FROM, MATCH_*,
# PUSH_EXC_INFO..., leave the inputs in place and push one value on top: the same thing here).
_ONE_RESULT = frozenset(
    {
        "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_CONST", "LOAD_NAME",
        "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_CLASSDEREF", "LOAD_FROM_DICT_OR_DEREF",
        "LOAD_FROM_DICT_OR_GLOBALS", "LOAD_LOCALS", "LOAD_BUILD_CLASS", "LOAD_ASSERTION_ERROR",
        "LOAD_GLOBAL", "LOAD_ATTR", "LOAD_SUPER_ATTR", "STORE_FAST_LOAD_FAST", "PUSH_NULL",
        "UNARY_NEGATIVE", "UNARY_NOT", "UNARY_INVERT", "UNARY_POSITIVE", "TO_BOOL",
        "BINARY_OP", "BINARY_SUBSCR", "BINARY_SLICE", "COMPARE_OP", "IS_OP", "CONTAINS_OP",
        "BUILD_TUPLE", "BUILD_LIST", "BUILD_SET", "BUILD_MAP", "BUILD_CONST_KEY_MAP",
        "BUILD_STRING", "BUILD_SLICE", "LIST_TO_TUPLE", "FORMAT_VALUE", "FORMAT_SIMPLE",
        "FORMAT_WITH_SPEC", "CONVERT_VALUE", "GET_ITER", "GET_YIELD_FROM_ITER", "GET_AITER",
        "GET_ANEXT", "GET_AWAITABLE", "GET_LEN", "MATCH_MAPPING", "MATCH_SEQUENCE",
        "MATCH_KEYS", "MATCH_CLASS", "MAKE_FUNCTION", "SET_FUNCTION_ATTRIBUTE",
        "CALL_INTRINSIC_1", "CALL_INTRINSIC_2", "CALL_KW", "CALL_FUNCTION_EX", "IMPORT_NAME",
        "IMPORT_FROM", "YIELD_VALUE", "RETURN_GENERATOR", "PUSH_EXC_INFO", "CHECK_EXC_MATCH",
        "PREP_RERAISE_STAR", "ASYNC_GEN_WRAP",
    }
)  # fmt: skip
# Pop their operands and read a container deeper in the stack (comprehension appends).
_CONTAINER_UPDATES = frozenset(
    {"LIST_APPEND", "SET_ADD", "MAP_ADD", "LIST_EXTEND", "SET_UPDATE", "DICT_UPDATE", "DICT_MERGE"}
)
# Replace their top inputs by as many fresh values as the stack effect leaves (generators).
_FRESH_TOP = {"SEND": 2, "END_SEND": 2, "CLEANUP_THROW": 3, "CHECK_EG_MATCH": 2}
_PAIR_POPS = {"LOAD_GLOBAL": 0, "LOAD_ATTR": 1, "LOAD_METHOD": 1, "LOAD_SUPER_ATTR": 3}


@dataclass(frozen=True)
class CallRouting:
    """Which calls of a code object `route_calls` routes, by the byte offset of the call
    instruction (CALL, CALL_KW or CALL_FUNCTION_EX).  ``exempt`` calls are left alone on
    purpose (``super()``, whose zero-argument form inspects the calling frame, and the implicit
    ``__exit__`` call of a ``with``); ``unrouted`` ones had a callable that could not be located
    safely."""

    routed: tuple[int, ...]
    exempt: tuple[int, ...]
    unrouted: tuple[int, ...]


@dataclass
class _Step:
    consumed: list[_Slot]
    fall: list[_Slot]
    jump: list[_Slot] | None = None


def _pushes_pair(inst: Instruction) -> bool:
    """LOAD_GLOBAL with its NULL bit and the method forms push two values: [NULL, f] or
    [method, self] on 3.11/3.12; [f, NULL] or [method, self] on 3.13."""
    if inst.opname == "LOAD_METHOD":
        return True
    if inst.opname in ("LOAD_GLOBAL", "LOAD_SUPER_ATTR") or (
        inst.opname == "LOAD_ATTR" and PY_VERSION >= (3, 12)
    ):
        return bool((inst.arg or 0) & 1)
    return False


def _resized(stack: list[_Slot], depth: int) -> list[_Slot]:
    return stack[:depth] + [_UNKNOWN] * (depth - len(stack))


def _step(i: int, inst: Instruction, stack: list[_Slot]) -> _Step:
    """The transfer function: what ``inst`` consumes and the stacks after it."""
    name, arg, depth = inst.opname, inst.arg or 0, len(stack)
    mine = [frozenset({(i, k)}) for k in range(2)]
    effect = stack_effect(name, inst.arg, jump=False)
    if name == "SWAP":
        swapped = list(stack)
        swapped[-1], swapped[-arg] = swapped[-arg], swapped[-1]
        return _Step([], swapped)
    if name == "COPY":
        return _Step([stack[-arg]], [*stack, mine[0]])
    if name in ("PRECALL", "KW_NAMES"):  # 3.11 accounting: CALL pops everything below
        return _Step([], list(stack))
    if name == "CALL" or (name in _ONE_RESULT and not _pushes_pair(inst)):
        pops = arg + 2 if name == "CALL" else 1 - effect
        return _Step(stack[depth - pops :], [*stack[: depth - pops], mine[0]])
    if _pushes_pair(inst) or name == "LOAD_FAST_LOAD_FAST":
        pops = _PAIR_POPS.get(name, 0)
        return _Step(stack[depth - pops :], [*stack[: depth - pops], *mine])
    if name in ("UNPACK_SEQUENCE", "UNPACK_EX", "BEFORE_WITH", "BEFORE_ASYNC_WITH"):
        fresh = [frozenset({(i, k)}) for k in range(1 + effect)]
        return _Step(stack[-1:], stack[:-1] + fresh)
    if name == "FOR_ITER":
        jumped = depth + stack_effect(name, arg, jump=True)
        return _Step(stack[-1:], [*stack, mine[0]], _resized(stack, jumped))
    if name in ("JUMP_IF_TRUE_OR_POP", "JUMP_IF_FALSE_OR_POP"):
        return _Step(stack[-1:], stack[:-1], list(stack))
    if name in _FRESH_TOP:
        keep = depth - _FRESH_TOP[name]
        fresh = [frozenset({(i, k)}) for k in range(3)]
        jumped = depth + stack_effect(name, arg, jump=True) - keep
        return _Step(
            stack[keep:],
            stack[:keep] + fresh[: depth + effect - keep],
            stack[:keep] + fresh[:jumped],
        )
    if name in _CONTAINER_UPDATES:
        return _Step(stack[depth + effect - arg :], stack[: depth + effect])
    if name in _NO_RESULT:
        return _Step(stack[depth + effect :], stack[: depth + effect], stack[: depth + effect])
    jumped = depth + stack_effect(name, arg, jump=True) if inst.target is not None else depth
    return _Step(list(stack), _resized([], depth + effect), _resized([], jumped))


def _simulate(insts: list[Instruction]) -> list[list[_Slot] | None]:
    """The producer sets of every stack slot before each instruction, to a fixpoint."""
    index_of = {id(inst): i for i, inst in enumerate(insts)}
    states: list[list[_Slot] | None] = [None] * len(insts)
    work: list[int] = []

    def merge(j: int, stack: list[_Slot]) -> None:
        old = states[j]
        if old is None:
            states[j] = list(stack)
            work.append(j)
            return
        if len(old) != len(stack):
            raise ValueError(f"inconsistent stack depth at {insts[j]!r}")
        merged = [a | b for a, b in zip(old, stack, strict=True)]
        if merged != old:
            states[j] = merged
            work.append(j)

    merge(0, [])
    while work:
        i = work.pop()
        inst, stack = insts[i], states[i]
        assert stack is not None
        step = _step(i, inst, stack)
        if inst.handler is not None:
            entry = stack[: inst.handler.depth] + [_UNKNOWN] * (1 + inst.handler.lasti)
            merge(index_of[id(inst.handler.target)], entry)
        if inst.target is not None:
            merge(index_of[id(inst.target)], step.fall if step.jump is None else step.jump)
        if inst.opname not in TERMINATOR_OPNAMES:
            merge(i + 1, step.fall)
    return states


def _call_slots(inst: Instruction, stack: list[_Slot]) -> tuple[_Slot, _Slot]:
    """(callable-or-method slot, NULL-or-self slot) of a call: [X, Y, args...]; on 3.11/3.12
    a plain call has X = NULL, Y = callable; on 3.13 X = callable, Y = NULL."""
    arg = inst.arg or 0
    above = {"CALL": arg, "CALL_KW": arg + 1, "CALL_FUNCTION_EX": 1 + (arg & 1)}[inst.opname]
    return stack[-above - 2], stack[-above - 1]


def _top_value(inst: Instruction, output: int) -> bool:
    """Whether ``output`` of ``inst`` is a non-NULL value left on top of the stack."""
    if inst.opname == "LOAD_FAST_LOAD_FAST":
        return output == 1
    if inst.opname in ("PUSH_NULL", "LOAD_FAST_AND_CLEAR") or _pushes_pair(inst):
        return False
    return inst.opname in _ONE_RESULT or inst.opname in ("COPY", "CALL")


def _is_null(inst: Instruction, output: int) -> bool:
    if inst.opname == "LOAD_GLOBAL" and _pushes_pair(inst):
        return output == (1 if PY_VERSION >= (3, 13) else 0)
    return inst.opname == "PUSH_NULL"


def _classify_call(
    insts: list[Instruction], call: Instruction, stack: list[_Slot]
) -> tuple[str, _Slot]:
    """("pair" | "single", the outputs that make up the callee) when the callable can be
    routed; ("exempt" | "unrouted", empty) otherwise."""
    x, y = _call_slots(call, stack)
    producers = {p for p, _ in x | y}
    if any(
        insts[p].opname in ("BEFORE_WITH", "BEFORE_ASYNC_WITH")
        or (insts[p].opname == "LOAD_GLOBAL" and insts[p].argval == "super")
        for p in producers - {-1}
    ):
        return "exempt", frozenset()
    if -1 in producers:
        return "unrouted", frozenset()
    (p, *more) = producers
    if not more and x == {(p, 0)} and y == {(p, 1)} and _pushes_pair(insts[p]):
        return "pair", x | y
    # 3.13 always calls X (with Y as self unless NULL); 3.11/3.12 call Y when X is NULL,
    # else X with Y as self (e.g. 3.11's call of a comprehension function with its iterator).
    callee = x
    if PY_VERSION < (3, 13) and all(_is_null(insts[p], k) for p, k in x):
        callee = y
    if all(_top_value(insts[p], k) for p, k in callee):
        return "single", callee
    return "unrouted", frozenset()


def _plan(insts: list[Instruction]) -> tuple[dict[int, str], dict[int, str]]:
    """(call index -> outcome, producer index -> "pair" | "single" for the producers to
    rewrite).  A call stays routed only while every use of its callee outputs is the callee
    position of a routed call."""
    try:
        states = _simulate(insts)
    except ValueError:
        states = [None] * len(insts)
    outcome: dict[int, str] = {}
    callees: dict[int, _Slot] = {}
    uses: dict[tuple[int, int], set[int]] = {}  # output -> consumers; -1: not a callee use
    for i, (inst, stack) in enumerate(zip(insts, states, strict=True)):
        is_call = inst.opname in _CALL_OPNAMES
        if stack is None:
            outcome.update({i: "unrouted"} if is_call else {})
            continue
        consumed = _step(i, inst, stack).consumed
        callee: _Slot = frozenset()
        if is_call:
            outcome[i], callee = _classify_call(insts, inst, stack)
            if callee:
                callees[i] = callee
        for slot in consumed:
            for output in slot:
                uses.setdefault(output, set()).add(i if output in callee else -1)
    changed = True
    while changed:
        changed = False
        for i, callee in list(callees.items()):
            if any(not uses[output].issubset(callees) for output in callee):
                del callees[i]
                outcome[i], changed = "unrouted", True
    rewrite = {p: outcome[i] for i, callee in callees.items() for p, _ in callee}
    return outcome, rewrite


def plan_call_routing(code: CodeType) -> CallRouting:
    """Which calls of ``code`` (not of nested code objects) `route_calls` would route."""
    insts = decode(code)
    outcome, _ = _plan(insts)
    by_kind: dict[str, list[int]] = {"routed": [], "exempt": [], "unrouted": []}
    for i, kind in sorted(outcome.items()):
        offset = insts[i].offset
        assert offset is not None
        by_kind["routed" if kind in ("pair", "single") else kind].append(offset)
    return CallRouting(*(tuple(by_kind[k]) for k in ("routed", "exempt", "unrouted")))


def _router_call(load: tuple[str, int], like: Instruction) -> list[Instruction]:
    """Replace the callable on top of the stack by ``router(callable)``; ``load`` pushes the
    router (a global or a constant)."""
    if PY_VERSION >= (3, 13):  # [f] -> [router, NULL, f]
        seq = [load, ("SWAP", 2), ("PUSH_NULL", None), ("SWAP", 2), ("CALL", 1)]
    else:  # [f] -> [NULL, router, f]
        seq = [("PUSH_NULL", None), ("SWAP", 2), load, ("SWAP", 2)]
        seq += [("PRECALL", 1), ("CALL", 1)] if PY_VERSION == (3, 11) else [("CALL", 1)]
    return [_like(like, name, arg) for name, arg in seq]


def _like(like: Instruction, name: str, arg: int | None) -> Instruction:
    inst = Instruction(name, arg, handler=like.handler, positions=like.positions)
    inst.line = like.line
    return inst


def _route_producer(inst: Instruction, router: tuple[str, int]) -> list[Instruction]:
    """Instructions that replace ``inst``: itself, made to push a plain callable if it was a
    pair producer, then the router call, then the NULL a plain call expects."""
    if not _pushes_pair(inst):
        return [inst, *_router_call(router, inst)]
    if inst.opname == "LOAD_METHOD":
        inst.opname = "LOAD_ATTR"  # 3.11: same name index, no flag bit
    else:
        inst.arg = (inst.arg or 0) & ~1
    renull = [_like(inst, "PUSH_NULL", None)]
    if PY_VERSION < (3, 13):
        renull.append(_like(inst, "SWAP", 2))
    return [inst, *_router_call(router, inst), *renull]


def route_calls(code: CodeType, router: Any, *, nested: bool = True) -> CodeType:
    """A copy of ``code`` whose calls run as ``router(callee)(args...)``. ``router`` is either
    the name of a global looked up at call time, or the router function itself (held as a
    constant of the code).  Method calls become calls of the bound method.  With ``nested`` the
    code objects in ``co_consts`` (inner functions, lambdas, comprehensions, generator
    expressions) are routed too.  See `plan_call_routing` for which calls are routed."""
    insts = decode(code)
    _, rewrite = _plan(insts)
    names = list(code.co_names)
    consts = [
        route_calls(c, router) if nested and isinstance(c, CodeType) else c for c in code.co_consts
    ]
    if isinstance(router, str):
        if router not in names:
            names.append(router)
        load = ("LOAD_GLOBAL", names.index(router) << 1)
    else:
        consts.append(router)
        load = ("LOAD_CONST", len(consts) - 1)
    out: list[Instruction] = []
    for i, inst in enumerate(insts):
        out += _route_producer(inst, load) if i in rewrite else [inst]
    return assemble(out, code, co_names=tuple(names), co_consts=tuple(consts))
