"""Symbolic sizes: integer expressions over size symbols, decided by guards.

A :class:`Sym` is a polynomial with integer coefficients whose atoms are :class:`Symbol`s
(``s0``: a dim of an input tensor) and floor divisions or modulos of two expressions. Every
expression knows its *hint*, its value for the sizes of the call being captured. Arithmetic
builds expressions; a question about one (``s0 == 1``, ``n < 1024``, ``bool(n % 2)``) is
answered, in order:

1. from what every size is known to be (a symbol is at least 2, since sizes 0 and 1 are
   specialized, and at most its declared maximum), when that decides it for *all* sizes;
2. otherwise from the hint, recording the answer as a guard (``s0 - 1024 < 0``) in the
   active :class:`ShapeEnv`: the compiled code is reused only where the guard holds.

``int(n)`` (``range(n)``, ``math.sqrt(n)``, a size printed into a string) specializes: the
guard ``n == hint`` keeps the code to that value. With no active environment an undecided
question raises :class:`SymbolicDecisionError`, never answering from the hint unguarded.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.errors import KilnError


class SymbolicDecisionError(KilnError):
    """A question about a symbolic size was asked where no guard can record the answer."""


@dataclass(frozen=True)
class Symbol:
    """A size symbol; ``low``/``high`` bound every value it may take (inclusive)."""

    name: str
    hint: int = field(compare=False)
    low: int = field(default=2, compare=False)
    high: int | None = field(default=None, compare=False)

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True, eq=False)
class Division:
    """``numerator // denominator`` (``floor``) or ``numerator % denominator`` (modulo), for a
    non-negative numerator and a positive denominator. Equal by structure (no guard), through
    a key computed once (building expressions sorts and hashes atoms by it: recomputing it
    through nested divisions was most of a dynamic ResNet's compile time)."""

    numerator: Sym
    denominator: Sym
    modulo: bool
    _key: tuple[Any, ...] = field(init=False, repr=False)
    _hash: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        key = (1, self.modulo, self.numerator._key, self.denominator._key)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash(key))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Division) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:  # (rebuilt: a string's hash differs by process)
        return (Division, (self.numerator, self.denominator, self.modulo))

    @property
    def hint(self) -> int:
        n, d = self.numerator.hint, self.denominator.hint
        return n % d if self.modulo else n // d

    def __repr__(self) -> str:
        return f"({self.numerator!r} {'%' if self.modulo else '//'} {self.denominator!r})"


Atom = Symbol | Division
Monomial = tuple[Atom, ...]  # sorted by _atom_key; repeated atoms are powers


def _atom_key(atom: Atom) -> tuple[Any, ...]:
    if isinstance(atom, Symbol):
        return (0, len(atom.name), atom.name)
    return atom._key


def _monomial_hint(monomial: Monomial) -> int:
    value = 1
    for atom in monomial:
        value *= atom.hint
    return value


# A size as a 0-dim traced tensor, for arithmetic with tensors (``x * n``: torch's argument
# parser refuses a Sym as a Number). Set by the frontend that traces (``frontends.proxy``).
as_tensor: Callable[[Sym], Any] | None = None

_OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "pow": operator.pow,
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
}


def _with_tensor(size: Sym, other: Any, name: str, reflected: bool = False) -> Any:
    """``size <op> other`` for a tensor ``other``, on the size as a traced tensor."""
    if as_tensor is None:
        return NotImplemented
    op = _OPERATORS[name]
    value = as_tensor(size)
    return op(other, value) if reflected else op(value, other)


