"""Assemble a list of `Instruction`s (see `kiln.capture.bytecode.decode`) back into a code object.

Everything positional is derived, never patched in place: byte offsets (with inline CACHE
slots), EXTENDED_ARG prefixes (grown to a fixpoint, since a longer jump can push its target
further away), jump arguments and their direction variant, the exception table (one row per run
of instructions sharing a handler), the PEP 626/657 location table and ``co_stacksize``.  The
rest of the code object comes from ``template`` plus ``**replace`` (``code.replace`` keywords).

Jumps may be written with a version-neutral name -- ``JUMP``, ``JUMP_FORWARD``,
``POP_JUMP_IF_TRUE`` ... -- and the assembler picks the concrete opcode from the direction:
3.11 has POP_JUMP_FORWARD_IF_* / POP_JUMP_BACKWARD_IF_*, 3.12+ only JUMP_BACKWARD goes back.
"""

from __future__ import annotations

import dis
from collections.abc import Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Any

from kiln.capture.bytecode.decode import (
    PY_VERSION,
    TERMINATOR_OPNAMES,
    Handler,
    Instruction,
    extended_arg_count,
    has_arg,
    inline_cache_entries,
)

_EXTENDED_ARG = dis.opmap["EXTENDED_ARG"]
_CACHE_UNIT = bytes([dis.opmap["CACHE"], 0])
_NO_LOCATION = (-1, -1, -1, -1)


class AssemblyError(ValueError):
    """The instruction list cannot form valid bytecode (bad jump, inconsistent stack...)."""


def assemble(instructions: Sequence[Instruction], template: CodeType, **replace: Any) -> CodeType:
    """Build a code object from ``instructions``; non-bytecode fields come from ``template``
    overridden by ``replace`` (e.g. ``co_consts=...``, ``co_varnames=...``, ``co_name=...``).

    The instructions are not modified.  Non-jump instructions must carry their ``arg``.
    """
    insts = list(instructions)
    index_of = _index(insts)
    opnames = _concrete_opnames(insts, index_of)
    starts, args, ext = _layout(insts, opnames, index_of)
    units = [ext[i] + 1 + inline_cache_entries(opnames[i]) for i in range(len(insts))]
    _, max_depth = _stack_analysis(insts, opnames, index_of)
    firstlineno = replace.get("co_firstlineno", template.co_firstlineno)
    fields: dict[str, Any] = {
        "co_code": _emit(opnames, args, ext),
        "co_exceptiontable": _exception_table(insts, starts, units, index_of),
        "co_linetable": _location_table(insts, units, firstlineno),
        "co_stacksize": max_depth,
    }
    fields.update(replace)
    return template.replace(**fields)


def stack_depths(instructions: Sequence[Instruction]) -> list[int | None]:
    """The stack depth before each instruction (None where unreachable), as CPython's compiler
    counts it: exception handlers start at ``depth + lasti + 1``."""
    insts = list(instructions)
    index_of = _index(insts)
    depths, _ = _stack_analysis(insts, _concrete_opnames(insts, index_of), index_of)
    return depths


def _index(insts: list[Instruction]) -> dict[int, int]:
    """Position of each instruction by identity; every jump and handler target must be listed."""
    index_of = {id(inst): i for i, inst in enumerate(insts)}
    for inst in insts:
        for target in (inst.target, inst.handler and inst.handler.target):
            if target is not None and id(target) not in index_of:
                raise AssemblyError(f"{inst!r} refers to {target!r}, which is not in the list")
    return index_of


def _concrete_opnames(insts: list[Instruction], index_of: dict[int, int]) -> list[str]:
    """The real opcode name of each instruction; jumps get the variant for their direction
    (a jump to itself or to an earlier instruction is backward)."""
    names = []
    for i, inst in enumerate(insts):
        if inst.target is None:
            names.append(inst.opname)
            continue
        target = index_of[id(inst.target)]
        if inst.opname == "FOR_ITER" and PY_VERSION >= (3, 12):
            _check_loop_exit(insts, target)
        names.append(_jump_variant(inst.opname, target <= i))
    return names


def _check_loop_exit(insts: list[Instruction], target: int) -> None:
    """On 3.12+ an exhausted FOR_ITER jumps *past* its target, which must therefore be the
    loop's END_FOR (3.13: END_FOR then POP_TOP); anything else there would be skipped."""
    expected = ["END_FOR"] if PY_VERSION == (3, 12) else ["END_FOR", "POP_TOP"]
    found = [inst.opname for inst in insts[target : target + len(expected)]]
    if found != expected:
        raise AssemblyError(f"FOR_ITER must jump to {' + '.join(expected)}, not {found}")


