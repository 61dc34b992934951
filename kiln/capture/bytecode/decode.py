"""A version-neutral view of CPython 3.11-3.13 bytecode: decode a code object into a list of
`Instruction`s whose jumps and exception handlers point at other instructions.

CPython's raw encoding changes every minor version (opcode numbers, inline CACHE counts, jump
direction variants, NULL order), but a transform only wants "this instruction jumps to that one,
and that one handles its exceptions".  `decode` gives exactly that, and
`kiln.capture.bytecode.assembler.assemble` turns such a list back into a code object,
recomputing every offset, so instructions can be inserted or removed freely::

    >>> insts = decode(f.__code__)            # CACHE / EXTENDED_ARG gone, args folded
    >>> insts[k].target                       # an Instruction, not a byte offset
    >>> insts[k].handler                      # Handler(target=Instruction, depth=1, lasti=False)
    >>> assemble(insts, f.__code__).co_code == f.__code__.co_code
    True

This module never imports torch: it is exercised on interpreters that have none.
"""

from __future__ import annotations

import dis
import opcode
import sys
from dataclasses import dataclass
from types import CodeType
from typing import Any, NamedTuple

PY_VERSION: tuple[int, int] = (sys.version_info.major, sys.version_info.minor)
if not (3, 11) <= PY_VERSION <= (3, 13):
    raise ImportError(f"kiln.capture.bytecode supports CPython 3.11-3.13, not {sys.version}")

# 3.12+ lists the opcodes that take an argument; 3.11 still uses the HAVE_ARGUMENT split.
_HAS_ARG: frozenset[int] = frozenset(getattr(opcode, "hasarg", range(opcode.HAVE_ARGUMENT, 256)))
# Inline CACHE counts: a list indexed by opcode in 3.11/3.12, a dict keyed by name in 3.13.
_CACHE_TABLE: Any = getattr(opcode, "_inline_cache_entries", {})
JUMP_OPNAMES: frozenset[str] = frozenset(dis.opname[op] for op in dis.hasjrel + dis.hasjabs)
# Backward jumps subtract their argument; every other relative jump adds it.
BACKWARD_JUMP_OPNAMES: frozenset[str] = frozenset(n for n in JUMP_OPNAMES if "BACKWARD" in n)
# After these control never reaches the next instruction.
TERMINATOR_OPNAMES: frozenset[str] = frozenset(
    {
        "RETURN_VALUE",
        "RETURN_CONST",
        "RAISE_VARARGS",
        "RERAISE",
        "JUMP",
        "JUMP_NO_INTERRUPT",
        "JUMP_FORWARD",
        "JUMP_BACKWARD",
        "JUMP_BACKWARD_NO_INTERRUPT",
    }
)
# 3.13 superinstructions that pack two local indices into one argument: (hi << 4) | lo.
PACKED_LOCAL_OPNAMES: frozenset[str] = frozenset(
    {"LOAD_FAST_LOAD_FAST", "STORE_FAST_LOAD_FAST", "STORE_FAST_STORE_FAST"}
)
# Instructions whose argument indexes the "localsplus" array (varnames, cells, freevars).
LOCAL_OPNAMES: frozenset[str] = frozenset(
    dis.opname[op] for op in dis.haslocal + dis.hasfree if op < 256
) - {"STORE_FAST_MAYBE_NULL"}


@dataclass(frozen=True)
class Handler:
    """The exception-table entry covering an instruction: where to jump, the stack depth to
    unwind to, and whether the offset of the raising instruction is pushed too (``lasti``).
    Equality compares the target by identity, so runs of equal handlers can be merged."""

    target: Instruction
    depth: int
    lasti: bool


@dataclass(eq=False)
class Instruction:
    """One instruction, with its jump target and exception handler as object references.

    ``arg`` is the folded (EXTENDED_ARG-free) argument; for jumps it is recomputed from
    ``target`` on assembly.  ``argval`` is `dis`'s readable value, informational only.
    ``offset`` is the byte offset of the opcode in the code it was decoded from (None for new
    instructions).  ``positions`` is the source span; None means "no location" unless ``line``
    is set, in which case the assembler records a line-only location.
    """

    opname: str
    arg: int | None = None
    argval: Any = None
    offset: int | None = None
    target: Instruction | None = None
    handler: Handler | None = None
    positions: dis.Positions | None = None
    line: int | None = None

    @property
    def opcode(self) -> int:
        return dis.opmap[self.opname]

    def __repr__(self) -> str:
        arg = "" if self.arg is None else f" {self.arg}"
        val = "" if self.argval is None or self.target is not None else f" ({self.argval!r})"
        to = "" if self.target is None else f" -> {self.target.opname}@{self.target.offset}"
        return f"<{self.opname}{arg}{val}{to} @{self.offset}>"


class ExceptionEntry(NamedTuple):
    """One row of ``co_exceptiontable`` in byte offsets; ``end`` is exclusive."""

    start: int
    end: int
    target: int
    depth: int
    lasti: bool


def has_arg(opname: str) -> bool:
    """Whether the opcode's argument byte means something (else it is written as 0)."""
    return dis.opmap[opname] in _HAS_ARG