class Sym:
    """A symbolic integer: ``sum(coef * product(atoms))``; see the module docstring."""

    __slots__ = ("_hash", "_key", "hint", "terms")

    terms: tuple[tuple[Monomial, int], ...]
    hint: int

    def __init__(self, terms: Mapping[Monomial, int]) -> None:
        keyed = [
            ((len(mono), tuple(_atom_key(a) for a in mono)), mono, coef)
            for mono, coef in terms.items()
            if coef
        ]
        keyed.sort(key=lambda term: term[0])
        self.terms = tuple((mono, coef) for _, mono, coef in keyed)
        self.hint = sum(coef * _monomial_hint(mono) for mono, coef in self.terms)
        self._key = tuple((key[1], coef) for key, _, coef in keyed)
        self._hash = hash(self._key)

    # --- construction --------------------------------------------------------------------
    @staticmethod
    def symbol(name: str, hint: int, low: int = 2, high: int | None = None) -> Sym:
        return Sym({(Symbol(name, hint, low, high),): 1})

    @staticmethod
    def make(terms: Mapping[Monomial, int]) -> Dim:
        """The expression, or a plain int when it has no symbols."""
        result = Sym(terms)
        return result.constant if result.is_constant else result

    @property
    def is_constant(self) -> bool:
        return all(not mono for mono, _ in self.terms)

    @property
    def constant(self) -> int:
        return sum(coef for mono, coef in self.terms if not mono)

    def symbols(self) -> set[Symbol]:
        found: set[Symbol] = set()
        for mono, _ in self.terms:
            for atom in mono:
                if isinstance(atom, Symbol):
                    found.add(atom)
                else:
                    found |= atom.numerator.symbols() | atom.denominator.symbols()
        return found

    # --- arithmetic ----------------------------------------------------------------------
    def __add__(self, other: Dim) -> Dim:
        if isinstance(other, float):
            return float(self) + other  # type: ignore[return-value]
        if not isinstance(other, int | Sym):
            return NotImplemented
        merged = dict(self.terms)
        for mono, coef in _terms(other):
            merged[mono] = merged.get(mono, 0) + coef
        return Sym.make(merged)

    __radd__ = __add__

    def __neg__(self) -> Dim:
        return Sym.make({mono: -coef for mono, coef in self.terms})

    def __pos__(self) -> Sym:
        return self

    def __sub__(self, other: Dim) -> Dim:
        if isinstance(other, float):
            return float(self) - other  # type: ignore[return-value]
        if not isinstance(other, int | Sym):
            return NotImplemented
        return self + (-other)

    def __rsub__(self, other: Dim) -> Dim:
        if isinstance(other, float):
            return other - float(self)  # type: ignore[return-value]
        return (-self) + other

    def __mul__(self, other: Dim) -> Dim:
        if isinstance(other, float):
            return float(self) * other  # type: ignore[return-value]
        if not isinstance(other, int | Sym):
            return NotImplemented
        product: dict[Monomial, int] = {}
        for left, a in self.terms:
            for right, b in _terms(other):
                mono = tuple(sorted((*left, *right), key=_atom_key))
                product[mono] = product.get(mono, 0) + a * b
        return Sym.make(product)

    __rmul__ = __mul__

    def __floordiv__(self, other: Dim) -> Dim:
        if not isinstance(other, int | Sym):
            return NotImplemented
        return floordiv(self, other)

    def __rfloordiv__(self, other: int) -> Dim:
        return floordiv(other, self)

    def __mod__(self, other: Dim) -> Dim:
        if not isinstance(other, int | Sym):
            return NotImplemented
        return modulo(self, other)

    def __rmod__(self, other: int) -> Dim:
        return modulo(other, self)

    def __truediv__(self, other: Any) -> float:
        return float(self) / other

    def __rtruediv__(self, other: Any) -> float:
        return other / float(self)

    def __abs__(self) -> Dim:
        return self if self >= 0 else -self

    # --- questions (guarded) -------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if isinstance(other, float):  # (against a float: this size's value, specialized)
            return float(self) == other
        if not isinstance(other, int | Sym) or isinstance(other, bool):
            return NotImplemented
        return decide(self - other, "==")

    def __ne__(self, other: object) -> bool:
        if isinstance(other, float):
            return float(self) != other
        if not isinstance(other, int | Sym) or isinstance(other, bool):
            return NotImplemented
        return not decide(self - other, "==")

    def __lt__(self, other: Dim | float) -> bool:
        if isinstance(other, float):
            return float(self) < other
        return decide(self - other, "<")

    def __le__(self, other: Dim | float) -> bool:
        if isinstance(other, float):
            return float(self) <= other
        return decide(self - other - 1, "<")

    def __gt__(self, other: Dim | float) -> bool:
        if isinstance(other, float):
            return float(self) > other
        return decide(other - self, "<")

    def __ge__(self, other: Dim | float) -> bool:
        if isinstance(other, float):
            return float(self) >= other
        return decide(other - self - 1, "<")

    def __bool__(self) -> bool:
        return not decide(self, "==")

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:  # (rebuilt: a string's hash differs by process)
        return (Sym, (dict(self.terms),))

    def same(self, other: object) -> bool:
        """Structural identity (no guard)."""
        return isinstance(other, Sym) and self._hash == other._hash and self._key == other._key

    # --- specialization ------------------------------------------------------------------
    def __index__(self) -> int:
        return specialize(self, "used as a Python int")

    __int__ = __index__

    def __float__(self) -> float:
        return float(specialize(self, "used as a Python float"))

    def __str__(self) -> str:
        printing = _printing()
        if printing is not None:
            return self._printed(*printing)
        return str(specialize(self, "printed"))

    def __format__(self, spec: str) -> str:
        printing = _printing()
        if not spec and printing is not None:
            return self._printed(*printing)
        return format(specialize(self, "formatted"), spec)

    def __round__(self, digits: int | None = None) -> Dim:
        return self if digits is None else round(int(self), digits)

    def __trunc__(self) -> Sym:
        return self

    __floor__ = __ceil__ = __trunc__

    def __pow__(self, exponent: Any) -> Any:
        if isinstance(exponent, int) and not isinstance(exponent, bool) and exponent >= 0:
            result: Dim = 1
            for _ in range(exponent):
                result = result * self
            return result
        return float(self) ** exponent

    def __rpow__(self, base: Any) -> Any:
        return base ** int(self)

    # --- printing and evaluation ---------------------------------------------------------
    def __repr__(self) -> str:
        return self.format(repr)

    def format(self, name_of: Callable[[Symbol], str], floor: str = "//") -> str:
        """Python source computing the value (``name_of`` spells each symbol; ``floor`` the
        floor division of a non-negative numerator: C and C++ write ``/``)."""
        text = ""
        for mono, coef in self.terms:
            factors = [_format_atom(atom, name_of, floor) for atom in mono]
            magnitude = abs(coef)
            if not factors:
                term = str(magnitude)
            else:
                term = "*".join(([str(magnitude)] if magnitude != 1 else []) + factors)
            if not text:
                text = f"-{term}" if coef < 0 else term
            else:
                text += f" - {term}" if coef < 0 else f" + {term}"
        return text or "0"

    def _printed(self, name_of: Callable[[Symbol], str], floor: str) -> str:
        """:meth:`format`, in parentheses unless it is one symbol (code around it may multiply)."""
        text = self.format(name_of, floor)
        alone = len(self.terms) == 1 and self.terms[0][1] == 1 and len(self.terms[0][0]) == 1
        return text if alone and isinstance(self.terms[0][0][0], Symbol) else f"({text})"

    def evaluate(self, values: Mapping[str, int]) -> int:
        total = 0
        for mono, coef in self.terms:
            product = coef
            for atom in mono:
                product *= _evaluate_atom(atom, values)
            total += product
        return total

    def substitute(self, values: Mapping[str, Dim]) -> Dim:
        total: Dim = 0
        for mono, coef in self.terms:
            product: Dim = coef
            for atom in mono:
                if isinstance(atom, Symbol):
                    product = product * values.get(atom.name, Sym({(atom,): 1}))
                else:
                    num = atom.numerator.substitute(values)
                    den = atom.denominator.substitute(values)
                    product = product * (modulo(num, den) if atom.modulo else floordiv(num, den))
            total = total + product
        return total


