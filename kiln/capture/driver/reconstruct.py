"""Re-creating Python values after the graph runs, as lines of generated code.

The captured code's live values (its return value, the stack and locals at a graph break, the
final state of mutated objects) are rebuilt on every call by the generated head function:

* a tensor computed by the graph is a graph output (``___out[2]``); an input tensor is read
  back through its source, so ``return x`` returns the caller's own tensor as eager does;
* constants are literals; objects the capture read from outside are re-read by source or held
  by identity (when an identity guard already pins them);
* containers the code built are rebuilt from their items (each once, so aliasing is kept);
  objects constructed natively are rebuilt from their recipe.

Anything else (a closure created in the frame, a generator) cannot be re-created: that raises
:class:`Unreconstructible`, and the frame is skipped rather than guessed.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch.utils import _pytree as pytree

from kiln.capture.core.iteration import SymbolicIterator
from kiln.capture.core.session import ABSENT, EffectKind, Session, is_constant
from kiln.capture.guards.guards import Identity
from kiln.capture.guards.sizes import size_expression
from kiln.capture.guards.sources import Binder, Source
from kiln.frontends.proxy import ProxyTensor
from kiln.frontends.sizes import SymbolicShape
from kiln.ir.graph import Value
from kiln.ir.symbolic import Sym


class Unreconstructible(Exception):
    pass


class Reconstructor:
    def __init__(self, session: Session, binder: Binder) -> None:
        self.session = session
        self.binder = binder
        self.lines: list[str] = []
        self.outputs: list[Value] = []
        self._output_index: dict[Value, int] = {}
        self._memo: dict[int, str] = {}
        self.closure_cells: dict[int, int] = {}  # id(cell of the frame's closure) -> index
        self._input_sources = {value: source for value, source in session.inputs}
        self._identity = {
            id(guard.obj)
            for guard in session.guards
            if isinstance(guard, Identity) and guard.obj is not None
        }

    # --- values ----------------------------------------------------------------------------
    def value(self, obj: Any) -> str:
        """An expression (valid after ``self.lines`` run) that evaluates to ``obj``."""
        key = id(obj)
        if key in self._memo:
            return self._memo[key]
        if isinstance(obj, ProxyTensor):
            return self._tensor(obj)
        if isinstance(obj, Sym):  # a symbolic size: recomputed from the inputs' sizes
            return size_expression(obj, self.session.shapes, self._source)
        if isinstance(obj, SymbolicShape):
            sizes = "".join(f"{self.value(size)}, " for size in obj)
            return f"{self.binder.bind(torch.Size, 'Size')}(({sizes}))"
        if _is_bound_method(obj):  # e.g. ``x.item`` of a proxy: re-read it off the new value
            return f"getattr({self.value(obj.__self__)}, {obj.__name__!r})"
        if is_constant(obj):
            return self._constant(obj)
        session = self.session
        source = session.source_of(obj)
        if source is not None and not session.is_new(obj):
            return self._existing(obj, source)
        if (
            session.is_new(obj)
            or type(obj) in (tuple, list, dict, set)
            or _is_namedtuple(obj)
            or _is_structseq(obj)
        ):
            return self._new(obj)  # (containers from native calls are rebuilt too)
        if isinstance(obj, torch.Tensor):
            return self._constant_tensor(obj)
        if any(isinstance(v, ProxyTensor) for v in getattr(obj, "__dict__", {}).values()):
            raise Unreconstructible(f"a {type(obj).__name__} holding traced tensors")
        return self.binder.bind(obj, type(obj).__name__)

    def _constant_tensor(self, tensor: torch.Tensor) -> str:
        """A tensor the program made from Python data: one fresh copy per call (every reference
        to it in this call is that copy), or the graph's value when the program wrote it."""
        session = self.session
        if id(tensor) not in session.constant_tensors or id(tensor) in session.poisoned_constants:
            # Reached without a source (an item of an argument container nobody read), or
            # written through memory other constants share: baking it in would be stale.
            raise Unreconstructible("a tensor the capture cannot re-create on the next call")
        written = session.builder.written_constant(tensor)
        if written is not None:
            if written not in self._output_index:
                self._output_index[written] = len(self.outputs)
                self.outputs.append(written)
            expression = f"___out[{self._output_index[written]}]"
        else:
            name = self.binder.fresh("c")
            self.lines.append(f"{name} = {self.binder.bind(tensor, 'tensor')}.clone()")
            expression = name
        self._memo[id(tensor)] = expression
        return expression

    def _tensor(self, proxy: ProxyTensor) -> str:
        current = proxy.current()
        source = self._input_sources.get(proxy._initial)
        if source is not None and proxy._root is None:
            return self._source(source)  # the caller's tensor (mutations are written back)
        view = self._view_of_input(proxy)
        if view is not None:
            return view
        if current not in self._output_index:
            self._output_index[current] = len(self.outputs)
            self.outputs.append(current)
        return f"___out[{self._output_index[current]}]"

    def _view_of_input(self, proxy: ProxyTensor) -> str | None:
        """A view of an input tensor, re-created from the caller's tensor by the same torch call,
        so it aliases it as eager's does; None when ``proxy`` is not such a view."""
        root = proxy._root
        call = proxy._view_call
        if root is None or call is None or root._root is not None:
            return None
        if self._input_sources.get(root._initial) is None:
            return None
        func, args, kwargs, index = call
        # The operand the view is taken of (the first tensor; ``meshgrid([x])`` nests it).
        base = next(
            (leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, ProxyTensor)),
            None,
        )
        if base is None or self._tensor(base).startswith("___out["):
            return None  # the operand is not itself re-created from the input
        items = [self.value(a) for a in args]
        items += [f"{key}={self.value(v)}" for key, v in kwargs.items()]
        expr = f"{self.binder.bind(func, getattr(func, '__name__', 'view'))}({', '.join(items)})"
        return expr if index is None else f"{expr}[{index}]"

    def _constant(self, obj: Any) -> str:
        if type(obj) is tuple:
            return "(" + "".join(f"{self._constant(item)}, " for item in obj) + ")"
        if isinstance(obj, slice):
            return f"slice({self.value(obj.start)}, {self.value(obj.stop)}, {self.value(obj.step)})"
        return self.binder.literal(obj)

    def _existing(self, obj: Any, source: Source) -> str:
        if id(obj) in self._identity:
            return self.binder.bind(obj, type(obj).__name__)
        return self._source(source)

    def _source(self, source: Source) -> str:
        return source.expr(self.binder)

    def _new(self, obj: Any) -> str:
        if type(obj) is tuple:
            return "(" + "".join(f"{self.value(item)}, " for item in obj) + ")"
        if isinstance(obj, slice):
            return f"slice({self.value(obj.start)}, {self.value(obj.stop)}, {self.value(obj.step)})"
        name = self.binder.fresh("v")
        self._memo[id(obj)] = name
        if type(obj) is list:
            items = ", ".join(self.value(item) for item in obj)
            self.lines.append(f"{name} = [{items}]")
        elif type(obj) is dict:
            items = ", ".join(f"{self.value(k)}: {self.value(v)}" for k, v in obj.items())
            self.lines.append(f"{name} = {{{items}}}")
        elif type(obj) is set:
            items = ", ".join(self.value(item) for item in obj)
            self.lines.append(f"{name} = {{{items}}}" if obj else f"{name} = set()")
        elif isinstance(obj, types.CellType):
            self.lines.append(f"{name} = {self.binder.bind(types.CellType, 'CellType')}()")
            try:
                contents = obj.cell_contents
            except ValueError:
                pass  # an empty cell (a variable not yet assigned)
            else:
                self.lines.append(f"{name}.cell_contents = {self.value(contents)}")
        elif isinstance(obj, types.FunctionType) and id(obj) not in self.session.recipes:
            self._function(obj, name)  # (a function made by a call, e.g. vmap(f): its recipe)
        elif _is_structseq(obj):  # torch.return_types.max and friends
            cls = self.binder.bind(type(obj), type(obj).__name__)
            items = ", ".join(self.value(item) for item in obj)
            self.lines.append(f"{name} = {cls}(({items},))")
        elif _is_namedtuple(obj) and id(obj) not in self.session.recipes:
            cls = self.binder.bind(type(obj), type(obj).__name__)
            items = ", ".join(self.value(item) for item in obj)
            self.lines.append(f"{name} = {cls}({items})")
        elif isinstance(obj, SymbolicIterator):
            rest = ", ".join(self.value(item) for item in obj.items[obj.position :])
            self.lines.append(f"{name} = iter([{rest}])")
        elif id(obj) in self.session.recipes:
            self._recipe(obj, name)
        else:
            del self._memo[id(obj)]
            raise Unreconstructible(f"a {type(obj).__name__} created in the compiled code")
        return name

    def _function(self, fn: types.FunctionType, name: str) -> None:
        """A function the code defined (a closure or lambda), over re-created cells."""
        make = self.binder.bind(types.FunctionType, "FunctionType")
        code = self.binder.bind(fn.__code__, "code")
        scope = self.binder.bind(fn.__globals__, "G")
        defaults = self.value(fn.__defaults__) if fn.__defaults__ else "None"
        cells = "".join(f"{self._cell(cell)}, " for cell in fn.__closure__ or ())
        closure = f"({cells})" if fn.__closure__ else "None"
        self.lines.append(
            f"{name} = {make}({code}, {scope}, {fn.__name__!r}, {defaults}, {closure})"
        )
        self.lines.append(f"{name}.__qualname__ = {fn.__qualname__!r}")
        if fn.__kwdefaults__:
            self.lines.append(f"{name}.__kwdefaults__ = {self.value(fn.__kwdefaults__)}")

    def _cell(self, cell: Any) -> str:
        """A cell of a re-created closure: a new one, or the running function's own."""
        if id(cell) in self.closure_cells:
            return f"___f.__closure__[{self.closure_cells[id(cell)]}]"
        if self.session.is_new(cell):
            return self.value(cell)
        return self.binder.bind(cell, "cell")

    def _recipe(self, obj: Any, name: str) -> None:
        recipe = self.session.recipes[id(obj)]
        if recipe.fn is object.__new__:
            cls = self.binder.bind(recipe.args[0], recipe.args[0].__name__)
            self.lines.append(f"{name} = {cls}.__new__({cls})")
            state = vars(obj) if hasattr(obj, "__dict__") else {}
            for attr, value in state.items():
                self.lines.append(f"{name}.__dict__[{attr!r}] = {self.value(value)}")
            return
        fn = self.binder.bind(recipe.fn, getattr(recipe.fn, "__name__", "fn"))
        args = [self.value(arg) for arg in recipe.args]
        args += [f"{key}={self.value(value)}" for key, value in recipe.kwargs.items()]
        self.lines.append(f"{name} = {fn}({', '.join(args)})")
        for attr, value in recipe.attributes.items():
            if value is ABSENT:
                self.lines.append(f"delattr({name}, {attr!r})")
            else:
                self.lines.append(f"setattr({name}, {attr!r}, {self.value(value)})")
        if isinstance(obj, dict) and type(obj) is not dict:  # e.g. ModelOutput keys set later
            for key, value in obj.items():
                if key not in recipe.kwargs:
                    self.lines.append(f"{name}[{self.value(key)}] = {self.value(value)}")

    # --- side effects ------------------------------------------------------------------------
    def effects(self) -> None:
        """Lines that replay the final state of every pre-existing object the code mutated."""
        for effect in self.session.effects.values():
            target = effect.target
            if effect.kind is EffectKind.CONTAINER:
                if self._unchanged(target, effect.snapshot):
                    continue  # (written back as it was: nothing to replay, nothing to pin)
                name = self.binder.fresh("t")
                self.lines.append(f"{name} = {self._target(target)}")
                if isinstance(target, list):
                    self._replay_list(name, target, effect.snapshot)
                elif isinstance(target, dict):
                    self._replay_dict(name, target, effect.snapshot)
                else:
                    added = ", ".join(self.value(item) for item in target - effect.snapshot)
                    gone = ", ".join(self.value(item) for item in effect.snapshot - target)
                    self.lines.append(f"{name}.difference_update([{gone}])")
                    self.lines.append(f"{name}.update([{added}])")
            elif effect.kind is EffectKind.ATTRIBUTE:
                expr = self._target(target)
                if _has_attribute(target, effect.key):
                    value = self.value(getattr(target, effect.key))
                    self.lines.append(f"setattr({expr}, {effect.key!r}, {value})")
                else:  # deleted (or set and deleted again): absent afterwards, as in eager
                    key = repr(effect.key)
                    self.lines.append(
                        f"___t = {expr}\nif hasattr(___t, {key}): delattr(___t, {key})"
                    )
            elif effect.kind is EffectKind.GLOBAL:
                scope = self.binder.bind(target, "G")
                if effect.key in target:
                    value = self.value(target[effect.key])
                    self.lines.append(f"{scope}[{effect.key!r}] = {value}")
                else:
                    self.lines.append(f"{scope}.pop({effect.key!r}, None)")
            else:
                cell = (
                    self._cell(target) if id(target) in self.closure_cells else self._target(target)
                )
                value = self.value(target.cell_contents)
                self.lines.append(f"{cell}.cell_contents = {value}")

    def _unchanged(self, final: Any, before: Any) -> bool:
        """Whether a mutated container holds what it held before, item for item (T5's
        ``config.id2label``, set again to equal contents during the forward pass). Replaying it
        would pin the container in the head by identity, which the artifact cache refuses."""
        traced = self.session.traced_version

        def same(a: Any, b: Any) -> bool:
            return a is b or a is traced(b)

        if isinstance(final, dict):
            return final.keys() == before.keys() and all(same(final[k], before[k]) for k in final)
        if isinstance(final, list):
            return len(final) == len(before) and all(map(same, final, before))
        return bool(final == before)

    def _replay_list(self, name: str, final: list[Any], before: list[Any]) -> None:
        """Appends replay as ``extend`` (any length of caller's list); other changes rebuild
        the list, reading unchanged items from it by index (its length is guarded)."""
        traced = self.session.traced_version
        origin = {id(traced(item)): i for i, item in enumerate(before)}
        origin.update({id(item): i for i, item in enumerate(before)})
        count = len(before)
        if len(final) >= count and all(origin.get(id(final[i])) == i for i in range(count)):
            if len(final) > count:
                items = ", ".join(self.value(item) for item in final[count:])
                self.lines.append(f"{name}.extend([{items}])")
            return
        self.session.guard_contents(final)
        items = ", ".join(
            f"{name}[{origin[id(item)]}]" if id(item) in origin else self.value(item)
            for item in final
        )
        self.lines.append(f"{name}[:] = [{items}]")

    def _replay_dict(self, name: str, final: dict[Any, Any], before: dict[Any, Any]) -> None:
        """Only the keys the code set or removed are replayed."""
        traced = self.session.traced_version
        for key, value in final.items():
            if key in before and (value is before[key] or value is traced(before[key])):
                continue
            self.lines.append(f"{name}[{self.value(key)}] = {self.value(value)}")
        for key in before:
            if key not in final:
                self.lines.append(f"{name}.pop({self.value(key)}, None)")

    def _target(self, obj: Any) -> str:
        source = self.session.source_of(obj)
        if source is not None and id(obj) not in self._identity:
            return self._source(source)
        return self.binder.bind(obj, type(obj).__name__)


def _holds_proxy(value: Any) -> bool:
    if isinstance(value, ProxyTensor):
        return True
    if isinstance(value, list | tuple):
        return any(_holds_proxy(item) for item in value)
    return isinstance(value, dict) and any(_holds_proxy(v) for v in value.values())


def _is_structseq(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "n_fields")


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_bound_method(obj: Any) -> bool:
    if not isinstance(obj, types.MethodType | types.BuiltinMethodType):
        return False
    owner = getattr(obj, "__self__", None)
    return owner is not None and not isinstance(owner, types.ModuleType | type)


def _has_attribute(obj: Any, name: str) -> bool:
    try:
        getattr(obj, name)
    except AttributeError:
        return False
    return True