def inline_cache_entries(opname: str) -> int:
    """How many CACHE code units follow ``opname`` in ``co_code`` on this interpreter."""
    if isinstance(_CACHE_TABLE, dict):
        return int(_CACHE_TABLE.get(opname, 0))
    op = dis.opmap.get(opname)
    return int(_CACHE_TABLE[op]) if op is not None and op < len(_CACHE_TABLE) else 0


def localsplus_names(
    varnames: tuple[str, ...] | list[str],
    cellvars: tuple[str, ...] | list[str],
    freevars: tuple[str, ...] | list[str],
) -> list[str]:
    """The names of the frame's "localsplus" slots, which LOAD_FAST/LOAD_DEREF/MAKE_CELL index.

    Mirrors how the code constructor lays them out: varnames first; a cell that is also a
    varname (a captured argument) shares that varname's slot; other cells next; freevars last.
    """
    names = list(varnames)
    names += [c for c in cellvars if c not in names]
    return names + list(freevars)


def code_localsplus(code: CodeType) -> list[str]:
    return localsplus_names(code.co_varnames, code.co_cellvars, code.co_freevars)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """Big-endian 6-bit chunks, bit 6 = "more follows" (bit 7 marks an entry's first byte)."""
    byte = data[pos]
    value = byte & 63
    while byte & 64:
        pos += 1
        byte = data[pos]
        value = (value << 6) | (byte & 63)
    return value, pos + 1


def exception_table(code: CodeType) -> list[ExceptionEntry]:
    """Parse ``co_exceptiontable`` (same varint format in 3.11-3.13) into byte-offset rows."""
    data, pos, entries = code.co_exceptiontable, 0, []
    while pos < len(data):
        start, pos = _read_varint(data, pos)
        length, pos = _read_varint(data, pos)
        target, pos = _read_varint(data, pos)
        depth_lasti, pos = _read_varint(data, pos)
        entries.append(
            ExceptionEntry(
                2 * start, 2 * (start + length), 2 * target, depth_lasti >> 1, bool(depth_lasti & 1)
            )
        )
    return entries


def jump_target_offset(opname: str, op_offset: int, arg: int) -> int:
    """Byte offset a relative jump lands on: counted from the end of its inline caches."""
    after = op_offset + 2 + 2 * inline_cache_entries(opname)
    return after - 2 * arg if opname in BACKWARD_JUMP_OPNAMES else after + 2 * arg


def decode(code: CodeType) -> list[Instruction]:
    """Decode ``code`` into instructions with virtual jump targets and handlers.

    CACHE units are dropped, EXTENDED_ARG prefixes are folded into their instruction's ``arg``,
    and a jump (or exception entry) that lands on an EXTENDED_ARG lands on the instruction it
    prefixes.
    """
    raw, positions = code.co_code, list(code.co_positions())
    argvals = {i.offset: i.argval for i in dis.get_instructions(code)}
    instructions: list[Instruction] = []
    starts: list[int] = []  # byte offset of each instruction's first unit (its EXTENDED_ARGs)
    by_offset: dict[int, Instruction] = {}
    extended, start, pos = 0, 0, 0
    while pos < len(raw):
        name = dis.opname[raw[pos]]
        if name == "EXTENDED_ARG":
            extended = (extended | raw[pos + 1]) << 8
            pos += 2
            continue
        arg = extended | raw[pos + 1] if raw[pos] in _HAS_ARG else None
        where = positions[pos // 2]
        inst = Instruction(
            name,
            arg,
            argvals.get(pos),
            pos,
            positions=dis.Positions(*where) if any(p is not None for p in where) else None,
            line=where[0],
        )
        instructions.append(inst)
        starts.append(start)
        by_offset[start] = by_offset[pos] = inst
        pos += 2 + 2 * inline_cache_entries(name)
        extended, start = 0, pos
    for inst in instructions:
        if inst.opname in JUMP_OPNAMES:
            assert inst.offset is not None and inst.arg is not None
            inst.target = by_offset[jump_target_offset(inst.opname, inst.offset, inst.arg)]
    _attach_handlers(code, instructions, starts, by_offset)
    return instructions


def _attach_handlers(
    code: CodeType,
    instructions: list[Instruction],
    starts: list[int],
    by_offset: dict[int, Instruction],
) -> None:
    """Give each instruction the entry covering its first unit; CPython writes the rows sorted
    and disjoint, so one pass over both lists suffices."""
    index = 0
    for entry in exception_table(code):
        handler = Handler(by_offset[entry.target], entry.depth, entry.lasti)
        while index < len(starts) and starts[index] < entry.start:
            index += 1
        while index < len(starts) and starts[index] < entry.end:
            instructions[index].handler = handler
            index += 1


def extended_arg_count(arg: int | None) -> int:
    """How many EXTENDED_ARG prefixes an argument needs (one per byte beyond the first)."""
    if arg is None or arg < 0x100:
        return 0
    return 1 if arg < 0x10000 else 2 if arg < 0x1000000 else 3


def find_instruction(instructions: list[Instruction], offset: int) -> int:
    """Index of the decoded instruction at byte ``offset`` (its opcode or EXTENDED_ARG start)."""
    for index, inst in enumerate(instructions):
        if inst.offset is not None and inst.offset >= offset:
            if inst.offset - 2 * extended_arg_count(inst.arg) <= offset:
                return index
            break
    raise ValueError(f"no instruction starts at byte offset {offset}")