Dim = int | Sym


def _tensor_aware(dunder: str, name: str, reflected: bool) -> None:
    original = getattr(Sym, dunder)

    def method(self: Sym, other: Any) -> Any:
        if isinstance(other, torch.Tensor):
            return _with_tensor(self, other, name, reflected)
        return original(self, other)

    method.__name__ = dunder
    setattr(Sym, dunder, method)


for _dunder, _name, _reflected in (
    ("__add__", "add", False),
    ("__radd__", "add", True),
    ("__sub__", "sub", False),
    ("__rsub__", "sub", True),
    ("__mul__", "mul", False),
    ("__rmul__", "mul", True),
    ("__truediv__", "truediv", False),
    ("__rtruediv__", "truediv", True),
    ("__floordiv__", "floordiv", False),
    ("__rfloordiv__", "floordiv", True),
    ("__mod__", "mod", False),
    ("__rmod__", "mod", True),
    ("__pow__", "pow", False),
    ("__rpow__", "pow", True),
    ("__eq__", "eq", False),
    ("__ne__", "ne", False),
    ("__lt__", "lt", False),
    ("__le__", "le", False),
    ("__gt__", "gt", False),
    ("__ge__", "ge", False),
):
    _tensor_aware(_dunder, _name, _reflected)


def _terms(value: Dim) -> tuple[tuple[Monomial, int], ...]:
    return value.terms if isinstance(value, Sym) else (((), value),)


