"""Index arithmetic of the loop-level IR: integer expressions over loop variables.

An :class:`Index` is ``const + sum(coef * atom)`` where an atom is a loop variable
(:class:`Var`, ``0 <= v < size``), a floor division or a modulo of an index by a positive
constant, or an :class:`Indirect` index read from a tensor inside the kernel (gather).
Construction simplifies as it goes, so views compose into short expressions::

    x = Var("x", 12)
    i0, i1 = decompose(x, (3, 4))        # x // 4, x % 4
    linear((i0, i1), (4, 1))             # x            (split then joined again: no arithmetic)
    linear((i1, i0), (3, 1))             # 3*(x % 4) + x // 4   (a transpose)

The rules are few and sound for non-negative operands: bounds decide ``e // k == 0`` and
``e % k == e``; terms whose coefficient divides by ``k`` leave a modulo and move out of a
division; ``(e // a) // b == e // (a*b)``; and ``c*k*(e // k) + c*(e % k) == c*e``.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from kiln.ir.symbolic import Dim, Sym, env_memo

T = TypeVar("T")


@dataclass(frozen=True)
class Var:
    """A loop variable ranging over ``0 <= name < size``."""

    name: str
    size: Dim


class _Keyed:
    """Keys of an immutable atom or index, computed once (``cached_property`` writes the
    instance's ``__dict__``, which a frozen dataclass allows): sorting and merging terms and
    the memo's lookups ask for them again and again. With :func:`memo_scope`, ResNet-50's
    training step scheduled in 0.88 s against 1.10 with recomputed keys (1.26 without both)."""

    @cached_property
    def merge_key(self) -> tuple[Any, ...]:
        return self._key(False)

    @cached_property
    def order_key(self) -> tuple[Any, ...]:
        return self._key(True)

    @cached_property
    def full_key(self) -> tuple[Any, ...]:
        return self._full()

    def _key(self, order: bool) -> tuple[Any, ...]:
        raise NotImplementedError

    def _full(self) -> tuple[Any, ...]:
        raise NotImplementedError


@dataclass(frozen=True)
class FloorDiv(_Keyed):
    operand: Index
    divisor: Dim

    def _key(self, order: bool) -> tuple[Any, ...]:
        return (1, size_key(self.divisor), _index_key(self.operand, order))

    def _full(self) -> tuple[Any, ...]:
        return (1, size_key(self.divisor), self.operand.full_key)


@dataclass(frozen=True)
class Mod(_Keyed):
    operand: Index
    divisor: Dim

    def _key(self, order: bool) -> tuple[Any, ...]:
        return (2, size_key(self.divisor), _index_key(self.operand, order))

    def _full(self) -> tuple[Any, ...]:
        return (2, size_key(self.divisor), self.operand.full_key)


_SERIALS = itertools.count()  # creation order of Indirect atoms


@dataclass(frozen=True, eq=False)
class Indirect:
    """An index value computed in the kernel (an int64 expression of the loop-level IR). The
    lowering keeps it in ``0 <= value < size`` itself (a clamp under a mask), or, when it comes
    from the program's data (a gather's index tensor, negatives wrapped), marks it ``checked``:
    the generated code then tests the bound, as eager does, instead of reading outside."""

    value: Any  # kiln.schedule.loops.Expr (not imported: loops imports this module)
    size: Dim
    checked: bool = False
    wrapped: bool = False  # (negatives had ``size`` added: one still below 0 was below -size)
    # Orders indirect terms by creation, never by address: the same program must print the
    # same kernel source in every process (sources key the kernel caches on disk).
    serial: int = field(default_factory=lambda: next(_SERIALS), compare=False, repr=False)


Atom = Var | FloorDiv | Mod | Indirect


def _atom_key(atom: Atom, order: bool = False) -> tuple[Any, ...]:
    """Equal keys: the same atom (terms merge). ``order``: the key terms are sorted by, where
    an indirect atom counts by creation (deterministic), not by its value's identity."""
    if isinstance(atom, Var):
        return (0, atom.name)
    if isinstance(atom, FloorDiv | Mod):
        return atom.order_key if order else atom.merge_key
    return (3, atom.serial) if order else (3, id(atom.value))