def _jump_variant(opname: str, backward: bool) -> str:
    if opname in ("JUMP", "JUMP_FORWARD", "JUMP_BACKWARD"):
        return "JUMP_BACKWARD" if backward else "JUMP_FORWARD"
    if opname in ("JUMP_NO_INTERRUPT", "JUMP_BACKWARD_NO_INTERRUPT"):
        return "JUMP_BACKWARD_NO_INTERRUPT" if backward else "JUMP_FORWARD"
    if opname.startswith("POP_JUMP_"):
        condition = opname.removeprefix("POP_JUMP_")
        condition = condition.removeprefix("FORWARD_").removeprefix("BACKWARD_")
        if PY_VERSION == (3, 11):
            return f"POP_JUMP_{'BACKWARD' if backward else 'FORWARD'}_{condition}"
        if backward:
            raise AssemblyError(f"{opname} cannot jump backward on 3.12+ (add a JUMP_BACKWARD)")
        return f"POP_JUMP_{condition}"
    if backward:
        raise AssemblyError(f"{opname} can only jump forward")
    return opname


def _layout(
    insts: list[Instruction], opnames: list[str], index_of: dict[int, int]
) -> tuple[list[int], list[int], list[int]]:
    """Byte start of each instruction, its argument and EXTENDED_ARG count, to a fixpoint.

    Prefix counts only grow, so the loop terminates; a jump whose argument later shrinks keeps a
    harmless ``EXTENDED_ARG 0``.
    """
    args = [inst.arg or 0 for inst in insts]
    for inst, name in zip(insts, opnames, strict=True):
        if inst.target is None and inst.arg is None and has_arg(name):
            raise AssemblyError(f"{inst!r} needs an integer arg")
    ext = [0 if inst.target is not None else extended_arg_count(inst.arg) for inst in insts]
    caches = [inline_cache_entries(name) for name in opnames]
    while True:
        starts, pos = [], 0
        for i in range(len(insts)):
            starts.append(pos)
            pos += 2 * (ext[i] + 1 + caches[i])
        grown = False
        for i, inst in enumerate(insts):
            if inst.target is None:
                continue
            target = index_of[id(inst.target)]
            end = starts[i] + 2 * (ext[i] + 1 + caches[i])
            args[i] = abs(end - starts[target]) // 2
            if extended_arg_count(args[i]) > ext[i]:
                ext[i] = extended_arg_count(args[i])
                grown = True
        if not grown:
            return starts, args, ext


def _emit(opnames: list[str], args: list[int], ext: list[int]) -> bytes:
    out = bytearray()
    for name, arg, prefixes in zip(opnames, args, ext, strict=True):
        for shift in range(prefixes, 0, -1):
            out += bytes([_EXTENDED_ARG, (arg >> (8 * shift)) & 0xFF])
        out += bytes([dis.opmap[name], arg & 0xFF if has_arg(name) else 0])
        out += _CACHE_UNIT * inline_cache_entries(name)
    return bytes(out)


def _write_table_varint(out: bytearray, value: int, entry_start: bool) -> None:
    """Exception-table varint: big-endian 6-bit chunks, bit 6 = more, bit 7 = entry start."""
    chunks = [value & 63]
    while value >= 64:
        value >>= 6
        chunks.append(value & 63)
    chunks.reverse()
    for k, chunk in enumerate(chunks):
        more = 64 if k < len(chunks) - 1 else 0
        out.append(chunk | more | (128 if entry_start and k == 0 else 0))


