"""The loop-level IR: kernels as scalar expression DAGs over one or two flat loop variables.

A :class:`Kernel` iterates ``x`` over ``xnumel`` positions (rows, for a reduction kernel) and,
for a reduction kernel, ``r`` over ``rnumel`` positions of each row. Its body is a set of
:class:`Store`s whose values are DAGs of :class:`Expr`: loads at :class:`~kiln.schedule.index.Index`
offsets, constants, elementwise ops (the elementwise prims' :class:`~kiln.ir.op.Op` members, so
the code generators print the same vocabulary the IR has), reductions over ``r`` and random
numbers. A value that depends on ``r`` is row-shaped; a :class:`Reduce` removes the ``r``
dependence, so a softmax kernel reads its row, reduces (max), reduces again (sum of exp) and
stores the normalized row, with every intermediate in registers::

    kernel softmax_0: x < 4096, r < 1024
      t0 = load(arg0, 1024*x + r)
      t1 = reduce max(t0)
      t2 = exp(t0 - t1)
      store(buf0, 1024*x + r, t2 / reduce sum(t2))

Nothing here knows Triton or C++: ``kiln/codegen`` prints kernels for a device.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.ir.op import Op
from kiln.ir.symbolic import Dim, Sym, Symbol, printing_sizes
from kiln.schedule.index import Index, format_index, index_sizes, magnitude

X = "x"  # the name of the row (or element) loop variable
R = "r"  # the name of the reduction loop variable


class ReduceKind(enum.Enum):
    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    ARGMAX = "argmax"
    ARGMIN = "argmin"


class BufferKind(enum.Enum):
    INPUT = "input"  # a graph input, passed in by the caller (any strides)
    TEMP = "temp"  # allocated by the program (contiguous), maybe reused
    EXTERN = "extern"  # returned by an extern call (strides as PyTorch chose)


@dataclass(eq=False)
class Buffer:
    """Memory a kernel reads or writes: its element type, size and (for inputs and extern
    results) the strides observed when the program was built."""

    name: str
    shape: tuple[Dim, ...]
    dtype: torch.dtype
    device: torch.device
    kind: BufferKind
    strides: tuple[Dim, ...] = ()
    offset: Dim = 0

    @property
    def numel(self) -> Dim:
        total: Dim = 1
        for size in self.shape:
            total *= size
        return total

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True, eq=False)
class Expr:
    dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class Const(Expr):
    value: bool | int | float


@dataclass(frozen=True, eq=False)
class IndexValue(Expr):
    """An index expression used as a value (iota, positions)."""

    index: Index


@dataclass(frozen=True, eq=False)
class Load(Expr):
    """``buffer[offset]`` (offset in elements); where ``mask`` is false the value is ``other``."""

    buffer: Buffer
    offset: Index
    mask: Expr | None = None
    other: bool | int | float = 0


@dataclass(frozen=True, eq=False)
class Apply(Expr):
    """An elementwise prim (``Op.ADD``, ``Op.WHERE``, ``Op.CONVERT`` to ``dtype``, ...)."""

    op: Op
    args: tuple[Expr, ...]


@dataclass(frozen=True, eq=False)
class Reduce(Expr):
    """A reduction of a row-shaped ``value`` over ``r``. ARGMAX/ARGMIN give the first position
    (``r``) of the extreme, as int64. Math runs in ``dtype`` (fp32 for 16-bit floats)."""

    kind: ReduceKind
    value: Expr


@dataclass(frozen=True, eq=False)
class Rand(Expr):
    """A float32 uniform [0, 1) (or standard normal) number: a pure function of the graph's
    int64 seed (the 0-d CPU tensor ``seed``: C++ kernels take it as a scalar argument, Triton
    kernels load it from a copy on their device) and the element's ``offset`` in the stream
    (Philox-4x32-10 keyed by the seed, counter = offset)."""

    seed: Buffer
    offset: Index
    normal: bool = False


@dataclass(eq=False)
class Store:
    buffer: Buffer
    offset: Index
    value: Expr


class KernelKind(enum.Enum):
    POINTWISE = "pointwise"
    REDUCTION = "reduction"


@dataclass(eq=False)
class Kernel:
    """One fused loop nest. ``fused`` lists the graph nodes it computes (``op  file:line``).

    ``parts``: independent kernels launched with this one (``kiln/schedule/combine.py``),
    each over its own positions; none reads what another writes. Their buffers are this
    kernel's arguments too, after its own."""

    name: str
    xnumel: Dim
    rnumel: Dim
    stores: list[Store]
    fused: list[str] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    parts: list[Kernel] = field(default_factory=list)

    @property
    def kind(self) -> KernelKind:
        return (
            KernelKind.REDUCTION if self.rnumel > 1 or self.has_reduce() else KernelKind.POINTWISE
        )

    def has_reduce(self) -> bool:
        return any(isinstance(e, Reduce) for e in walk([s.value for s in self.stores]))

    def reads(self) -> list[Buffer]:
        """The buffers its loads (and its parts') read, in order of first appearance."""
        seen: dict[int, Buffer] = {}
        for expr in walk([s.value for s in self.stores]):
            if isinstance(expr, Load):
                seen.setdefault(id(expr.buffer), expr.buffer)
        for part in self.parts:
            for buffer in part.reads():
                seen.setdefault(id(buffer), buffer)
        return list(seen.values())

    def seed(self) -> Buffer | None:
        """The seed input when the kernel draws random numbers (an argument after the tensors)."""
        for expr in walk([s.value for s in self.stores]):
            if isinstance(expr, Rand):
                return expr.seed
        return next((seed for seed in (p.seed() for p in self.parts) if seed is not None), None)

    def writes(self) -> list[Buffer]:
        """The buffers it stores to (and its parts', after its own)."""
        seen: dict[int, Buffer] = {}
        for store in self.stores:
            seen.setdefault(id(store.buffer), store.buffer)
        for part in self.parts:
            for buffer in part.writes():
                seen.setdefault(id(buffer), buffer)
        return list(seen.values())


