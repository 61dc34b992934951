"""The state of one capture: the graph being built, the guards, the sources of values read from
the frame's world, new objects, and the side effects to replay.

Values on the symbolic stack are real Python objects; tensors are
:class:`~kiln.frontends.proxy.ProxyTensor`s. Everything read from outside the frame (arguments,
globals, closure cells, attributes and items of those) goes through :meth:`Session.wrap`, which
installs the guard the read relies on and remembers the value's source.

Mutation of objects that existed before the call (lists, dicts, attributes, globals, cells) is
applied for real during capture, so later reads see it, and journalled: :meth:`Session.undo`
restores the old state when capture ends, and the generated code replays the final state after
the graph on every call.
"""

from __future__ import annotations

import collections
import decimal
import enum
import fractions
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.capture.guards.guards import (
    Aliasing,
    Equals,
    GlobalState,
    Guard,
    Identity,
    KeysAre,
    LengthIs,
    SeparateMemory,
    TensorMatch,
    TypeIs,
    dense_order,
    global_state,
    storages_separate,
)
from kiln.capture.guards.sizes import SizeGuard, SizePolicy
from kiln.capture.guards.sources import Attr, Item, Source
from kiln.frontends.proxy import ProxyTensor
from kiln.frontends.source import user_location
from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, InputKind, Value
from kiln.ir.symbolic import ShapeEnv
from kiln.ir.types import TensorType

try:  # NumPy scalars (a metric's float32) are values like Python numbers
    import numpy

    _NUMPY_SCALARS: tuple[type, ...] = (numpy.generic,)
except ImportError:  # pragma: no cover - NumPy comes with every PyTorch install here
    _NUMPY_SCALARS = ()

# Values guarded by equality and used as constants (immutable values: a Fraction read only by
# type and then converted natively gave a stale result once the global was rebound).
CONSTANT_TYPES = (
    *_NUMPY_SCALARS,
    fractions.Fraction,
    decimal.Decimal,
    int,
    float,
    bool,
    str,
    bytes,
    type(None),
    complex,
    torch.dtype,
    torch.device,
    torch.Size,
    type(Ellipsis),
    type(NotImplemented),
    torch.memory_format,
    torch.layout,
)
# Values guarded by identity.
IDENTITY_TYPES = (
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    type,
    torch.nn.Module,
    enum.Enum,
)


def is_constant(value: Any) -> bool:
    if isinstance(value, CONSTANT_TYPES):
        return True
    if type(value) in (tuple, frozenset):
        return all(is_constant(item) for item in value)
    return isinstance(value, slice) and all(
        is_constant(x) for x in (value.start, value.stop, value.step)
    )


class EffectKind(enum.Enum):
    CONTAINER = "container"  # a list, dict or set's contents
    ATTRIBUTE = "attribute"
    GLOBAL = "global"
    CELL = "cell"


@dataclass
class Effect:
    """A mutation of a pre-existing object, replayed (final state) after the graph."""

    kind: EffectKind
    target: Any  # the object (or globals dict, or cell)
    key: str = ""  # attribute or global name
    snapshot: Any = None  # a container's contents, or an attribute's value, before the change


