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

from typing import Any

import torch

from kiln.capture.guards import Identity
from kiln.capture.iteration import SymbolicIterator
from kiln.capture.session import ABSENT, EffectKind, Session, is_constant
from kiln.capture.sources import Binder, Source
from kiln.frontends.proxy import ProxyTensor
from kiln.ir.graph import Value


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
        if is_constant(obj):
            return self._constant(obj)
        session = self.session
        source = session.source_of(obj)
        if source is not None and not session.is_new(obj):
            return self._existing(obj, source)
        if session.is_new(obj):
            return self._new(obj)
        if isinstance(obj, torch.Tensor):
            return f"{self.binder.bind(obj, 'tensor')}.clone()"
        return self.binder.bind(obj, type(obj).__name__)

    def _tensor(self, proxy: ProxyTensor) -> str:
        current = proxy.current()
        source = self._input_sources.get(proxy._initial)
        if source is not None and proxy._root is None:
            return self._source(source)  # the caller's tensor (mutations are written back)
        if current not in self._output_index:
            self._output_index[current] = len(self.outputs)
            self.outputs.append(current)
        return f"___out[{self._output_index[current]}]"

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
        elif isinstance(obj, SymbolicIterator):
            rest = ", ".join(self.value(item) for item in obj.items[obj.position :])
            self.lines.append(f"{name} = iter([{rest}])")
        elif id(obj) in self.session.recipes:
            self._recipe(obj, name)
        else:
            del self._memo[id(obj)]
            raise Unreconstructible(f"a {type(obj).__name__} created in the compiled code")
        return name

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
                expr = self._target(target)
                if isinstance(target, list):
                    items = ", ".join(self.value(item) for item in target)
                    self.lines.append(f"{expr}[:] = [{items}]")
                elif isinstance(target, dict):
                    items = ", ".join(
                        f"{self.value(k)}: {self.value(v)}" for k, v in target.items()
                    )
                    self.lines.append(f"___t = {expr}; ___t.clear(); ___t.update({{{items}}})")
                else:
                    items = ", ".join(self.value(item) for item in target)
                    self.lines.append(f"___t = {expr}; ___t.clear(); ___t.update([{items}])")
            elif effect.kind is EffectKind.ATTRIBUTE:
                expr = self._target(target)
                if _has_attribute(target, effect.key):
                    value = self.value(getattr(target, effect.key))
                    self.lines.append(f"setattr({expr}, {effect.key!r}, {value})")
                else:
                    self.lines.append(f"delattr({expr}, {effect.key!r})")
            elif effect.kind is EffectKind.GLOBAL:
                scope = self.binder.bind(target, "G")
                if effect.key in target:
                    value = self.value(target[effect.key])
                    self.lines.append(f"{scope}[{effect.key!r}] = {value}")
                else:
                    self.lines.append(f"{scope}.pop({effect.key!r}, None)")
            else:
                cell = self.binder.bind(target, "cell")
                value = self.value(target.cell_contents)
                self.lines.append(f"{cell}.cell_contents = {value}")

    def _target(self, obj: Any) -> str:
        source = self.session.source_of(obj)
        if source is not None and id(obj) not in self._identity:
            return self._source(source)
        return self.binder.bind(obj, type(obj).__name__)


def _has_attribute(obj: Any, name: str) -> bool:
    try:
        getattr(obj, name)
    except AttributeError:
        return False
    return True