def children(expr: Expr) -> tuple[Expr, ...]:
    """The operand expressions of ``expr``, including index values inside its offsets."""
    if isinstance(expr, Apply):
        return expr.args
    if isinstance(expr, Reduce):
        return (expr.value,)
    if isinstance(expr, Load):
        found = [atom.value for atom in expr.offset.indirects()]
        return (*found, expr.mask) if expr.mask is not None else tuple(found)
    if isinstance(expr, Rand):
        return tuple(atom.value for atom in expr.offset.indirects())
    if isinstance(expr, IndexValue):
        return tuple(atom.value for atom in expr.index.indirects())
    return ()


def walk(
    roots: list[Expr], into_reduces: bool = True, left_to_right: bool = False
) -> Iterator[Expr]:
    """Every expression reachable from ``roots``, each once, operands before users.
    ``into_reduces=False`` yields a :class:`Reduce` without its operand (what one ``r`` loop
    computes when the reduction finished in an earlier loop); ``left_to_right`` visits
    operands in order (generated source then reads in the IR's order)."""
    done: set[int] = set()
    for root in roots:
        stack: list[tuple[Expr, bool]] = [(root, False)]
        while stack:
            expr, expanded = stack.pop()
            if id(expr) in done:
                continue
            if expanded or (isinstance(expr, Reduce) and not into_reduces):
                done.add(id(expr))
                yield expr
                continue
            stack.append((expr, True))
            operands = children(expr)
            ordered = reversed(operands) if left_to_right else operands
            stack.extend((c, False) for c in ordered if id(c) not in done)


def index_of(expr: Expr) -> list[Index]:
    """The index expressions ``expr`` itself uses (not its operands')."""
    if isinstance(expr, Load):
        return [expr.offset]
    if isinstance(expr, Rand):
        return [expr.offset]
    if isinstance(expr, IndexValue):
        return [expr.index]
    return []


def index_magnitudes(kernel: Kernel) -> list[Dim]:
    """The :func:`~kiln.schedule.index.magnitude` of every index ``kernel`` evaluates (loads,
    random offsets, index values, store offsets): a code generator uses 64-bit index math
    when one, or its own loop extents, passes ``INT32_LIMIT``."""
    roots = [store.value for store in kernel.stores]
    found = [magnitude(index) for expr in walk(roots) for index in index_of(expr)]
    return found + [magnitude(store.offset) for store in kernel.stores]


def kernel_symbols(kernel: Kernel) -> tuple[Symbol, ...]:
    """The size symbols ``kernel`` (with its parts) is written in, by name: its extents, and
    the sizes, coefficients and divisors of its indices. Generated code takes their values as
    arguments, after the pointers and the seed."""
    sizes: list[Any] = []
    for part in (kernel, *kernel.parts):
        sizes += [part.xnumel, part.rnumel]
        indices = [store.offset for store in part.stores]
        indices += [i for e in walk([s.value for s in part.stores]) for i in index_of(e)]
        for index in indices:
            sizes += index_sizes(index)
    found = {s.name: s for size in sizes if isinstance(size, Sym) for s in size.symbols()}
    return tuple(found[name] for name in sorted(found, key=lambda n: (len(n), n)))