@dataclass
class Recipe:
    """How to re-create an object the capture constructed natively: ``fn(*args, **kwargs)``."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    attributes: dict[str, Any] = field(default_factory=dict)  # set after construction


_ABSENT = object()


class Session:
    """One capture of one frame (restarted from scratch at each graph break it discovers)."""

    def __init__(
        self,
        name: str,
        break_at: int | None = None,
        router: Callable[[Any], Any] | None = None,
        sizes: SizePolicy | None = None,
    ) -> None:
        self.graph = Graph(name=name)
        # Symbolic sizes: which input dims are symbolic (the code object's policy), and the
        # symbols and the guards decided on them during this capture.
        self.size_policy = sizes if sizes is not None else SizePolicy(dynamic=False)
        self.shapes = ShapeEnv(location=_reason)
        self.builder = GraphBuilder(self.graph)
        self.guards: dict[Guard, None] = {}
        self.sources: dict[int, Source] = {}
        self.inputs: list[tuple[Value, Source]] = []
        self.input_proxies: dict[int, ProxyTensor] = {}
        self.input_tensors: dict[Value, torch.Tensor] = {}
        self.new_objects: dict[int, Any] = {}
        # Tensors torch calls made during capture from Python data (``torch.arange(4)``):
        # constants the generated code may copy. Any other real tensor was reached without a
        # source (an unread item of an argument) and must not be baked in.
        self.constant_tensors: set[int] = set()
        # Constants that are views, or have views: written with traced values, they cannot
        # become graph values (the other tensors sharing their memory would not follow).
        self.shared_constants: set[int] = set()
        self.poisoned_constants: set[int] = set()
        # Functions capture cannot trace into (``torch.func.vmap(f)``): calling one breaks.
        self.opaque_callables: set[int] = set()
        self.recipes: dict[int, Recipe] = {}
        self.effects: dict[tuple[Any, ...], Effect] = {}
        self.journal: list[Callable[[], None]] = []
        self.keepalive: list[Any] = []
        self.break_at = break_at
        # Generated code calls callees through it (their compiled wrappers, same options).
        self.router = router
        self.inline_depth = 0
        self.contexts: list[Any] = []  # context managers entered natively, innermost last
        self.add_guard(GlobalState(None, "torch state at the call", global_state()))

    # --- guards and sources -------------------------------------------------------------
    def add_guard(self, guard: Guard) -> None:
        self.guards.setdefault(guard, None)

    def source_of(self, value: Any) -> Source | None:
        return self.sources.get(id(value))

    def wrap(self, value: Any, source: Source) -> Any:
        """``value`` read through ``source``: guard what the capture relies on, track it."""
        reason = _reason()
        if isinstance(value, ProxyTensor) or self.written_by_frame(value, source):
            return value
        if isinstance(value, torch.Tensor) and value.layout is torch.strided:
            return self.tensor_input(value, source, reason)
        if is_constant(value) and not isinstance(value, enum.Enum):
            self.add_guard(Equals(source, reason, value))
            return value
        bound = isinstance(value, types.BuiltinMethodType) and not isinstance(
            value.__self__, types.ModuleType | type | type(None)
        )
        if bound:
            owner = value.__self__
            # ``log.append``: a new object on every read, so not guarded by identity; the
            # method is its name on its owner, which is read (and guarded) through the source.
            self.add_guard(TypeIs(source, reason, type(value)))
            self.add_guard(Equals(Attr(source, "__name__"), reason, value.__name__))
            self.wrap(owner, Attr(source, "__self__"))
        elif isinstance(value, IDENTITY_TYPES):
            self.add_guard(Identity(source, reason, value))
        elif isinstance(value, types.MethodType):
            self.add_guard(Identity(Attr(source, "__func__"), reason, value.__func__))
            self.wrap(value.__self__, Attr(source, "__self__"))  # the method reads its self
        elif type(value) is tuple:
            self.add_guard(TypeIs(source, reason, type(value)))
            self.add_guard(LengthIs(source, reason, len(value)))
        elif isinstance(value, list | dict):
            # Length and keys are guarded when the code reads the contents (guard_contents):
            # a list the code only appends to must not recompile on every call.
            self.add_guard(TypeIs(source, reason, type(value)))
        else:
            self.add_guard(TypeIs(source, reason, type(value)))
        self.remember(value, source)
        return value

    def written_by_frame(self, value: Any, source: Source) -> bool:
        """Whether ``source`` is a key of a dict this capture has written and ``value`` is not
        what it held when the call began: the frame's own ``kwargs[k] = v``, read back, was not
        read from outside (a guard on it fails on every call: issue 24's decorators). Lists
        are left alone: an insertion moves the items it did not write to other indices."""
        if not isinstance(source, Item):
            return False
        for effect in self.effects.values():
            before = effect.snapshot
            if (
                effect.kind is EffectKind.CONTAINER
                and isinstance(before, dict)
                and self.source_of(effect.target) == source.base
            ):
                return source.key not in before or before[source.key] is not value
        return False

    def guard_sizes(self) -> None:
        """Add the guard on symbolic sizes (when the capture has any): call once, last."""
        guard = SizeGuard.of(self.shapes)
        if guard is not None:
            self.add_guard(guard)

    def guard_written_leaves(self) -> None:
        """Guard the leafness of inputs requiring grad that the graph writes in place (eager
        refuses that for a leaf, ``frontends/writes.py``): a graph captured for a non-leaf must
        not run on a leaf. Call after tracing."""
        for proxy in self.input_proxies.values():
            if proxy.requires_grad and proxy._mutations:
                source = self.sources[id(self.input_tensors[proxy._initial])]
                self.add_guard(Equals(Attr(source, "is_leaf"), "written in place", proxy._leaf))

    def guard_contents(self, value: Any) -> None:
        """The code reads what a list, dict or set argument holds: guard its length, keys or
        members (as they were when the call began, if the code has mutated it since)."""
        source = self.sources.get(id(value))
        if source is None or self.is_new(value):
            return
        effect = self.effects.get(("container", id(value)))
        before = effect.snapshot if effect is not None else value
        if isinstance(value, list | tuple | collections.deque):
            self.add_guard(LengthIs(source, _reason(), len(before)))
        elif isinstance(value, dict):
            self.add_guard(KeysAre(source, _reason(), tuple(before)))
        elif isinstance(value, set | frozenset):  # (a copy: the set may change after the call)
            self.add_guard(Equals(source, _reason(), type(value)(before)))

    def traced_version(self, obj: Any) -> Any:
        """What the capture uses for a pre-existing object (a tensor's proxy, else itself)."""
        return self.input_proxies.get(id(obj), obj)

    def remember(self, value: Any, source: Source) -> None:
        if id(value) not in self.sources:
            self.sources[id(value)] = source
            self.keepalive.append(value)

    def tensor_input(self, tensor: torch.Tensor, source: Source, reason: str = "") -> ProxyTensor:
        """The proxy of a tensor read from outside the frame: one graph input per tensor."""
        known = self.input_proxies.get(id(tensor))
        if known is not None:
            first = self.sources[id(tensor)]
            if first != source:
                self.add_guard(Aliasing(source, reason, first, same=True))
            return known
        kind = InputKind.PARAMETER if isinstance(tensor, torch.nn.Parameter) else InputKind.USER
        if kind is InputKind.USER and "_buffers" in str(source):
            kind = InputKind.BUFFER
        type_ = TensorType.of(tensor)
        symbolic: dict[int, Any] = {}
        if kind is InputKind.USER and dense_order(tensor) is not None:
            # (an input dense in some dim order: its strides follow from its sizes; a slice
            # or an expanded input stays static)
            for dim, choice in self.size_policy.choose(str(source), tensor).items():
                size = tensor.shape[dim]
                symbolic[dim] = self.shapes.size(
                    source, dim, size, choice.reason, choice.low, choice.high
                )
        if symbolic:
            shape = tuple(symbolic.get(d, size) for d, size in enumerate(tensor.shape))
            type_ = type_.with_(shape=shape)
        self.add_guard(TensorMatch.of(source, tensor, reason, frozenset(symbolic)))
        value = self.graph.add_input(type_, name=_input_name(source), kind=kind, source=str(source))
        proxy = ProxyTensor(value)
        proxy._input_type = type(tensor)  # type(x) answers this for the input itself
        proxy._strides = tuple(tensor.stride())  # (guarded: exactly, or the dim order)
        proxy._leaf = tensor.is_leaf and tensor.requires_grad  # (guarded where it is written)
        if isinstance(tensor, torch.nn.Parameter):
            proxy._is_param = True  # isinstance(x, nn.Parameter) holds, as in eager
        self.input_proxies[id(tensor)] = proxy
        self.input_tensors[value] = tensor
        self.remember(tensor, source)
        self.sources[id(proxy)] = source  # the proxy reads back through the same path
        self.keepalive.append(proxy)
        self.inputs.append((value, source))
        return proxy

    def caller_tensor(self, proxy: ProxyTensor) -> torch.Tensor | None:
        """The caller's tensor a proxy stands for (None for tensors the call computes)."""
        return self.input_tensors.get(proxy._initial)

    def guard_distinct_mutated_inputs(self) -> bool:
        """Inputs the graph writes to must not share memory with other inputs (the graph
        treats them as independent). False when they do at capture: then it cannot be used."""
        if not self.graph.mutations:
            return True
        by_value = dict(self.inputs)
        targets = list(dict.fromkeys(target for target, _ in self.graph.mutations))
        others = [value for value, _ in self.inputs if value not in set(targets)]
        written = [self.input_tensors[target] for target in targets]
        if not storages_separate(written, [self.input_tensors[value] for value in others]):
            return False
        self.add_guard(
            SeparateMemory(
                None,
                "written input",
                tuple(by_value[target] for target in targets),
                tuple(by_value[value] for value in others),
            )
        )
        return True

    # --- new objects ---------------------------------------------------------------------
    def new(self, obj: Any, recipe: Recipe | None = None) -> Any:
        """Mark ``obj`` as created by the captured code (free to mutate, re-created after)."""
        self.new_objects[id(obj)] = obj
        if recipe is not None:
            self.recipes[id(obj)] = recipe
        return obj

    def is_new(self, obj: Any) -> bool:
        return id(obj) in self.new_objects

    def state_at_entry(self, obj: Any) -> dict[str, Any]:
        """``obj.__dict__`` as it was when the call began (attributes the capture has set since
        are read from the journal)."""
        state = dict(vars(obj))
        for effect in self.effects.values():
            if effect.kind is EffectKind.ATTRIBUTE and effect.target is obj:
                if effect.snapshot is _ABSENT:
                    state.pop(effect.key, None)
                else:
                    state[effect.key] = effect.snapshot
        return state

    def opaque(self, value: Any) -> bool:
        """Whether ``value`` came from outside and capture cannot see what native code does
        with it: an object of a C type it does not model (a NumPy array), guarded only by its
        type. Computing on it during capture would bake this call's result into the code."""
        if id(value) not in self.sources or self.is_new(value):
            return False
        kind = type(value)
        if kind.__flags__ & _HEAP_TYPE:  # a Python class: its methods inline, reads are guarded
            return False
        return not isinstance(value, _MODELED)

    def constant_tensor(self, tensor: torch.Tensor) -> None:
        """``tensor`` was computed during capture from Python data (a constant)."""
        self.constant_tensors.add(id(tensor))
        self.keepalive.append(tensor)
        if tensor._is_view():
            self.shared_constants.update((id(tensor), id(tensor._base)))

    def writable_constant(self, tensor: torch.Tensor) -> bool:
        """Whether writing traced values into ``tensor`` may make it a graph value; if not, it
        may not be re-created after the graph either (its writes would be lost)."""
        if id(tensor) in self.shared_constants:
            self.poisoned_constants.add(id(tensor))
            return False
        return True

    # --- side effects on pre-existing objects -------------------------------------------
    def touch_container(self, obj: Any) -> None:
        """About to mutate list/dict/set ``obj``: journal its contents if it pre-exists."""
        if self.is_new(obj):
            return
        key = ("container", id(obj))
        if key in self.effects:
            return
        snapshot = obj.copy()
        if isinstance(obj, list):
            self.journal.append(lambda: obj.__setitem__(slice(None), snapshot))
        else:
            self.journal.append(lambda: _refill(obj, snapshot))
        self.effects[key] = Effect(EffectKind.CONTAINER, obj, snapshot=snapshot)
        self.keepalive.append(obj)

    def set_attribute(self, obj: Any, name: str, value: Any, delete: bool = False) -> None:
        """``obj.name = value`` (or ``del obj.name``), journalled if ``obj`` pre-exists."""
        if self.is_new(obj):
            recipe = self.recipes.get(id(obj))
            if recipe is not None:
                recipe.attributes[name] = _ABSENT if delete else value
        else:
            key = ("attribute", id(obj), name)
            if key not in self.effects:
                old = obj.__dict__.get(name, _ABSENT) if hasattr(obj, "__dict__") else _ABSENT
                if old is _ABSENT and hasattr(obj, name) and not callable(getattr(obj, name)):
                    old = getattr(obj, name)
                self.journal.append(lambda: _restore_attribute(obj, name, old))
                self.effects[key] = Effect(EffectKind.ATTRIBUTE, obj, name, snapshot=old)
                self.keepalive.append(obj)
        if delete:
            delattr(obj, name)
        else:
            setattr(obj, name, value)

    def set_global(
        self, scope: dict[str, Any], name: str, value: Any, delete: bool = False
    ) -> None:
        key = ("global", id(scope), name)
        if key not in self.effects:
            old = scope.get(name, _ABSENT)
            self.journal.append(lambda: _restore_item(scope, name, old))
            self.effects[key] = Effect(EffectKind.GLOBAL, scope, name)
        if delete:
            del scope[name]
        else:
            scope[name] = value

    def set_cell(self, cell: Any, value: Any) -> None:
        if not self.is_new(cell):
            key = ("cell", id(cell))
            if key not in self.effects:
                try:
                    old = cell.cell_contents
                except ValueError:
                    old = _ABSENT
                self.journal.append(lambda: _restore_cell(cell, old))
                self.effects[key] = Effect(EffectKind.CELL, cell)
                self.keepalive.append(cell)
        cell.cell_contents = value

    def enter_context(self, ctx: Any) -> None:
        """``ctx`` (a known torch context manager) was entered natively."""
        self.contexts.append(ctx)

    def exit_context(self, ctx: Any, *exc: Any) -> Any:
        """Leave ``ctx`` natively (the captured code's ``with`` block ended)."""
        for i in range(len(self.contexts) - 1, -1, -1):
            if self.contexts[i] is ctx:
                del self.contexts[i]
                break
        return ctx.__exit__(*exc)

    def undo(self) -> None:
        """Leave contexts still entered, put every pre-existing object back as it was."""
        while self.contexts:
            self.contexts.pop().__exit__(None, None, None)
        while self.journal:
            self.journal.pop()()


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: classes made by class statements
# Types whose values capture follows: constants (by value), identities, tensors, containers
# (their items are read through sources), bound methods.
_MODELED = (
    *CONSTANT_TYPES,
    *IDENTITY_TYPES,
    torch.Tensor,
    tuple,
    list,
    dict,
    set,
    frozenset,
    slice,
    types.MethodType,
    types.CellType,
)


def _refill(obj: Any, contents: Any) -> None:
    obj.clear()
    obj.update(contents)


def _restore_attribute(obj: Any, name: str, old: Any) -> None:
    if old is _ABSENT:
        if hasattr(obj, name):
            delattr(obj, name)
    else:
        setattr(obj, name, old)


def _restore_item(scope: dict[str, Any], name: str, old: Any) -> None:
    if old is _ABSENT:
        scope.pop(name, None)
    else:
        scope[name] = old


def _restore_cell(cell: Any, old: Any) -> None:
    if old is _ABSENT:
        del cell.cell_contents
    else:
        cell.cell_contents = old


def _input_name(source: Source) -> str:
    name = source.name().removeprefix("self.")
    name = "".join(ch if ch.isalnum() else "_" for ch in name).strip("_")
    return name or "input"


def _reason() -> str:
    location = user_location()
    return f"{location.file.rsplit('/', 1)[-1]}:{location.line}" if location else ""


ABSENT = _ABSENT
