"""Sources: where a value the capture read came from, as an access path from the frame.

A source is how guards re-read a value on the next call and how generated code re-creates it
after a graph: ``L['self']._modules['fc']._parameters['weight']`` is the local ``self``, then
three dictionary lookups. Each source prints for people (``str``) and renders as Python code
for the generated guard and head functions (:meth:`Source.expr`), whose parameters are the
frame's argument locals and whose other names are bound through a :class:`Binder`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Types whose values print as Python literals that read back as equal values.
LITERAL_TYPES = (int, float, bool, str, bytes, type(None), complex)


class Binder:
    """The globals of one generated function: objects it uses, each under a unique name."""

    def __init__(self, prefix: str = "___") -> None:
        self.prefix = prefix
        self.names: dict[str, Any] = {}
        self._by_id: dict[int, str] = {}
        # Access paths computed once into a local (the guard function's common prefixes):
        # ``expr`` of such a source is its local's name. ``uses`` counts ``expr`` calls.
        self.hoisted: dict[Source, str] = {}
        self.uses: dict[Source, int] = {}

    def bind(self, obj: Any, hint: str = "c") -> str:
        """A name bound to ``obj`` (the same name for the same object)."""
        key = id(obj)
        if key in self._by_id:
            return self._by_id[key]
        stem = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in hint)[:30] or "c"
        name = f"{self.prefix}{stem}{len(self.names)}"
        self.names[name] = obj
        self._by_id[key] = name
        return name

    def fresh(self, hint: str = "v") -> str:
        """A new local variable name for generated code (bound to nothing)."""
        self._fresh = getattr(self, "_fresh", 0) + 1
        return f"{self.prefix}{hint}{self._fresh}_"

    def hoist(self, sources: list[Source]) -> list[str]:
        """Assignments computing each of ``sources`` into a local, shortest path first (a
        path's prefix before the path), after which ``expr`` renders them as the locals."""
        lines = []
        for source in sorted(sources, key=_depth):
            expression = source.expr(self)  # uses the locals of its already-hoisted prefixes
            name = self.fresh("p")
            self.hoisted[source] = name
            lines.append(f"{name} = {expression}")
        return lines

    def literal(self, value: Any) -> str:
        """``value`` as code: a literal when it reads back equal, else a bound name."""
        if type(value) in LITERAL_TYPES and not _is_special_float(value):
            return repr(value)
        if type(value) is tuple and all(type(v) in LITERAL_TYPES for v in value):
            return repr(value)
        return self.bind(value, type(value).__name__)


def _depth(source: Source) -> int:
    base = getattr(source, "base", None)
    return 0 if base is None else 1 + _depth(base)


def _is_special_float(value: Any) -> bool:
    return isinstance(value, float) and (value != value or value in (float("inf"), float("-inf")))


@dataclass(frozen=True)
class Source:
    """Base class: an access path."""

    def expr(self, binder: Binder) -> str:
        raise NotImplementedError

    def name(self) -> str:
        """A short identifier-like name, for graph inputs."""
        raise NotImplementedError


def safe_name(name: str) -> str:
    """``name`` as a Python identifier: locals such as pytest's ``@py_assert1`` or a
    comprehension's ``.0`` get a stable spelling for generated code."""
    if name.isidentifier():
        return name
    return "___l_" + "".join(ch if ch.isalnum() else f"_{ord(ch)}_" for ch in name)


@dataclass(frozen=True)
class Local(Source):
    """An argument local of the frame (a parameter of every generated function)."""

    local: str

    def expr(self, binder: Binder) -> str:
        return safe_name(self.local)

    def name(self) -> str:
        return self.local

    def __str__(self) -> str:
        return f"L[{self.local!r}]"


@dataclass(frozen=True)
class Global(Source):
    """A module global of the frame's function (``scope`` is its globals dict)."""

    global_name: str
    scope: dict[str, Any] = field(compare=False, hash=False, repr=False)

    def expr(self, binder: Binder) -> str:
        return f"{binder.bind(self.scope, 'G')}[{self.global_name!r}]"

    def name(self) -> str:
        return self.global_name

    def __str__(self) -> str:
        return f"G[{self.global_name!r}]"

    def __hash__(self) -> int:
        return hash(("G", self.global_name, id(self.scope)))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Global)
            and other.global_name == self.global_name
            and other.scope is self.scope
        )