def size_key(size: Dim) -> tuple[int, Any]:
    """A key that compares and orders sizes by their form, never by a guarded question: an
    int by value, a symbolic size by its structure (:class:`Sym`'s key, computed once; its
    text took a fifth of a dynamic ResNet's scheduling)."""
    return (0, size) if isinstance(size, int) else (1, size._key)


def _index_key(index: Index, order: bool = False) -> tuple[Any, ...]:
    return index.order_key if order else index.merge_key


@dataclass(frozen=True)
class Index(_Keyed):
    """``const + sum(coef * atom)``; terms are sorted and have non-zero coefficients."""

    terms: tuple[tuple[Atom, Dim], ...] = ()
    const: Dim = 0

    def _key(self, order: bool) -> tuple[Any, ...]:
        terms = tuple((_atom_key(a, order), size_key(c)) for a, c in self.terms)
        return (size_key(self.const), terms)

    def _full(self) -> tuple[Any, ...]:
        """Equal keys: the same index, loop extents included (``merge_key`` merges terms of a
        variable whatever its extent, and bounds depend on it)."""
        terms = tuple((_full_atom_key(atom), size_key(coef)) for atom, coef in self.terms)
        return (size_key(self.const), terms)

    def __hash__(self) -> int:
        return hash(self.full_key)

    @property
    def is_constant(self) -> bool:
        return not self.terms

    def __add__(self, other: Index | Dim) -> Index:
        other = as_index(other)
        return _make(_merge(self.terms, other.terms), self.const + other.const)

    def __radd__(self, other: Dim) -> Index:
        return self + other

    def __sub__(self, other: Index | Dim) -> Index:
        return self + as_index(other) * -1

    def __mul__(self, factor: Dim) -> Index:
        if factor == 0:
            return Index()
        return Index(tuple((a, c * factor) for a, c in self.terms), self.const * factor)

    __rmul__ = __mul__

    def __floordiv__(self, divisor: Dim) -> Index:
        return floordiv(self, divisor)

    def __mod__(self, divisor: Dim) -> Index:
        return mod(self, divisor)

    def variables(self) -> set[str]:
        names: set[str] = set()
        for atom, _ in self.terms:
            if isinstance(atom, Var):
                names.add(atom.name)
            elif isinstance(atom, (FloorDiv, Mod)):
                names |= atom.operand.variables()
        return names

    def indirects(self) -> list[Indirect]:
        found: list[Indirect] = []
        for atom, _ in self.terms:
            if isinstance(atom, Indirect):
                found.append(atom)
            elif isinstance(atom, (FloorDiv, Mod)):
                found += atom.operand.indirects()
        return found

    def __repr__(self) -> str:
        return format_index(self, lambda atom: repr(atom))


def as_index(value: Index | Dim) -> Index:
    if isinstance(value, Index):
        return value
    return Index((), value if isinstance(value, Sym) else int(value))


def var(name: str, size: Dim) -> Index:
    if size <= 1:
        return Index()
    return Index(((Var(name, size), 1),))


def indirect(value: Any, size: Dim, checked: bool = False, wrapped: bool = False) -> Index:
    return Index(((Indirect(value, size, checked, wrapped), 1),))


def _merge(
    left: tuple[tuple[Atom, Dim], ...], right: tuple[tuple[Atom, Dim], ...]
) -> list[tuple[Atom, Dim]]:
    coefficients: dict[Any, list[Any]] = {}
    for atom, coef in (*left, *right):
        key = _atom_key(atom)
        if key in coefficients:
            coefficients[key][1] += coef
        else:
            coefficients[key] = [atom, coef]
    return [(atom, coef) for atom, coef in coefficients.values() if coef != 0]


