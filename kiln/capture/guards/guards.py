"""Guards: the facts a capture relied on, checked before its code is reused.

Each guard is a small frozen dataclass that prints as the Python expression it checks and
carries why it exists (the user line that read the value). One cache entry's guards compile to
a single generated function, a straight ``and`` chain, cheapest checks first::

    def ___guard(___f, x, y):
        try:
            return (type(x) is ___Tensor0 and x.dtype is ___dtype1 and x.shape == (8, 8) and ...)
        except Exception:
            return False

On a miss the guards are re-checked one by one to name the first that failed (the recompile
reason).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.capture.guards import native_guards
from kiln.capture.guards.probing import probe
from kiln.capture.guards.sources import (
    Attr,
    Binder,
    Builtin,
    Called,
    Closure,
    Constant,
    FunctionAttr,
    Global,
    Item,
    Local,
    Source,
    safe_name,
)
from kiln.code_cache import compiled as compiled_code
from kiln.ir.types import CPU


@dataclass(frozen=True)
class Guard:
    source: Source | None
    reason: str = field(default="", compare=False)

    # Lower ranks are checked first (cheap identity checks before tensor metadata).
    rank = 5

    def check(self, binder: Binder) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def __str__(self) -> str:
        why = f"  # {self.reason}" if self.reason else ""
        return f"{self.describe()}{why}"


@dataclass(frozen=True)
class TensorMatch(Guard):
    """Type, dtype, device, shape, strides and requires_grad of a tensor. A symbolic dim is
    ``None`` in ``shape`` (its size is checked by the capture's ``SizeGuard``); a tensor with
    one has ``stride`` None, and must be dense in the dim ``order`` it had (its dims of size
    above 1, outermost first; None: contiguous), so its strides follow from its sizes."""

    kind: type = torch.Tensor
    dtype: torch.dtype = torch.float32
    device: torch.device = CPU
    shape: tuple[int | None, ...] = ()
    stride: tuple[int, ...] | None = ()
    requires_grad: bool = False
    order: tuple[int, ...] | None = None

    rank = 3

    @staticmethod
    def of(
        source: Source,
        tensor: torch.Tensor,
        reason: str = "",
        symbolic: frozenset[int] = frozenset(),
    ) -> TensorMatch:
        shape = tuple(None if d in symbolic else size for d, size in enumerate(tensor.shape))
        order = dense_order(tensor) if symbolic else None
        return TensorMatch(
            source,
            reason,
            type(tensor),
            tensor.dtype,
            tensor.device,
            shape,
            None if symbolic else tuple(tensor.stride()),
            tensor.requires_grad,
            None if order == tuple(sorted(order or ())) else order,
        )

    def check(self, binder: Binder) -> str:
        assert self.source is not None
        v = binder.fresh("t")
        if self.stride is None:
            sizes = [
                f"{v}.size({d}) == {size}" for d, size in enumerate(self.shape) if size is not None
            ]
            dense = (
                f"{v}.is_contiguous()"
                if self.order is None
                else f"{binder.bind(dense_in_order, 'dense')}({v}, {self.order!r})"
            )
            layout = " and ".join([f"{v}.dim() == {len(self.shape)}", *sizes, dense])
        else:
            layout = f"{v}.shape == {self.shape!r} and {v}.stride() == {self.stride!r}"
        return (
            f"type({v} := {self.source.expr(binder)}) is {binder.bind(self.kind, 'T')} "
            f"and {v}.dtype is {binder.bind(self.dtype, 'dtype')} "
            f"and {v}.device == {binder.bind(self.device, 'device')} "
            f"and {layout} "
            f"and {v}.requires_grad is {self.requires_grad}"
        )

    def describe(self) -> str:
        grad = ", requires_grad" if self.requires_grad else ""
        dtype = str(self.dtype).removeprefix("torch.")
        shape = ", ".join("*" if size is None else str(size) for size in self.shape)
        stride = f"stride={list(self.stride or ())}"
        if self.stride is None:
            stride = "contiguous" if self.order is None else f"dense in dim order {self.order}"
        kind = self.kind.__name__
        return f"{self.source}: {kind}[{dtype}, [{shape}], {stride}, {self.device}{grad}]"

    def reads(self, binder: Binder) -> str:
        """The expression of what :meth:`mismatch` is given (on a miss only)."""
        assert self.source is not None
        return self.source.expr(binder)

    def mismatch(self, value: Any) -> str:
        """What differs in ``value`` (the first thing), naming the dim for a size."""
        tensor: Any = value
        if type(value) is not self.kind:
            return f"{self.source} is a {type(tensor).__name__}, not a {self.kind.__name__}"
        for what in ("dtype", "device", "requires_grad"):
            now, expected = getattr(tensor, what), getattr(self, what)
            if now != expected:
                return f"{self.source}.{what} is {now}, expected {expected}"
        if tensor.dim() != len(self.shape):
            return f"{self.source} has {tensor.dim()} dims, expected {len(self.shape)}"
        for dim, (size, expected) in enumerate(zip(tensor.shape, self.shape, strict=True)):
            if expected is not None and size != expected:
                return f"{self.source}.size({dim}) is {size}, expected {expected}"
        if self.stride is None and self.order is not None:
            return f"{self.source} is not dense in dim order {self.order}"
        if self.stride is None:
            return f"{self.source} is not contiguous"
        return f"{self.source}.stride() is {tuple(tensor.stride())}, expected {self.stride}"


def dense_order(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The dims of size above 1, outermost first, when ``tensor`` is dense in that order (the
    strides of a contiguous tensor with its dims permuted: a transpose made contiguous, a
    channels-last image); None when it is not (a slice, an expanded dim)."""
    strides = tensor.stride()
    dims = sorted((d for d, n in enumerate(tensor.shape) if n > 1), key=lambda d: -strides[d])
    return tuple(dims) if dense_in_order(tensor, dims) else None


def dense_in_order(tensor: torch.Tensor, order: Sequence[int]) -> bool:
    """Whether ``tensor``'s dims ``order`` (outermost first) have the strides of a dense
    tensor in that order (the others, of size 1, have any)."""
    expected = 1
    for dim in reversed(order):
        if tensor.stride(dim) != expected:
            return False
        expected *= tensor.shape[dim]
    return True


@dataclass(frozen=True)
class Equals(Guard):
    """A constant the capture specialized on (an int, string, bool, None, dtype, ...)."""

    value: Any = None

    rank = 1

    def check(self, binder: Binder) -> str:
        assert self.source is not None
        if self.value is None or type(self.value) is bool:  # singletons: identity says it all
            return f"{self.source.expr(binder)} is {self.value!r}"
        # The type check keeps True from matching 1 and 1.0 from matching 1.
        return (
            f"type({self.source.expr(binder)}) is {binder.bind(type(self.value), 'type')} "
            f"and {self.source.expr(binder)} == {binder.literal(self.value)}"
        )

    def describe(self) -> str:
        return f"{self.source} == {self.value!r}"

    def __hash__(self) -> int:
        # Slices cannot be hashed before Python 3.12; hash them by their fields.
        return hash((type(self), self.source, self.reason, _hashable(self.value)))


def _hashable(value: Any) -> Any:
    if isinstance(value, slice):
        return (slice, _hashable(value.start), _hashable(value.stop), _hashable(value.step))
    if type(value) is tuple:
        return tuple(_hashable(item) for item in value)
    if isinstance(value, set):
        return frozenset(value)
    if isinstance(value, dict):  # an object's state snapshot: compared whole, hashed by identity
        return id(value)
    return value


@dataclass(frozen=True, eq=False)
class Identity(Guard):
    """The same object as at capture: modules, functions, classes, globals."""

    obj: Any = None

    rank = 0

    def check(self, binder: Binder) -> str:
        assert self.source is not None
        return f"{self.source.expr(binder)} is {binder.bind(self.obj, _hint(self.obj))}"

    def describe(self) -> str:
        return f"{self.source} is {_hint(self.obj)}@{id(self.obj):#x}"

    def __hash__(self) -> int:
        return hash((self.source, id(self.obj)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and (other.source, other.obj) == (
            self.source,
            self.obj,
        )


@dataclass(frozen=True)
class TypeIs(Guard):
    kind: type = object

    rank = 0

    def check(self, binder: Binder) -> str:
        assert self.source is not None
        return f"type({self.source.expr(binder)}) is {binder.bind(self.kind, self.kind.__name__)}"

    def describe(self) -> str:
        return f"type({self.source}) is {self.kind.__qualname__}"


@dataclass(frozen=True)
class LengthIs(Guard):
    length: int = 0

    rank = 1

    def check(self, binder: Binder) -> str:
        assert self.source is not None
        return f"len({self.source.expr(binder)}) == {self.length}"

    def describe(self) -> str:
        return f"len({self.source}) == {self.length}"


@dataclass(frozen=True)
class KeysAre(Guard):
    """A dict's keys, in order (iteration over it was unrolled)."""

    keys: tuple[Any, ...] = ()

    rank = 1

    def check(self, binder: Binder) -> str:
        assert self.source is not None
        return f"tuple({self.source.expr(binder)}) == {binder.literal(self.keys)}"

    def describe(self) -> str:
        return f"tuple({self.source}) == {self.keys!r}"


@dataclass(frozen=True)
class HasAttr(Guard):
    """Whether an object has an attribute (the capture read it, or asked ``hasattr``)."""

    attr: str = ""
    present: bool = True

    rank = 1

    def check(self, binder: Binder) -> str:
        assert self.source is not None
        test = f"hasattr({self.source.expr(binder)}, {self.attr!r})"
        return test if self.present else f"not {test}"

    def describe(self) -> str:
        return f"{'' if self.present else 'not '}hasattr({self.source}, {self.attr!r})"


@dataclass(frozen=True)
class Aliasing(Guard):
    """Two tensor inputs are (or are not) the same object."""

    other: Source | None = None
    same: bool = False

    rank = 4

    def check(self, binder: Binder) -> str:
        assert self.source is not None and self.other is not None
        op = "is" if self.same else "is not"
        return f"{self.source.expr(binder)} {op} {self.other.expr(binder)}"

    def describe(self) -> str:
        return f"{self.source} {'is' if self.same else 'is not'} {self.other}"


def storages_separate(written: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> bool:
    """No two ``written`` tensors share a storage, and none shares one with ``others``. Empty
    storages (address 0, no memory to share) never count."""
    addresses = [t.untyped_storage().data_ptr() for t in written]
    mine = {address for address in addresses if address}
    if len(mine) != sum(1 for address in addresses if address):
        return False
    return not any(t.untyped_storage().data_ptr() in mine for t in others)


@dataclass(frozen=True)
class SeparateMemory(Guard):
    """The tensors a graph writes to share no storage with each other or with the other
    inputs (as at capture). One guard for all pairs, checked in linear time: a ResNet-50 in
    training writes 159 BatchNorm buffers among 480 inputs, and one check per pair cost more
    host time per step (about 50 ms) than its GPU work."""

    written: tuple[Source, ...] = ()
    others: tuple[Source, ...] = ()

    rank = 4

    def check(self, binder: Binder) -> str:
        function = binder.bind(storages_separate, "storages_separate")
        written = "".join(f"{s.expr(binder)}, " for s in self.written)
        others = "".join(f"{s.expr(binder)}, " for s in self.others)
        return f"{function}(({written}), ({others}))"

    def describe(self) -> str:
        names = ", ".join(str(s) for s in self.written)
        return f"written inputs {names} share no memory with each other or other inputs"


def global_state() -> tuple[Any, ...]:
    """The torch state every capture depends on: grad mode, autocast, default dtype."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        torch.get_default_dtype(),
    )


@dataclass(frozen=True)
class GlobalState(Guard):
    state: tuple[Any, ...] = ()

    rank = 0

    def check(self, binder: Binder) -> str:
        return f"{binder.bind(global_state, 'global_state')}() == {binder.literal(self.state)}"

    def describe(self) -> str:
        grad, inference, cpu, cpu_dtype, cuda, cuda_dtype, default = self.state
        cpu_autocast = f"autocast(cpu, {cpu_dtype})" if cpu else "no cpu autocast"
        cuda_autocast = f"autocast(cuda, {cuda_dtype})" if cuda else "no cuda autocast"
        return (
            f"torch state: grad_enabled={grad}, inference_mode={inference}, {cpu_autocast}, "
            f"{cuda_autocast}, default_dtype={default}"
        )


def _hint(obj: Any) -> str:
    return str(probe(obj, "__name__") or type(obj).__name__)


GuardFunction = Callable[..., bool]


def _hoist(binder: Binder) -> str:
    """Assignments computing each access path used more than once into a local, shortest
    first (a path's prefix before the path), after which ``binder`` renders those paths as
    the locals. ResNet-50's guards walked ``self._modules['layer1']._modules['0']...`` from
    the root for each of its 700 checks (0.65 ms per call on the H100's host).

    Evaluating the paths before the checks keeps the result: every check of a passing guard
    set evaluates its path, and a path that cannot be evaluated makes the guard fail either
    way (the function answers False on any exception)."""
    shared = [source for source, count in binder.uses.items() if count > 1]
    return "".join(f"        {line}\n" for line in binder.hoist(shared))


@dataclass(frozen=True)
class NativeCheck(Guard):
    """Many guards (identities, constants, lengths, types, tensors' metadata) as one call into
    the native extension (``native_guards.py``): it walks their access paths and checks the
    values in C++, about 5x faster than the generated Python (a RegNet's 2,300 guards: 0.5 ms
    a call in Python)."""

    members: tuple[Guard, ...] = ()
    plan: Any = field(default=None, compare=False)  # the extension's plan capsule
    run: Any = field(default=None, compare=False)
    arguments: tuple[str, ...] = ()  # the guard function's parameters, ``___f`` first

    rank = 0

    def check(self, binder: Binder) -> str:
        function = binder.bind(self.run, "native_check")
        plan = binder.bind(self.plan, "guard_plan")
        return f"{function}({plan}, ({', '.join(self.arguments)},))"

    def describe(self) -> str:
        return f"{len(self.members)} guards checked natively (identities, values, tensors)"


# Node and check kinds of a native plan (``native_guards.py``: NodeKind, CheckKind).
ARGUMENT, CONSTANT, ATTRIBUTE, ITEM, CALL = range(5)
IS, EQUALS, LENGTH, TYPE_IS, TENSOR, SEPARATE = range(6)


class _Plan:
    """The nodes (access steps) and checks of a native plan, built from guards' sources."""

    def __init__(self, params: Sequence[str]) -> None:
        self.arguments = ["___f", *params]
        self.nodes: list[tuple[int, int, Any]] = []
        self.checks: list[tuple[int, int, Any, Any, int]] = []
        self.specs: list[tuple[Any, ...]] = []
        self.index: dict[Any, int] = {}

    def add(self, guard: Guard) -> bool:
        """Plan ``guard``'s check; False (nothing added) when the plan cannot express it."""
        if type(guard) is SeparateMemory:  # (no source of its own: the tensors' sources)
            found = [self.node(source) for source in (*guard.written, *guard.others)]
            nodes = [node for node in found if node is not None]
            if not nodes or len(nodes) < len(found):
                return False
            self.checks.append((SEPARATE, nodes[0], tuple(nodes), None, len(guard.written)))
            return True
        node = self.node(guard.source) if guard.source is not None else None
        if node is None:
            return False
        if isinstance(guard, Identity):
            self.checks.append((IS, node, guard.obj, None, 0))
        elif type(guard) is Equals:
            value = guard.value
            singleton = value is None or type(value) is bool
            kind = IS if singleton else EQUALS
            self.checks.append((kind, node, value, None if singleton else type(value), 0))
        elif type(guard) is LengthIs:
            self.checks.append((LENGTH, node, None, None, guard.length))
        elif type(guard) is TypeIs:
            self.checks.append((TYPE_IS, node, None, guard.kind, 0))
        elif type(guard) is TensorMatch and guard.stride is not None:
            spec = (guard.kind, guard.dtype, guard.device, guard.requires_grad)
            self.specs.append((*spec, tuple(guard.shape), tuple(guard.stride)))
            self.checks.append((TENSOR, node, None, None, len(self.specs) - 1))
        else:
            return False
        return True

    def node(self, source: Source) -> int | None:
        """The node reaching ``source``'s value (added with its prefixes), or None."""
        if source in self.index:
            return self.index[source]
        step = self._step(source)
        if step is None:
            return None
        self.nodes.append(step)
        self.index[source] = len(self.nodes) - 1
        return len(self.nodes) - 1

    def _step(self, source: Source) -> tuple[int, int, Any] | None:
        if isinstance(source, Local):
            name = safe_name(source.local)
            return (ARGUMENT, self.arguments.index(name), None) if name in self.arguments else None
        if isinstance(source, Constant):
            return (CONSTANT, 0, source.obj)
        parts: tuple[int, Source | None, Any]
        if isinstance(source, Attr | Item):
            parts = (ATTRIBUTE if isinstance(source, Attr) else ITEM, source.base, _key(source))
        elif isinstance(source, Called):
            parts = (CALL, source.base, None)
        elif isinstance(source, Global):
            parts = (ITEM, Constant(source.scope), source.global_name)
        elif isinstance(source, Builtin):
            parts = (ATTRIBUTE, Constant(builtins), source.builtin_name)
        elif isinstance(source, FunctionAttr):
            parts = (ATTRIBUTE, Local("___f"), source.attr)
        elif isinstance(source, Closure):
            cells = Item(Attr(Local("___f"), "__closure__"), source.index)
            parts = (ATTRIBUTE, cells, "cell_contents")
        else:
            return None
        kind, base, key = parts
        parent = self.node(base) if base is not None else None
        return None if parent is None else (kind, parent, key)


def _key(source: Attr | Item) -> Any:
    return source.attr if isinstance(source, Attr) else source.key


def wants_native(guards: Sequence[Guard], source: str) -> bool:
    """Whether ``guards``, compiled as ``source``, are worth compiling again once the extension
    is loaded: enough of them, and ``source`` checks none natively. The extension's state
    afterwards does not tell: loading it from the disk cache in the build thread can finish
    between compiling and asking (which left a RegNet's 3,793 guards in Python: 355 us a call on
    this project's CPU, 145 native)."""
    if native_guards.module() is None and not native_guards.pending():  # failed, or off
        return False
    return len(guards) >= native_guards.NATIVE_MIN_TENSORS and "native_check" not in source


def _natively_checked(ordered: list[Guard], params: Sequence[str]) -> list[Guard]:
    """``ordered`` with the guards a native plan can check as one :class:`NativeCheck`, first
    (after the global state), when there are enough of them and the extension is loaded
    (its build starts here otherwise)."""
    if len(ordered) < native_guards.NATIVE_MIN_TENSORS:
        return ordered
    native: Any = native_guards.module()
    if native is None:
        native_guards.request()
        return ordered
    plan = _Plan(params)
    planned = [guard for guard in ordered if plan.add(guard)]
    if len(planned) < native_guards.NATIVE_MIN_TENSORS:
        return ordered
    packed = native.plan(plan.nodes, plan.checks, plan.specs)
    batch = NativeCheck(None, "", tuple(planned), packed, native.run, tuple(plan.arguments))
    members = {id(g) for g in planned}
    rest = [g for g in ordered if id(g) not in members]
    first = sum(1 for g in rest if isinstance(g, GlobalState))
    return [*rest[:first], batch, *rest[first:]]


def compile_guards(
    guards: Sequence[Guard], params: Sequence[str]
) -> tuple[GuardFunction, str, Callable[..., str | None]]:
    """The guard function of one cache entry, its source, and a function naming the first
    failing guard (for recompile reasons; slow, used only on a miss)."""
    ordered = sorted(guards, key=lambda guard: guard.rank)
    binder = Binder()
    combined = _natively_checked(ordered, params)
    for guard in combined:  # counts each path's uses: hoist the paths Python checks walk
        guard.check(binder)
    prelude = _hoist(binder)
    hoisted_checks = [guard.check(binder) for guard in combined]
    body = "\n            and ".join(f"({check})" for check in hoisted_checks) or "True"
    signature = ", ".join(["___f", *params])
    source = (
        f"def ___guard({signature}):\n"
        f"    try:\n"
        f"{prelude}"
        f"        return bool(\n            {body}\n        )\n"
        f"    except Exception:\n"
        f"        return False\n"
    )
    scope = dict(binder.names)
    exec(compiled_code(source, "<kiln guard>"), scope)
    function = scope["___guard"]

    singles: list[tuple[Guard, Callable[..., bool], Callable[..., Any] | None]] = []

    def compile_singles() -> None:
        # Only on a miss: one small function per guard, to name the first that fails (and,
        # for a tensor, one reading it, to say what differs); whole paths, no prelude (a
        # binder of their own: generating these for every entry cost 2/3 of this function).
        whole = Binder()
        checks = [guard.check(whole) for guard in ordered]
        getters = {id(guard): guard.reads(whole) for guard in ordered if hasattr(guard, "reads")}
        for guard, check in zip(ordered, checks, strict=True):
            code = f"def ___one({signature}):\n    return bool({check})\n"
            if id(guard) in getters:
                code += f"def ___get({signature}):\n    return {getters[id(guard)]}\n"
            one_scope = dict(whole.names)
            exec(compile(code, "<kiln guard>", "exec"), one_scope)
            singles.append((guard, one_scope["___one"], one_scope.get("___get")))

    def first_failure(*args: Any) -> str | None:
        if not singles:
            compile_singles()
        for guard, one, get in singles:
            try:
                if not one(*args):
                    if get is not None:
                        return guard.mismatch(get(*args))  # type: ignore[attr-defined]
                    return guard.describe()
            except Exception as error:
                return f"{guard.describe()} ({type(error).__name__}: {error})"
        return None

    return function, source, first_failure