@dataclass(frozen=True)
class Builtin(Source):
    """A builtin looked up by a global name the module does not define."""

    builtin_name: str

    def expr(self, binder: Binder) -> str:
        import builtins

        return f"{binder.bind(builtins, 'builtins')}.{self.builtin_name}"

    def name(self) -> str:
        return self.builtin_name

    def __str__(self) -> str:
        return f"B[{self.builtin_name!r}]"


@dataclass(frozen=True)
class Closure(Source):
    """The contents of the frame function's closure cell ``index`` (free variable ``var``)."""

    index: int
    var: str

    def expr(self, binder: Binder) -> str:
        return f"___f.__closure__[{self.index}].cell_contents"

    def name(self) -> str:
        return self.var

    def __str__(self) -> str:
        return f"C[{self.var!r}]"


@dataclass(frozen=True)
class FunctionAttr(Source):
    """An attribute of the running function object itself (``___f.__globals__``): function
    objects sharing one code object share its cache, but not necessarily their globals."""

    attr: str

    def expr(self, binder: Binder) -> str:
        return f"___f.{self.attr}"

    def name(self) -> str:
        return self.attr

    def __str__(self) -> str:
        return f"F.{self.attr}"


@dataclass(frozen=True)
class Attr(Source):
    base: Source
    attr: str

    def expr(self, binder: Binder) -> str:
        hoisted = binder.hoisted.get(self)
        if hoisted is not None:
            return hoisted
        binder.uses[self] = binder.uses.get(self, 0) + 1
        base = self.base.expr(binder)
        if self.attr.isidentifier() and not self.attr.startswith("__"):
            return f"{base}.{self.attr}"
        return f"getattr({base}, {self.attr!r})"

    def name(self) -> str:
        return f"{self.base.name()}.{self.attr}"

    def __str__(self) -> str:
        return f"{self.base}.{self.attr}"


@dataclass(frozen=True)
class Item(Source):
    """``base[key]`` with a constant key (an int, string or other hashable constant)."""

    base: Source
    key: Any

    def expr(self, binder: Binder) -> str:
        hoisted = binder.hoisted.get(self)
        if hoisted is not None:
            return hoisted
        binder.uses[self] = binder.uses.get(self, 0) + 1
        return f"{self.base.expr(binder)}[{binder.literal(self.key)}]"

    def name(self) -> str:
        base = self.base.name()
        for suffix in ("._parameters", "._buffers", "._modules"):
            if base.endswith(suffix):  # module attributes read through their dicts
                return f"{base[: -len(suffix)]}.{self.key}"
        return f"{base}[{self.key!r}]"

    def __str__(self) -> str:
        return f"{self.base}[{self.key!r}]"


@dataclass(frozen=True)
class Called(Source):
    """``base()``: what a weak reference read through ``base`` points to."""

    base: Source

    def expr(self, binder: Binder) -> str:
        return f"{self.base.expr(binder)}()"

    def name(self) -> str:
        return f"{self.base.name()}_target"

    def __str__(self) -> str:
        return f"{self.base}()"


@dataclass(frozen=True, eq=False)
class Constant(Source):
    """An object held by identity (one the capture reached without a stable access path)."""

    obj: Any

    def expr(self, binder: Binder) -> str:
        return binder.bind(self.obj, type(self.obj).__name__)

    def name(self) -> str:
        return type(self.obj).__name__

    def __str__(self) -> str:
        return f"<{type(self.obj).__name__} at {id(self.obj):#x}>"

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Constant) and other.obj is self.obj


def _cache_hash(cls: type) -> None:
    """A source's hash computed once (the dataclass one hashes the whole path again at each
    call: compiling GPT-2's 1,114 guards took 59 ms, 28 ms with the hash kept; CPU)."""
    computed: Any = cls.__hash__

    def __hash__(self: Source) -> int:
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = computed(self)
            object.__setattr__(self, "_hash", cached)
        return cached

    cls.__hash__ = __hash__  # type: ignore[method-assign, assignment]


def _no_cached_hash(self: Source) -> dict[str, Any]:
    """Pickled without the hash: strings hash differently in another process."""
    return {k: v for k, v in self.__dict__.items() if k != "_hash"}


Source.__getstate__ = _no_cached_hash  # type: ignore[method-assign, assignment]
for _source_class in (Local, Global, Builtin, Closure, FunctionAttr, Attr, Item, Called):
    _cache_hash(_source_class)