def checks_indices(kernel: Kernel) -> bool:
    """Whether the kernel (or a part launched with it) reads through a checked gathered index,
    whose generated code reports an index outside its dimension."""
    for part in (kernel, *kernel.parts):
        offsets = [store.offset for store in part.stores]
        offsets += [i for e in walk([s.value for s in part.stores]) for i in index_of(e)]
        if any(atom.checked for offset in offsets for atom in offset.indirects()):
            return True
    return False


def depends_on_r(exprs: list[Expr]) -> dict[int, bool]:
    """For every expression reachable from ``exprs``: whether it varies along ``r``."""
    result: dict[int, bool] = {}
    for expr in walk(exprs):
        if isinstance(expr, Reduce):
            result[id(expr)] = False
            continue
        uses_r = any(R in index.variables() for index in index_of(expr))
        result[id(expr)] = uses_r or any(result[id(c)] for c in children(expr))
    return result


def reduction_phase(exprs: list[Expr]) -> dict[int, int]:
    """For every expression: how many nested reductions must finish before it can be
    computed (a value read straight from memory is phase 0; softmax's sum is phase 1)."""
    phase: dict[int, int] = {}
    for expr in walk(exprs):
        below = max((phase[id(c)] for c in children(expr)), default=0)
        phase[id(expr)] = below + 1 if isinstance(expr, Reduce) else below
    return phase


def format_kernel(kernel: Kernel, buffer_name: Callable[[Buffer], str] | None = None) -> str:
    """A readable listing of ``kernel`` (for explain, logs and tests). With ``buffer_name``
    (buffers by argument position, say) it is the kernel's signature instead: the kernel's own
    name left out, each value's dtype and each gathered index's checks printed, so kernels
    with equal signatures compile to the same code."""
    signature = buffer_name is not None
    buffer_text = buffer_name or (lambda buffer: buffer.name)
    with printing_sizes(repr):  # (symbolic sizes as written, never specialized)
        return _format_kernel(kernel, signature, buffer_text)


def _format_kernel(kernel: Kernel, signature: bool, buffer_text: Callable[[Buffer], str]) -> str:
    names: dict[int, str] = {}

    def name(expr: Expr) -> str:
        return names[id(expr)]

    def atom(a: Any) -> str:
        if hasattr(a, "name"):
            return str(a.name)
        flags = ("!" if a.checked else "") + ("w" if a.wrapped else "") if signature else ""
        return name(a.value) + flags

    def idx(index: Index) -> str:
        return format_index(index, atom)

    title = "kernel" if signature else f"kernel {kernel.name}"
    lines = [f"{title}: x < {kernel.xnumel}, r < {kernel.rnumel}"]
    for expr in walk([s.value for s in kernel.stores]):
        names[id(expr)] = f"t{len(names)}"
        typed = f"  : {expr.dtype}" if signature else ""
        lines.append(f"  {name(expr)} = {_describe(expr, name, idx, buffer_text)}{typed}")
    for store in kernel.stores:
        target = buffer_text(store.buffer) + (f": {store.buffer.dtype}" if signature else "")
        lines.append(f"  store({target}, {idx(store.offset)}, {name(store.value)})")
    for part in kernel.parts:
        lines.append("  and, in the same launch:")
        listing = _format_kernel(part, signature, buffer_text)
        lines += ["  " + line for line in listing.splitlines()]
    return "\n".join(lines)


def _describe(expr: Expr, name: Any, idx: Any, buffer_text: Any) -> str:
    if isinstance(expr, Const):
        return repr(expr.value)
    if isinstance(expr, IndexValue):
        return f"index({idx(expr.index)})"
    if isinstance(expr, Load):
        masked = f", mask={name(expr.mask)}, other={expr.other!r}" if expr.mask else ""
        return f"load({buffer_text(expr.buffer)}, {idx(expr.offset)}{masked})"
    if isinstance(expr, Apply):
        args = ", ".join(name(a) for a in expr.args)
        return f"{expr.op.printed_name}({args})" + (
            f" -> {expr.dtype}" if expr.op is Op.CONVERT else ""
        )
    if isinstance(expr, Reduce):
        return f"reduce_{expr.kind.value}({name(expr.value)})"
    if isinstance(expr, Rand):
        kind = "randn" if expr.normal else "rand"
        return f"{kind}(seed, {idx(expr.offset)})"
    raise TypeError(type(expr).__name__)