def _format_atom(atom: Atom, name_of: Callable[[Symbol], str], floor: str = "//") -> str:
    if isinstance(atom, Symbol):
        return name_of(atom)
    op = "%" if atom.modulo else floor
    numerator, denominator = (e.format(name_of, floor) for e in (atom.numerator, atom.denominator))
    return f"(({numerator}) {op} ({denominator}))"


def _evaluate_atom(atom: Atom, values: Mapping[str, int]) -> int:
    if isinstance(atom, Symbol):
        return values[atom.name]
    n, d = atom.numerator.evaluate(values), atom.denominator.evaluate(values)
    return n % d if atom.modulo else n // d


def _divides(divisor: Dim, value: Dim) -> Dim | None:
    """``value / divisor`` when it divides exactly for every size, else None."""
    if isinstance(divisor, int):
        if all(coef % divisor == 0 for _, coef in _terms(value)):
            return Sym.make({mono: coef // divisor for mono, coef in _terms(value)})
        return None
    if len(divisor.terms) != 1:
        return 1 if divisor.same(value) else None
    ((dmono, dcoef),) = divisor.terms
    quotient: dict[Monomial, int] = {}
    for mono, coef in _terms(value):
        rest = list(mono)
        for atom in dmono:
            if atom not in rest:
                return None
            rest.remove(atom)
        if coef % dcoef:
            return None
        quotient[tuple(rest)] = coef // dcoef
    return Sym.make(quotient)


def floordiv(numerator: Dim, denominator: Dim) -> Dim:
    """``numerator // denominator`` of sizes (a non-negative numerator: guarded if need be)."""
    if isinstance(numerator, int) and isinstance(denominator, int):
        return numerator // denominator
    if isinstance(numerator, int) and numerator < 0 and -numerator <= denominator:
        return -1
    _check_operands(numerator, denominator, "floor division")
    exact = _divides(denominator, numerator)
    if exact is not None:
        return exact
    if isinstance(denominator, int):  # (d*q + r) // d == q + r // d, for 0 <= r
        whole = {m: c // denominator for m, c in _terms(numerator) if c % denominator == 0}
        rest = Sym.make({m: c for m, c in _terms(numerator) if c % denominator})
        if whole and statically(rest, "<") is False:
            return Sym.make(whole) + floordiv(rest, denominator)
    if statically(numerator - denominator, "<"):
        return 0
    return Sym({(Division(_as_sym(numerator), _as_sym(denominator), False),): 1})


def modulo(numerator: Dim, denominator: Dim) -> Dim:
    """``numerator % denominator`` of sizes (a non-negative numerator: guarded if need be)."""
    if isinstance(numerator, int) and isinstance(denominator, int):
        return numerator % denominator
    if isinstance(numerator, int) and numerator < 0 and -numerator <= denominator:
        return numerator + denominator  # (a negative index wrapped: -1 % n == n - 1)
    _check_operands(numerator, denominator, "modulo")
    if _divides(denominator, numerator) is not None:
        return 0
    if isinstance(denominator, int):  # (d*q + r) % d == r % d, for 0 <= r (else r < 0 stays)
        rest = Sym.make({m: c for m, c in _terms(numerator) if c % denominator})
        if isinstance(rest, int):
            return rest % denominator
        if statically(rest, "<") is False:
            numerator = rest
    if statically(numerator - denominator, "<"):
        return numerator
    return Sym({(Division(_as_sym(numerator), _as_sym(denominator), True),): 1})


def _check_operands(numerator: Dim, denominator: Dim, what: str) -> None:
    if denominator <= 0 or numerator < 0:
        raise ValueError(f"symbolic {what} of {numerator!r} by {denominator!r}")


def _as_sym(value: Dim) -> Sym:
    return value if isinstance(value, Sym) else Sym({(): value})


# --- deciding -----------------------------------------------------------------------------
def known_nonnegative(value: Dim) -> bool:
    """Whether ``value >= 0`` for every size each symbol may take: with each symbol written
    ``low + t`` (``t >= 0``) and each division as a non-negative unknown, every coefficient of
    the expanded polynomial is non-negative. Sufficient, not necessary."""
    if isinstance(value, int):
        return value >= 0
    shifted: dict[tuple[Any, ...], int] = {}
    for mono, coef in value.terms:
        # expand prod(low_i + t_i) over the monomial's symbols
        partial: dict[tuple[Any, ...], int] = {(): coef}
        for atom in mono:
            low = atom.low if isinstance(atom, Symbol) else 0
            grown: dict[tuple[Any, ...], int] = {}
            for key, c in partial.items():
                with_t = tuple(sorted((*key, _atom_key(atom))))
                grown[with_t] = grown.get(with_t, 0) + c
                if low:
                    grown[key] = grown.get(key, 0) + c * low
            partial = grown
        for key, c in partial.items():
            shifted[key] = shifted.get(key, 0) + c
    return all(c >= 0 for c in shifted.values())


def _known_upper(value: Dim) -> bool:
    """Whether ``value <= 0`` follows from declared maxima (symbols with ``high``): ``value``
    is increasing in its symbols when every coefficient is non-negative."""
    if isinstance(value, int):
        return value <= 0
    if not all(coef >= 0 or not mono for mono, coef in value.terms):
        return False
    values: dict[str, int] = {}
    for symbol in value.symbols():
        if symbol.high is None:
            return False
        values[symbol.name] = symbol.high
    if any(isinstance(a, Division) for mono, _ in value.terms for a in mono):
        return False
    return value.evaluate(values) <= 0


def statically(value: Dim, relation: str) -> bool | None:
    """``value == 0`` or ``value < 0`` when it holds (or fails) for every size; else None."""
    if isinstance(value, int):
        return value == 0 if relation == "==" else value < 0
    if relation == "==":
        if known_nonnegative(value - 1) or known_nonnegative(-value - 1):
            return False
        return None
    if known_nonnegative(value):
        return False
    if known_nonnegative(-value - 1) or _known_upper(value + 1):
        return True
    return None


def decide(value: Dim, relation: str) -> bool:
    """Whether ``value == 0`` (``relation`` "==") or ``value < 0`` ("<"): statically if that
    holds for every size, else by the hint, recording a guard."""
    if isinstance(value, int):
        return value == 0 if relation == "==" else value < 0
    memo = env_memo("decide")
    if memo is not None:
        known = memo.get((value._key, relation))
        if known is not None:
            return known
    known = statically(value, relation)
    if known is None:
        answer = value.hint == 0 if relation == "==" else value.hint < 0
        env = current_env()
        if env is None:
            raise SymbolicDecisionError(
                f"'{value!r} {relation} 0' depends on the sizes, and nothing records a guard here"
            )
        env.guard(value, relation, answer)
        known = answer
    if memo is not None:
        memo[(value._key, relation)] = known
    return known


def env_memo(name: str) -> dict[Any, Any] | None:
    """The active environment's memo ``name`` (None outside one): reusing a result there is
    sound, its guards being recorded in that environment and its hints that environment's."""
    env = current_env()
    return None if env is None else env.memos.setdefault(name, {})


def specialize(value: Sym, why: str) -> int:
    """``value``'s hint, guarded: the code that used it holds for this value only."""
    env = current_env()
    if env is None:
        raise SymbolicDecisionError(f"{value!r} {why}, and nothing records a guard here")
    env.specialized(value, why)
    return value.hint


# Entries a memo keyed by sizes (a program's, a launcher's, an extern's: one per distinct
# binding) keeps before it starts over, so a server meeting every length stays bounded.
SIZE_MEMO = 1024


def bounded(memo: dict[Any, Any]) -> dict[Any, Any]:
    """``memo``, emptied when it holds ``SIZE_MEMO`` entries (what it held is recomputed)."""
    if len(memo) >= SIZE_MEMO:
        memo.clear()
    return memo


# --- the environment of one capture -------------------------------------------------------
@dataclass(frozen=True)
class Relation:
    """A guard on sizes: ``expression == 0``, ``!= 0``, ``< 0`` or ``>= 0``."""

    expression: Sym
    relation: str  # "==", "!=", "<", ">="
    why: str = field(default="", compare=False)

    def __hash__(self) -> int:
        return hash((self.expression._hash, self.relation))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Relation)
            and self.relation == other.relation
            and self.expression.same(other.expression)
        )

    def holds(self, values: Mapping[str, int]) -> bool:
        value = self.expression.evaluate(values)
        return {"==": value == 0, "!=": value != 0, "<": value < 0, ">=": value >= 0}[self.relation]

    def text(self, name_of: Callable[[Symbol], str] = repr) -> str:
        """Python source of the check, written the way a person would (``s0 > 8``)."""
        expression, relation = self.expression, self.relation
        if all(coef < 0 for mono, coef in expression.terms if mono):
            negated = -expression
            assert isinstance(negated, Sym)
            expression, relation = negated, _FLIPPED[relation]
        constant = expression.constant
        rest = expression - constant
        left = rest.format(name_of) if isinstance(rest, Sym) else str(rest)
        return f"{left} {relation} {-constant}"


_FLIPPED = {"==": "==", "!=": "!=", "<": ">", ">=": "<="}


def pinned(values: Mapping[str, int]) -> tuple[Relation, ...]:
    """The relations that hold for exactly these values of the symbols."""
    return tuple(Relation(_as_sym(Sym.symbol(n, v) - v), "==") for n, v in values.items())


Check = Callable[[Mapping[str, int]], bool]


def relations_check(relations: tuple[Relation, ...], checks: Sequence[Check] = ()) -> Check:
    """One function testing every relation on a binding of the symbols (Python source: a program
    reused for each new size, a token's length in generation, checks fast), then ``checks``."""
    texts = [f"({r.text(lambda symbol: f'v[{symbol.name!r}]')})" for r in relations]
    test = eval(f"lambda v: {' and '.join(texts) or 'True'}")  # (our own relations' text)
    if not checks:
        return test
    return lambda values: test(values) and all(check(values) for check in checks)


@dataclass
class ShapeEnv:
    """The symbols of one capture, where each was read, and the guards decided on them."""

    symbols: dict[str, Sym] = field(default_factory=dict)
    sources: dict[str, list[tuple[Any, int]]] = field(default_factory=dict)  # name -> (src, dim)
    reasons: dict[str, str] = field(default_factory=dict)  # name -> why it is symbolic
    relations: dict[Relation, None] = field(default_factory=dict)
    specializations: list[tuple[str, str]] = field(default_factory=list)  # (expr, why)
    # Decisions only code can test on a binding (PyTorch's attention kernel), by their text
    checks: dict[str, Check] = field(default_factory=dict)
    location: Callable[[], str] = field(default=lambda: "")
    _by_hint: dict[int, str] = field(default_factory=dict)
    memos: dict[str, dict[Any, Any]] = field(default_factory=dict, repr=False, compare=False)
    _names: Iterator[int] = field(default_factory=itertools.count)

    def size(
        self, source: Any, dim: int, hint: int, reason: str, low: int = 2, high: int | None = None
    ) -> Dim:
        """The size of ``source``'s ``dim``: a symbol (shared by every dynamic dim of the same
        size, as eager would broadcast them), or the int itself for sizes 0 and 1."""
        if hint < 2:
            return hint
        name = self._by_hint.get(hint) if low == 2 and high is None else None
        if name is None:
            name = f"s{next(self._names)}"
            self.symbols[name] = Sym.symbol(name, hint, low, high)
            self.reasons[name] = reason
            if low == 2 and high is None:
                self._by_hint[hint] = name
        self.sources.setdefault(name, []).append((source, dim))
        return self.symbols[name]

    def guard(self, value: Sym, relation: str, answer: bool) -> None:
        if relation == "==":
            kept = Relation(value, "==" if answer else "!=", self.location())
        else:
            kept = Relation(value, "<" if answer else ">=", self.location())
        self.relations.setdefault(kept, None)

    def specialized(self, value: Sym, why: str) -> None:
        difference = value - value.hint
        if isinstance(difference, Sym):
            self.guard(difference, "==", True)
        self.specializations.append((repr(value), f"{why} {self.location()}".strip()))

    def binding(self) -> dict[str, int]:
        return {name: sym.hint for name, sym in self.symbols.items()}


class _State(threading.local):
    """Per thread (compiles may run on several): the environments recording guards, and how
    code being generated spells a symbol (:func:`printing_sizes`)."""

    def __init__(self) -> None:
        self.active: list[ShapeEnv] = []
        self.printing: list[tuple[Callable[[Symbol], str], str] | None] = []


_STATE = _State()


def _printing() -> tuple[Callable[[Symbol], str], str] | None:
    printing = _STATE.printing
    return printing[-1] if printing else None


@contextlib.contextmanager
def printing_sizes(name_of: Callable[[Symbol], str] | None, floor: str = "//") -> Iterator[None]:
    """Inside, ``str(size)`` and ``f"{size}"`` print a symbolic size as source text computing
    it (``name_of`` spells each symbol: a kernel's argument; ``floor`` is the language's floor
    division of non-negative ints) instead of specializing it: code generators print sizes
    that way, so one kernel serves every size. ``name_of`` None: specialize."""
    _STATE.printing.append((name_of, floor) if name_of is not None else None)
    try:
        yield
    finally:
        _STATE.printing.pop()


def current_env() -> ShapeEnv | None:
    active = _STATE.active
    return active[-1] if active else None


@contextlib.contextmanager
def active_env(env: ShapeEnv) -> Iterator[ShapeEnv]:
    _STATE.active.append(env)
    try:
        yield env
    finally:
        _STATE.active.pop()


def is_symbolic(value: Any) -> bool:
    return isinstance(value, Sym)


def hint(value: Dim) -> int:
    """The size's value in the captured call (no guard: for choices that stay correct for
    every size, such as a buffer's initial guess)."""
    return value.hint if isinstance(value, Sym) else value


def substitute(value: Any, values: Mapping[str, Dim]) -> Any:
    """``value`` (a size, a tuple or list of them, anything else) with symbols replaced."""
    if isinstance(value, Sym):
        return value.substitute(values)
    if type(value) in (tuple, list):
        return type(value)(substitute(item, values) for item in value)
    return value