def _exception_table(
    insts: list[Instruction], starts: list[int], units: list[int], index_of: dict[int, int]
) -> bytes:
    """One row per maximal run of instructions with an equal handler.  Rows never overlap,
    which is the flat form CPython itself emits."""
    out = bytearray()

    def emit(first: int, end: int, handler: Handler) -> None:
        target = starts[index_of[id(handler.target)]]
        _write_table_varint(out, starts[first] // 2, True)
        _write_table_varint(out, (end - starts[first]) // 2, False)
        _write_table_varint(out, target // 2, False)
        _write_table_varint(out, (handler.depth << 1) | int(handler.lasti), False)

    current: Handler | None = None
    first = 0
    for i, inst in enumerate(insts):
        if inst.handler != current:
            if current is not None:
                emit(first, starts[i], current)
            current, first = inst.handler, i
    if current is not None:
        emit(first, starts[-1] + 2 * units[-1], current)
    return bytes(out)


def _location(inst: Instruction) -> tuple[int, int, int, int]:
    """(line, end line, column, end column) with -1 for "unknown", as CPython's compiler has."""
    pos = inst.positions
    if pos is None or pos.lineno is None:
        if inst.line is None:
            return _NO_LOCATION
        return (inst.line, inst.line, -1, -1)
    end_line = pos.lineno if pos.end_lineno is None else pos.end_lineno
    col = -1 if pos.col_offset is None else pos.col_offset
    end_col = -1 if pos.end_col_offset is None else pos.end_col_offset
    return (pos.lineno, end_line, col, end_col)


@dataclass
class _LineState:
    out: bytearray
    line: int


def _location_table(insts: list[Instruction], units: list[int], firstlineno: int) -> bytes:
    """PEP 626/657 location table, at most 8 code units per entry.  3.12+ merges runs of equal
    locations; 3.11 writes one entry per instruction (either decodes the same)."""
    state = _LineState(bytearray(), firstlineno)
    run: tuple[int, int, int, int] | None = None
    size = 0
    for inst, n in zip(insts, units, strict=True):
        loc = _location(inst)
        if loc != run or PY_VERSION == (3, 11):
            if run is not None:
                _write_location(state, run, size)
            run, size = loc, 0
        size += n
    if run is not None:
        _write_location(state, run, size)
    return bytes(state.out)


def _write_varint(out: bytearray, value: int) -> None:
    """Location-table varint: little-endian 6-bit chunks, bit 6 = more."""
    while value >= 64:
        out.append(64 | (value & 63))
        value >>= 6
    out.append(value)


def _write_signed_varint(out: bytearray, value: int) -> None:
    _write_varint(out, ((-value) << 1) | 1 if value < 0 else value << 1)


def _write_location(state: _LineState, loc: tuple[int, int, int, int], size: int) -> None:
    while size > 8:
        _write_location_entry(state, loc, 8)
        size -= 8
    if size:
        _write_location_entry(state, loc, size)


def _write_location_entry(state: _LineState, loc: tuple[int, int, int, int], size: int) -> None:
    """One entry in the shortest form that fits, chosen in the order CPython's compiler uses."""
    out, (line, end_line, col, end_col) = state.out, loc
    head = 0x80 | (size - 1)
    if line < 0:
        out.append(head | 15 << 3)  # no location
        return
    delta = line - state.line
    if col < 0 or end_col < 0:
        if end_line in (line, -1):
            out.append(head | 13 << 3)  # line only
            _write_signed_varint(out, delta)
            state.line = line
            return
    elif end_line == line:
        if delta == 0 and col < 80 and 0 <= end_col - col < 16:
            out += bytes([head | (col >> 3) << 3, (col & 7) << 4 | (end_col - col)])  # short
            return
        if 0 <= delta < 3 and col < 128 and end_col < 128:
            out += bytes([head | (10 + delta) << 3, col, end_col])  # one line
            state.line = line
            return
    out.append(head | 14 << 3)  # long form
    _write_signed_varint(out, delta)
    _write_varint(out, end_line - line)
    _write_varint(out, col + 1)
    _write_varint(out, end_col + 1)
    state.line = line


def stack_effect(name: str, arg: int | None, jump: bool) -> int:
    """`dis.stack_effect` by name; jumps created without an arg count as arg 0.

    RETURN_GENERATOR counts as pushing the value its first resumption receives (popped by the
    POP_TOP after it): CPython inserts that prologue after its own depth analysis."""
    if name == "RETURN_GENERATOR":
        return 1
    return dis.stack_effect(dis.opmap[name], (arg or 0) if has_arg(name) else None, jump=jump)


def _stack_analysis(
    insts: list[Instruction], opnames: list[str], index_of: dict[int, int]
) -> tuple[list[int | None], int]:
    """Depth before each reachable instruction and the maximum ever reached, following
    fall-through, jump and exception edges from the first instruction."""
    depths: list[int | None] = [None] * len(insts)
    work: list[int] = []
    max_depth = 0

    def reach(index: int, depth: int, source: Instruction) -> None:
        if index >= len(insts) or depth < 0:
            raise AssemblyError(f"control runs off the end or underflows after {source!r}")
        if depths[index] is None:
            depths[index] = depth
            work.append(index)
        elif depths[index] != depth:
            raise AssemblyError(
                f"{insts[index]!r} is reached with stack depths {depths[index]} and {depth}"
            )

    if insts:
        reach(0, 0, insts[0])
    while work:
        i = work.pop()
        inst, name, depth = insts[i], opnames[i], depths[i]
        assert depth is not None
        if inst.handler is not None:
            handler_depth = inst.handler.depth + int(inst.handler.lasti) + 1
            max_depth = max(max_depth, handler_depth)
            reach(index_of[id(inst.handler.target)], handler_depth, inst)
        if inst.target is not None:
            jumped = depth + stack_effect(name, inst.arg, jump=True)
            max_depth = max(max_depth, jumped)
            reach(index_of[id(inst.target)], jumped, inst)
        after = depth + stack_effect(name, inst.arg, jump=False)
        max_depth = max(max_depth, after)
        if name not in TERMINATOR_OPNAMES:
            reach(i + 1, after, inst)
    return depths, max_depth