def _make(terms: list[tuple[Atom, Dim]], const: Dim) -> Index:
    terms, extra = _recombine(terms)
    terms.sort(key=lambda term: _atom_key(term[0], order=True))
    return Index(tuple(terms), const + extra)


def _recombine(terms: list[tuple[Atom, Dim]]) -> tuple[list[tuple[Atom, Dim]], Dim]:
    """Rewrite ``c*k*(e // k) + c*(e % k)`` as ``c*e`` until no pair is left; returns the
    terms and the constant the rewrites add."""
    extra: Dim = 0
    changed = True
    while changed:
        changed = False
        by_key = {_atom_key(atom): (atom, coef) for atom, coef in terms}
        for atom, coef in terms:
            if not isinstance(atom, Mod):
                continue
            quotient = floordiv(atom.operand, atom.divisor)
            if quotient.const or len(quotient.terms) != 1 or quotient.terms[0][1] != 1:
                continue
            partner = by_key.get(_atom_key(quotient.terms[0][0]))
            if partner is None or partner[1] != coef * atom.divisor:
                continue
            used = (_atom_key(atom), _atom_key(partner[0]))
            rest = tuple(t for t in terms if _atom_key(t[0]) not in used)
            joined = atom.operand * coef
            terms = _merge(rest, joined.terms)
            extra += joined.const
            changed = True
            break
    return terms, extra


def bounds(index: Index) -> tuple[Dim, Dim]:
    """Inclusive ``(low, high)`` of ``index`` over all loop-variable values."""
    if not index.terms:
        return index.const, index.const
    return _memoized("bounds", index, None, lambda: _bounds(index))


def _bounds(index: Index) -> tuple[Dim, Dim]:
    low = high = index.const
    for atom, coef in index.terms:
        atom_low, atom_high = _atom_bounds(atom)
        if coef >= 0:
            low, high = low + coef * atom_low, high + coef * atom_high
        else:
            low, high = low + coef * atom_high, high + coef * atom_low
    return low, high


def _atom_bounds(atom: Atom) -> tuple[Dim, Dim]:
    if isinstance(atom, (Var, Indirect)):
        return 0, max(atom.size - 1, 0)
    low, high = bounds(atom.operand)
    if isinstance(atom, FloorDiv):
        return low // atom.divisor, high // atom.divisor
    if low >= 0 and high < atom.divisor:
        return low, high
    return 0, atom.divisor - 1


_SCOPES = threading.local()  # .memos: the memos of the open memo scopes, innermost last


@contextmanager
def memo_scope() -> Iterator[None]:
    """Memoize index arithmetic outside a symbolic environment (static sizes: results are
    pure functions of the indices' structure) until the scope ends: one program's
    scheduling, whose views ask the same divisions again for every load. ResNet-50's
    training step (batch 8, scheduled as on the GPU) took 0.88 s to schedule against 1.26."""
    memos = _SCOPES.__dict__.setdefault("memos", [])
    memos.append({})
    try:
        yield
    finally:
        memos.pop()


def _memoized(name: str, index: Index, divisor: Dim | None, compute: Callable[[], T]) -> T:
    """``compute()``, kept in the active symbolic environment's memo (``env_memo``), else in
    the innermost :func:`memo_scope`'s, by the structure of ``index`` and ``divisor``: with
    symbolic sizes each is a chain of guarded questions, asked again for every load of the
    same view."""
    memo = env_memo(name)
    if memo is None:
        scopes = _SCOPES.__dict__.get("memos")
        if not scopes:
            return compute()
        memo = scopes[-1].setdefault(name, {})
    key = (index.full_key, None if divisor is None else size_key(divisor))
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def _full_atom_key(atom: Atom) -> tuple[Any, ...]:
    if isinstance(atom, Var):
        return (0, atom.name, size_key(atom.size))
    if isinstance(atom, FloorDiv | Mod):
        return atom.full_key
    return (3, atom.serial, size_key(atom.size), atom.checked, atom.wrapped)


