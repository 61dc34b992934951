"""What runs natively during capture, on capture's values, and the checks before it does.

Pure builtins, methods of immutable values and of tensors, torch's own Python functions (which
only see proxies) and pure standard-library helpers run natively; containers read from outside
the frame are passed as new containers of their guarded items. Objects capture cannot follow
(``session.opaque``) stop capture before any native step computes on them.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.frame import Frame
from kiln.capture.core.iteration import SymbolicIterator, items_of
from kiln.capture.guards.probing import probe
from kiln.capture.guards.sources import Item
from kiln.frontends.proxy import dispatch as dispatch_traced
from kiln.ir.symbolic import Sym
from kiln.ops.translations import lookup

# Modules whose C functions are pure enough to run natively on capture values.
_NATIVE_MODULES = frozenset(
    {"math", "operator", "_operator", "builtins", "torch", "cmath", "string", "re", "_functools"}
)


# Methods of builtin containers that mutate them.
MUTATING = frozenset(
    {
        "append",
        "extend",
        "insert",
        "pop",
        "remove",
        "clear",
        "sort",
        "reverse",
        "update",
        "setdefault",
        "popitem",
        "add",
        "discard",
        "difference_update",
        "intersection_update",
        "symmetric_difference_update",
        "__setitem__",
        "__delitem__",
        "move_to_end",
        "appendleft",
        "extendleft",
        "popleft",
    }
)


IMMUTABLE = (str, bytes, int, float, complex, bool, tuple, frozenset, range, slice, type(None))


_TENSOR_OR_IMMUTABLE = (torch.Tensor, *IMMUTABLE)


def python_dunder(obj: Any, name: str) -> types.FunctionType | None:
    """The Python function implementing ``type(obj).name``, if it is Python code to inline."""
    method = getattr(type(obj), name, None)
    if isinstance(method, types.FunctionType) and not runs_natively(method):
        return method
    return None


# Standard-library modules whose Python functions are pure enough to run natively (inlining
# them would only cost capture time).
_NATIVE_PYTHON_MODULES = frozenset(
    {
        "inspect",
        "typing",
        "dataclasses",
        "enum",
        "abc",
        "re",
        "string",
        "textwrap",
        "posixpath",
        "ntpath",
        "genericpath",
        "numbers",
        "collections",
        "copyreg",
        "weakref",
        "_weakrefset",
    }
)


def runs_natively(fn: types.FunctionType) -> bool:
    """torch's own Python functions outside nn.modules only see proxies: run them natively;
    so do pure standard-library helpers (``inspect.signature``, ``dataclasses.fields``)."""
    if lookup(fn) is not None:
        return True
    module = fn.__module__ or ""
    if module.startswith("kiln.capture.") or module in ("kiln.ir.symbolic", "kiln.frontends.sizes"):
        return True  # capture's own stand-ins met by user code (a Function's ctx, sizes)
    if module.split(".")[0] in _NATIVE_PYTHON_MODULES:
        return True
    if module == "torch" or module.startswith("torch."):
        return not (module.startswith("torch.nn.modules") or module.startswith("torch.nn.utils"))
    # torch.func's transformed functions carry the user function's module (functools.wraps)
    # but are functorch's code, which runs only on real tensors.
    return fn.__code__.co_filename.startswith(FUNCTORCH)


FUNCTORCH = os.path.join(os.path.dirname(torch.__file__), "_functorch", "")


def reason_for(fn: Any) -> BreakReason:
    """I/O (logging, warnings, files) or another call capture cannot model."""
    module = str(probe(fn, "__module__") or type(fn).__module__ or "")
    name = str(probe(fn, "__name__", ""))
    if "logging" in module or "warnings" in module or name.startswith(("warn", "log", "print")):
        return BreakReason.IO
    return BreakReason.UNSUPPORTED_CALL


def native(frame: Frame, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``fn`` natively; containers read from outside the frame are passed as new
    containers of their guarded items (so ``torch.cat(xs)`` sees proxies, not the caller's
    tensors)."""
    session = frame.session
    for value in (*args, *kwargs.values()):
        if session.opaque(value):  # (torch.from_numpy(array): the head converts it natively)
            what = f"{describe(fn)} of a {type(value).__name__} read from outside the frame"
            raise GraphBreak(BreakReason.UNSUPPORTED_CALL, what)
    args = tuple(materialize(session, arg) for arg in args)
    kwargs = {key: materialize(session, value) for key, value in kwargs.items()}
    if _has_symbolic_size((args, kwargs)):
        traced = _traced_torch_call(fn, args, kwargs)
        if traced is not None:
            return traced()
    return fn(*args, **kwargs)


def _has_symbolic_size(values: Any) -> bool:
    if isinstance(values, Sym):
        return True
    if isinstance(values, tuple | list):
        return any(_has_symbolic_size(item) for item in values)
    if isinstance(values, dict):
        return any(_has_symbolic_size(item) for item in values.values())
    return False


def _traced_torch_call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A torch call given a symbolic size (``torch.arange(n)``, ``x.view(b, -1)``), which
    torch's argument parser would refuse before any override sees it: it goes straight to the
    proxies' dispatch (a translation keeps the size symbolic). None for other calls (a Python
    function given a size: the size's int specializes it, guarded)."""
    owner = probe(fn, "__self__")
    if isinstance(owner, torch.Tensor) and hasattr(torch.Tensor, probe(fn, "__name__", "")):
        method = getattr(torch.Tensor, fn.__name__)
        return lambda: dispatch_traced(method, (owner, *args), kwargs)
    module = probe(fn, "__module__") or probe(owner, "__name__", "") or ""
    if module == "torch" or module.startswith("torch.") or owner is torch._C._VariableFunctions:
        return lambda: dispatch_traced(fn, args, kwargs)
    return None


def materialize(session: Any, value: Any) -> Any:
    if type(value) not in (list, tuple, dict) or session.source_of(value) is None:
        return value
    if session.is_new(value):
        return value
    if isinstance(value, dict):
        return session.new(_dict_items_of(session, value))
    items = items_of(session, value) or []
    return session.new(type(value)(materialize(session, item) for item in items))


def _dict_items_of(session: Any, mapping: dict[Any, Any]) -> dict[Any, Any]:
    source = session.source_of(mapping)
    session.guard_contents(mapping)
    return {k: materialize(session, session.wrap(mapping[k], Item(source, k))) for k in mapping}


def call_builtin(frame: Frame, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", "")
    if frame.session.opaque(owner):  # array.sum(): only NumPy knows what it reads
        what = f"{type(owner).__name__}.{name} of an object read from outside the frame"
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, what)
    if owner is not None and not isinstance(owner, types.ModuleType):
        if isinstance(owner, _TENSOR_OR_IMMUTABLE):
            return native(frame, fn, args, kwargs)
        if isinstance(owner, list | dict | set) or type(owner).__name__ in ("deque", "OrderedDict"):
            return _container_method(frame, owner, name, fn, args, kwargs)
        if isinstance(owner, SymbolicIterator | type):
            return native(frame, fn, args, kwargs)
        if getattr(type(owner), "__module__", "").startswith("torch"):
            return native(frame, fn, args, kwargs)
    module = getattr(fn, "__module__", None) or probe(owner, "__name__", "") or ""
    if module.split(".")[0] in _NATIVE_MODULES:
        return native(frame, fn, args, kwargs)
    raise GraphBreak(reason_for(fn), f"call to {describe(fn)}")


def _container_method(
    frame: Frame,
    owner: Any,
    name: str,
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    session = frame.session
    source = session.source_of(owner)
    existing = source is not None and not session.is_new(owner)
    if name in MUTATING:
        session.touch_container(owner)
        if existing and name not in _BLIND_WRITES:
            wrap_contents(session, owner)  # the method reads the items: trace them
        args = tuple(materialize(session, arg) for arg in args)
        return fn(*args, **kwargs)
    if source is None or not existing or not isinstance(owner, dict):
        if existing:
            wrap_contents(session, owner)
            session.guard_contents(owner)  # (a set's members: its methods read them all)
            fn = getattr(owner, name)
        result = fn(*args, **kwargs)
        if name in ("copy", "keys", "values", "items") and isinstance(result, list | dict):
            session.new(result)
        return result
    if name != "__getitem__":  # (a missing key raises: its item's guard fails then)
        session.guard_contents(owner)  # what the method returns depends on the keys
    if name == "get":
        key = args[0]
        if key in owner:
            return session.wrap(owner[key], Item(source, key))
        return args[1] if len(args) > 1 else kwargs.get("default")
    if name == "__getitem__":
        return session.wrap(owner[args[0]], Item(source, args[0]))
    if name == "values":
        return session.new(
            SymbolicIterator([session.wrap(owner[k], Item(source, k)) for k in owner])
        )
    if name == "items":
        pairs = [session.new((k, session.wrap(owner[k], Item(source, k)))) for k in owner]
        return session.new(SymbolicIterator(pairs))
    return fn(*args, **kwargs)


# Mutating methods that do not read a container's existing items.
_BLIND_WRITES = frozenset({"append", "extend", "add", "update", "clear", "appendleft"})


def wrap_contents(session: Any, owner: Any) -> None:
    """Swap a pre-existing list's items for their traced (guarded) versions, in place: the
    container is journalled, so capture's undo restores the caller's objects."""
    if isinstance(owner, list):
        items = items_of(session, owner) or []
        session.touch_container(owner)
        owner[:] = items
    elif isinstance(owner, dict):
        session.touch_container(owner)
        owner.update(_dict_items_of(session, owner))


def describe(fn: Any) -> str:
    module = probe(fn, "__module__") or type(fn).__module__
    name = probe(fn, "__qualname__") or probe(fn, "__name__") or type(fn).__qualname__
    return f"{module}.{name}" if module and module != "builtins" else str(name)


def holds_tensors(value: Any, seen: set[int] | None = None, depth: int = 0) -> bool:
    """Whether ``value`` reaches a tensor through containers and object attributes."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        return True
    if id(value) in seen or depth > 8 or isinstance(value, (str, bytes, int, float, type)):
        return False
    seen.add(id(value))
    if isinstance(value, dict):
        items: Any = list(value.keys()) + list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        items = list(getattr(value, "__dict__", {}).values())
    return any(holds_tensors(item, seen, depth + 1) for item in items)


def no_opaque(frame: Frame, what: str, *values: Any) -> Any:
    """Break before capture computes on an object it cannot follow (``session.opaque``):
    the head performs the step natively on each call. Returns the (last) value."""
    for value in values:
        if frame.session.opaque(value):
            raise GraphBreak(
                BreakReason.UNSUPPORTED_CALL,
                f"{what} on a {type(value).__name__} read from outside the frame",
            )
    return values[-1] if values else None


def no_tensor(value: Any, what: str) -> None:
    if isinstance(value, torch.Tensor):
        raise GraphBreak(BreakReason.DATA_DEPENDENT, f"{what} of a tensor needs its values")