def floordiv(index: Index, divisor: Dim) -> Index:
    return _memoized("floordiv", index, divisor, lambda: _floordiv(index, divisor))


def _floordiv(index: Index, divisor: Dim) -> Index:
    if divisor <= 0:
        raise ValueError(f"floor division by {divisor}")
    if divisor == 1:
        return index
    low, high = bounds(index)
    if low >= 0 and high < divisor:
        return Index()
    whole = [(a, c // divisor) for a, c in index.terms if c % divisor == 0]
    rest = Index(tuple((a, c) for a, c in index.terms if c % divisor != 0), index.const)
    rest_low, rest_high = bounds(rest)
    if whole and rest_low >= 0 and rest_high < divisor:
        return _make(whole, 0)
    if whole and rest.const % divisor == 0 and not rest.terms:
        return _make(whole, rest.const // divisor)
    if low < 0:
        raise ValueError(f"floor division of a possibly negative index {index}")
    factored = _factor(index, divisor)
    if factored is not None:
        major, _, factor = factored
        return floordiv(major, divisor // factor)
    if len(index.terms) == 1 and index.const == 0 and index.terms[0][1] == 1:
        atom = index.terms[0][0]
        if isinstance(atom, FloorDiv):
            return floordiv(atom.operand, atom.divisor * divisor)
    return Index(((FloorDiv(index, divisor), 1),))


def mod(index: Index, divisor: Dim) -> Index:
    return _memoized("mod", index, divisor, lambda: _mod(index, divisor))


def _mod(index: Index, divisor: Dim) -> Index:
    if divisor <= 0:
        raise ValueError(f"modulo by {divisor}")
    if divisor == 1:
        return Index()
    kept = Index(tuple((a, c) for a, c in index.terms if c % divisor != 0), index.const % divisor)
    low, high = bounds(kept)
    if low >= 0 and high < divisor:
        return kept
    if bounds(index)[0] < 0:
        raise ValueError(f"modulo of a possibly negative index {index}")
    factored = _factor(kept, divisor)
    if factored is not None:
        major, minor, factor = factored
        return mod(major, divisor // factor) * factor + minor
    return Index(((Mod(kept, divisor), 1),))


def _factor(index: Index, divisor: Dim) -> tuple[Index, Index, int] | None:
    """``(major, minor, g)`` with ``index == g * major + minor``, ``g > 1`` dividing
    ``divisor`` and ``0 <= minor < g``: then ``index // divisor == major // (divisor // g)``
    and ``index % divisor == g * (major % (divisor // g)) + minor``. A channels-last row of
    64 read as ``(64*r + x) // 1024`` with ``x < 64`` is ``r // 16``."""
    candidates = sorted({_gcd(divisor, c) for _, c in index.terms}, reverse=True)
    for factor in candidates:
        if factor <= 1:
            break
        major_terms = tuple((a, c // factor) for a, c in index.terms if c % factor == 0)
        minor_terms = tuple((a, c) for a, c in index.terms if c % factor != 0)
        minor = Index(minor_terms, index.const % factor)
        low, high = bounds(minor)
        if major_terms and low >= 0 and high < factor:
            return Index(major_terms, index.const // factor), minor, factor
    return None


def _gcd(a: Dim, b: Dim) -> int:
    """A common divisor of two sizes: their greatest for ints; for a symbolic size, what its
    integer coefficients share (``64*s0 + 64`` and ``128``: 64)."""
    return math.gcd(*(_content(n) for n in (a, b)))


def _content(size: Dim) -> int:
    if isinstance(size, Sym):
        return math.gcd(*(abs(coef) for _, coef in size.terms))
    return abs(size)


def product(sizes: Iterable[Dim]) -> Dim:
    total: Dim = 1
    for size in sizes:
        total = total * size
    return total


def contiguous_strides(shape: Sequence[Dim]) -> tuple[Dim, ...]:
    strides: list[Dim] = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


def decompose(flat: Index, shape: Sequence[Dim]) -> tuple[Index, ...]:
    """The multi-index of row-major position ``flat`` in ``shape``."""
    if 0 in shape:  # no positions: the loops never run
        return tuple(Index() for _ in shape)
    strides = contiguous_strides(shape)
    return tuple(
        Index() if size == 1 else mod(floordiv(flat, stride), size) if i else floordiv(flat, stride)
        for i, (size, stride) in enumerate(zip(shape, strides, strict=True))
    )


def linear(indices: Sequence[Index], strides: Sequence[Dim], offset: Dim = 0) -> Index:
    """``offset + sum(index_i * stride_i)``."""
    total = as_index(offset)
    for index, stride in zip(indices, strides, strict=True):
        total = total + index * stride
    return total


INT32_LIMIT = 2**31 - 1


def magnitude(index: Index) -> Dim:
    """An upper bound of ``|value|`` of ``index``, of every partial sum while it is evaluated
    term by term, and of the operands of its floor-divisions and modulos. Atoms count at
    their exclusive bounds (a loop variable of extent ``n`` as ``n``): index math whose
    magnitude is at most ``INT32_LIMIT`` can run in int32, one-past-the-end included."""
    return max(_magnitudes(index))


def _magnitudes(index: Index) -> tuple[Dim, Dim]:
    """(a bound of ``|value|`` and of every partial sum of ``index``, a bound of everything
    evaluated inside its atoms). A floor-division's quotient is bounded by its operand's
    value, not by what the operand's own atoms evaluate: ``(x // 64 % 112 + 1) // 2`` is at
    most 57 however long ``x`` runs (counting ``x`` there made a max pool's gradient over 51M
    elements run its index math in int64, 24% of copy speed on an H200)."""
    total: Dim = abs(index.const)
    worst: Dim = 0
    for atom, coef in index.terms:
        if isinstance(atom, (Var, Indirect)):
            size = atom.size
        else:
            value, inner = _magnitudes(atom.operand)
            worst = max(worst, value, inner)
            size = value // atom.divisor + 1 if isinstance(atom, FloorDiv) else atom.divisor
        total += abs(coef) * size
    return total, worst


def index_sizes(index: Index) -> list[Dim]:
    """Every size ``index`` is written in: its constant, coefficients, loop extents and
    divisors (a symbolic one names symbols the generated code must be given)."""
    sizes: list[Dim] = [index.const]
    for atom, coef in index.terms:
        sizes.append(coef)
        if isinstance(atom, (Var, Indirect)):
            sizes.append(atom.size)
        else:
            sizes += [atom.divisor, *index_sizes(atom.operand)]
    return sizes


def format_index(index: Index, name_of: Any) -> str:
    """Source text of ``index``; ``name_of(atom)`` prints variables and indirect atoms."""
    parts: list[str] = []
    for atom, coef in index.terms:
        if isinstance(atom, (FloorDiv, Mod)):
            inner = format_index(atom.operand, name_of)
            if len(atom.operand.terms) + bool(atom.operand.const) > 1 or "*" in inner:
                inner = f"({inner})"
            divisor = f"({atom.divisor})" if isinstance(atom.divisor, Sym) else atom.divisor
            text = f"({inner} {'//' if isinstance(atom, FloorDiv) else '%'} {divisor})"
        else:
            text = name_of(atom)
        if isinstance(coef, Sym):  # (its text may be a sum)
            parts.append(f"({coef})*{text}")
        elif coef == 1:
            parts.append(text)
        else:
            parts.append(f"{coef}*{text}" if coef > 0 else f"({coef})*{text}")
    if index.const or not parts:
        parts.append(str(index.const))
    return " + ".join(parts)
