"""Calls during capture: what gets inlined, what runs natively, and what breaks the graph.

The policy, in order:

1. torch functions with a translation, torch's C functions and tensor methods run natively:
   proxies send them through ``__torch_function__`` into the graph;
2. ``nn.Module`` calls follow ``Module.__call__`` (forward pre-hooks, ``forward`` inlined,
   forward hooks);
3. Python functions are inlined (a child :class:`~kiln.capture.core.frame.Frame`), except
   torch's own functional code outside ``torch.nn.modules``, which only sees proxies and runs
   natively;
4. builtins that take callbacks or iterate (``map``, ``sorted``, ``zip``, ``enumerate``...) are
   modelled in ``kiln/capture/calls/builtins.py``; pure builtins and methods of immutable values
   run natively;
5. classes: known value types are constructed natively (with a recipe to re-create them after
   the graph), other user classes get ``__new__`` natively and ``__init__`` inlined;
6. anything else (a C function capture cannot see into, I/O) is a graph break.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import types
import weakref
from typing import Any

import torch

from kiln.capture.calls.autograd_function import apply_function, is_function_apply
from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.frame import NULL, Frame
from kiln.capture.core.iteration import SymbolicIterator, collect, items_of
from kiln.capture.core.session import Recipe
from kiln.ops.translations import lookup

CO_GENERATOR = inspect.CO_GENERATOR
CO_ASYNC = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
MAX_DEPTH = 48

# Modules whose C functions are pure enough to run natively on capture values.
_NATIVE_MODULES = frozenset(
    {"math", "operator", "_operator", "builtins", "torch", "cmath", "string", "re", "_functools"}
)
# Methods of builtin containers that mutate them.
_MUTATING = frozenset(
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
_IMMUTABLE = (str, bytes, int, float, complex, bool, tuple, frozenset, range, slice, type(None))
_TENSOR_OR_IMMUTABLE = (torch.Tensor, *_IMMUTABLE)


def python_dunder(obj: Any, name: str) -> types.FunctionType | None:
    """The Python function implementing ``type(obj).name``, if it is Python code to inline."""
    method = getattr(type(obj), name, None)
    if isinstance(method, types.FunctionType) and not _runs_natively(method):
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


def _runs_natively(fn: types.FunctionType) -> bool:
    """torch's own Python functions outside nn.modules only see proxies: run them natively;
    so do pure standard-library helpers (``inspect.signature``, ``dataclasses.fields``)."""
    if lookup(fn) is not None:
        return True
    module = fn.__module__ or ""
    if module.startswith("kiln.capture."):
        return True  # capture's own stand-ins met by user code (a Function's ctx)
    if module.split(".")[0] in _NATIVE_PYTHON_MODULES:
        return True
    if module == "torch" or module.startswith("torch."):
        return not (module.startswith("torch.nn.modules") or module.startswith("torch.nn.utils"))
    # torch.func's transformed functions carry the user function's module (functools.wraps)
    # but are functorch's code, which runs only on real tensors.
    return fn.__code__.co_filename.startswith(_FUNCTORCH)


_FUNCTORCH = os.path.join(os.path.dirname(torch.__file__), "_functorch", "")


def call_function(frame: Frame, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call ``fn(*args, **kwargs)`` symbolically from ``frame``."""
    from kiln.capture.calls import builtins as models

    if fn is NULL:
        raise TypeError("'NoneType' object is not callable")
    model = models.MODELS.get(_key(fn))
    if model is not None:
        return model(frame, *args, **kwargs)
    if is_function_apply(fn):
        return apply_function(frame, fn.__self__, args, kwargs)
    if _stateful(fn):
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"{_describe(fn)} changes random state")
    if isinstance(fn, weakref.ReferenceType) and not args and not kwargs:
        return _dereference(frame, fn)
    if isinstance(fn, _LRU_CACHED):
        return _cached_call(frame, fn, args, kwargs)
    if id(fn) in frame.session.opaque_callables:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"{name} transformed by torch.func")
    if isinstance(fn, types.MethodType):
        return call_function(frame, fn.__func__, (fn.__self__, *args), kwargs)
    if isinstance(fn, torch.jit.ScriptFunction):
        # TorchScript runs its own interpreter, which proxies cannot pass through; the Python
        # function it was made from (torch.jit.script keeps it) computes the same.
        original = getattr(fn, "_torchdynamo_inline", None)
        if not isinstance(original, types.FunctionType):
            raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"TorchScript function {fn.name}")
        return call_function(frame, original, args, kwargs)
    if isinstance(fn, types.FunctionType):
        if fn.__code__.co_filename.startswith(_FUNCTORCH):  # (vjp's pullback, vmap's wrapper)
            raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"torch.func's {fn.__qualname__}")
        if _runs_natively(fn):
            return native(frame, fn, args, kwargs)
        return inline(frame, fn, args, kwargs)
    if isinstance(fn, torch.jit.ScriptModule):  # (keeps no Python forward to follow)
        name = getattr(fn, "original_name", type(fn).__name__)
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"TorchScript module {name}")
    if isinstance(fn, torch.nn.Module):
        from kiln.capture.calls.modules import call_module

        return call_module(frame, fn, args, kwargs)
    if isinstance(fn, type):
        return construct(frame, fn, args, kwargs)
    if isinstance(fn, functools.partial):
        return call_function(frame, fn.func, (*fn.args, *args), {**fn.keywords, **kwargs})
    if isinstance(fn, types.BuiltinFunctionType | types.BuiltinMethodType):
        return _call_builtin(frame, fn, args, kwargs)
    if isinstance(fn, types.MethodDescriptorType | types.WrapperDescriptorType):
        owner = getattr(fn, "__objclass__", object)
        if args and isinstance(args[0], list | dict | set) and fn.__name__ in _MUTATING:
            frame.session.touch_container(args[0])
        if issubclass(owner, torch._C.TensorBase) or owner in (*_IMMUTABLE, list, dict, set):
            return native(frame, fn, args, kwargs)
    if isinstance(fn, types.MethodWrapperType):
        return _call_builtin(frame, fn, args, kwargs)
    call = python_dunder(fn, "__call__")
    if call is not None:
        return inline(frame, call, (fn, *args), kwargs)
    from kiln.capture.driver.resume import Router

    if isinstance(fn, Router):  # code Kiln routed (``route(f)(x)``): capture follows f itself
        return args[0]
    if getattr(type(fn), "__module__", "").startswith("torch"):
        return native(frame, fn, args, kwargs)
    raise GraphBreak(_reason_for(fn), f"call to {_describe(fn)}")


# torch functions that read or set global random state: they run natively, in program order.
_RANDOM_STATE = frozenset(
    {
        torch.manual_seed,
        torch.seed,
        torch.initial_seed,
        torch.get_rng_state,
        torch.set_rng_state,
        torch.cuda.manual_seed,
        torch.cuda.manual_seed_all,
        torch.cuda.seed,
        torch.cuda.get_rng_state,
        torch.cuda.set_rng_state,
    }
)


def _stateful(fn: Any) -> bool:
    """Random state the graph cannot hold: global seeds, and ``torch.Generator`` objects
    (constructed, seeded, read) whose state PyTorch alone advances."""
    if _key(fn) in _RANDOM_STATE or _key(getattr(fn, "__wrapped__", None)) in _RANDOM_STATE:
        return True  # (importing torch._dynamo wraps torch.manual_seed)
    if isinstance(fn, type):
        return issubclass(fn, torch.Generator)
    return isinstance(getattr(fn, "__self__", None), torch.Generator)


def _reason_for(fn: Any) -> BreakReason:
    """I/O (logging, warnings, files) or another call capture cannot model."""
    module = str(getattr(fn, "__module__", None) or type(fn).__module__ or "")
    name = str(getattr(fn, "__name__", ""))
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
            what = f"{_describe(fn)} of a {type(value).__name__} read from outside the frame"
            raise GraphBreak(BreakReason.UNSUPPORTED_CALL, what)
    args = tuple(materialize(session, arg) for arg in args)
    kwargs = {key: materialize(session, value) for key, value in kwargs.items()}
    return fn(*args, **kwargs)


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
    from kiln.capture.guards.sources import Item

    source = session.source_of(mapping)
    session.guard_contents(mapping)
    return {k: materialize(session, session.wrap(mapping[k], Item(source, k))) for k in mapping}


def _key(fn: Any) -> Any:
    try:
        hash(fn)
    except TypeError:
        return None
    return fn


def _call_builtin(frame: Frame, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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
    module = getattr(fn, "__module__", None) or getattr(owner, "__name__", "") or ""
    if module.split(".")[0] in _NATIVE_MODULES:
        return native(frame, fn, args, kwargs)
    raise GraphBreak(_reason_for(fn), f"call to {_describe(fn)}")


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
    if name in _MUTATING:
        session.touch_container(owner)
        if existing and name not in _BLIND_WRITES:
            _wrap_contents(session, owner)  # the method reads the items: trace them
        args = tuple(materialize(session, arg) for arg in args)
        return fn(*args, **kwargs)
    if source is None or not existing or not isinstance(owner, dict):
        if existing:
            _wrap_contents(session, owner)
            fn = getattr(owner, name)
        result = fn(*args, **kwargs)
        if name in ("copy", "keys", "values", "items") and isinstance(result, list | dict):
            session.new(result)
        return result
    from kiln.capture.guards.sources import Item

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


def _wrap_contents(session: Any, owner: Any) -> None:
    """Swap a pre-existing list's items for their traced (guarded) versions, in place: the
    container is journalled, so capture's undo restores the caller's objects."""
    if isinstance(owner, list):
        items = items_of(session, owner) or []
        session.touch_container(owner)
        owner[:] = items
    elif isinstance(owner, dict):
        session.touch_container(owner)
        owner.update(_dict_items_of(session, owner))


def inline(
    frame: Frame, fn: types.FunctionType, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run a Python function's bytecode symbolically in a child frame."""
    session = frame.session
    code = fn.__code__
    if code.co_flags & CO_ASYNC:
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"coroutine {fn.__qualname__}")
    if session.inline_depth >= MAX_DEPTH:
        raise GraphBreak(BreakReason.INLINE_DEPTH, f"{fn.__qualname__} nested {MAX_DEPTH} deep")
    local_values = bind_arguments(session, fn, args, kwargs)
    cells = dict(zip(code.co_freevars, fn.__closure__ or (), strict=True))
    child = Frame(
        session, code, fn.__globals__, local_values, function=fn, cells=cells, parent=frame
    )
    session.inline_depth += 1
    try:
        if code.co_flags & CO_GENERATOR:
            child.yielded = []
            child.run()
            return session.new(SymbolicIterator(child.yielded))
        return child.run()
    finally:
        session.inline_depth -= 1
        frame.restore_location()


def bind_arguments(
    session: Any, fn: types.FunctionType, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The callee's locals for ``fn(*args, **kwargs)``, bound as CPython binds them (including
    comprehension code's ``.0`` argument); a TypeError like CPython's otherwise."""
    code = fn.__code__
    names = code.co_varnames
    count = code.co_argcount
    keyword_count = code.co_kwonlyargcount
    has_varargs = bool(code.co_flags & 0x04)
    has_varkw = bool(code.co_flags & 0x08)
    qualname = fn.__qualname__
    local_values: dict[str, Any] = {}
    for name, value in zip(names[:count], args, strict=False):
        local_values[name] = value
    extra = args[count:]
    if extra and not has_varargs:
        raise TypeError(
            f"{qualname}() takes {count} positional argument{'s' if count != 1 else ''} "
            f"but {len(args)} were given"
        )
    keyword_names = names[count : count + keyword_count]
    varkw: dict[str, Any] = {}
    posonly = set(names[: code.co_posonlyargcount])
    for key, value in kwargs.items():
        if key in posonly or (key not in names[:count] and key not in keyword_names):
            if not has_varkw:
                raise TypeError(f"{qualname}() got an unexpected keyword argument '{key}'")
            varkw[key] = value
        elif key in local_values:
            raise TypeError(f"{qualname}() got multiple values for argument '{key}'")
        else:
            local_values[key] = value
    defaults = fn.__defaults__ or ()
    first_default = count - len(defaults)
    for i, name in enumerate(names[:count]):
        if name not in local_values:
            if i < first_default:
                raise TypeError(f"{qualname}() missing required positional argument: '{name}'")
            local_values[name] = defaults[i - first_default]
    kwdefaults = fn.__kwdefaults__ or {}
    for name in keyword_names:
        if name not in local_values:
            if name not in kwdefaults:
                raise TypeError(f"{qualname}() missing required keyword-only argument: '{name}'")
            local_values[name] = kwdefaults[name]
    index = count + keyword_count
    if has_varargs:
        local_values[names[index]] = session.new(tuple(extra))
        index += 1
    if has_varkw:
        local_values[names[index]] = session.new(varkw)
    return local_values


# Classes constructed natively (their constructors only store values).
_VALUE_CLASSES: tuple[type, ...] = (
    torch.Size,
    torch.device,
    torch.no_grad,
    torch.enable_grad,
    torch.set_grad_enabled,
    torch.inference_mode,
    torch.autocast,
    slice,
    range,
    functools.partial,
)


_CONTAINER_MODULES = (
    torch.nn.ModuleList,
    torch.nn.Sequential,
    torch.nn.ModuleDict,
    torch.nn.ParameterList,
    torch.nn.ParameterDict,
)


def construct(frame: Frame, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``cls(*args, **kwargs)`` during capture."""
    session = frame.session
    if issubclass(cls, BaseException) or cls in (object, int, float, bool, complex, bytes):
        for value in (*args, *kwargs.values()):
            if session.opaque(value):  # float(array)
                what = f"{cls.__name__}() of a {type(value).__name__} read from outside"
                raise GraphBreak(BreakReason.UNSUPPORTED_CALL, what)
        return cls(*args, **kwargs)  # a proxy argument raises: a data-dependent break
    if cls in _CONTAINER_MODULES:  # e.g. ModuleList slicing builds a new container
        return session.new(cls(*args, **kwargs), Recipe(cls, args, kwargs))
    if issubclass(cls, torch.nn.Module) and cls.__module__.startswith("torch.nn."):
        return _stateless_module(frame, cls, args, kwargs)
    if issubclass(cls, torch.nn.Module) or issubclass(cls, torch.Tensor):
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"constructing {cls.__qualname__}")
    if _native_constructor(cls):
        obj = cls(*args, **kwargs)
        return session.new(obj, Recipe(cls, args, kwargs))
    new = cls.__new__
    if new is not object.__new__:
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"{cls.__qualname__}.__new__")
    obj = object.__new__(cls)
    session.new(obj, Recipe(object.__new__, (cls,), {}))
    init = cls.__init__
    if isinstance(init, types.FunctionType):
        inline(frame, init, (obj, *args), kwargs)
    elif init is not object.__init__:
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"{cls.__qualname__}.__init__")
    elif args or kwargs:
        raise TypeError(f"{cls.__qualname__}() takes no arguments")
    return obj


_LRU_CACHED = type(functools.lru_cache(lambda: None))


def _cached_call(frame: Frame, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A ``functools.lru_cache`` function (transformers' ``is_torch_distributed_available``,
    ``logger.warning_once``): without tensor arguments it runs natively, answering from its
    cache as eager's call would (a first call's side effect happens now, during the first
    call); with tensors the function itself is followed."""
    from kiln.capture.calls.builtins import _holds_tensors

    if not any(_holds_tensors(value) for value in (*args, *kwargs.values())):
        return native(frame, fn, args, kwargs)
    return call_function(frame, fn.__wrapped__, args, kwargs)


def _dereference(frame: Frame, ref: weakref.ReferenceType[Any]) -> Any:
    """``ref()``: the target, read through the reference's source (guarded, a graph input for
    a tensor), so code comparing it with the object it expects (``ref() is weight`` in
    ``nn.RNNBase``) sees the same traced value."""
    from kiln.capture.guards.sources import Called

    session = frame.session
    target = ref()
    source = session.source_of(ref)
    if target is None or source is None or session.is_new(ref):
        return session.traced_version(target)
    return session.wrap(target, Called(source))


def _stateless_module(
    frame: Frame, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A torch.nn module made inside the code (``CrossEntropyLoss(ignore_index=-100)`` in a
    forward): constructed natively and re-created from its recipe, when it holds no tensors.
    One with parameters or buffers (fresh random weights on every eager call) breaks."""
    if any(isinstance(v, torch.Tensor) for v in (*args, *kwargs.values())):
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"constructing {cls.__qualname__}")
    module = cls(*args, **kwargs)
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"constructing {cls.__qualname__}")
    return frame.session.new(module, Recipe(cls, args, kwargs))


def _native_constructor(cls: type) -> bool:
    if issubclass(cls, _VALUE_CLASSES) or dataclasses.is_dataclass(cls):
        return True
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return True  # namedtuple
    return issubclass(cls, dict) or cls.__module__.startswith("torch")


def iterate(frame: Frame, value: Any) -> list[Any]:
    """The items of ``value`` when ``items_of`` cannot list them: Python ``__iter__`` is
    inlined; native iterators are exhausted natively."""
    items = items_of(frame.session, value)
    if items is not None:
        return items
    method = python_dunder(value, "__iter__")
    if method is not None:
        iterator = inline(frame, method, (value,), {})
        listed = items_of(frame.session, iterator)
        return listed if listed is not None else _exhaust(frame, iterator)
    if python_dunder(value, "__next__") is not None:
        return _exhaust(frame, value)
    try:
        iterator = iter(value)
    except TypeError:
        raise TypeError(f"'{type(value).__name__}' object is not iterable") from None
    return collect(iterator)


def _exhaust(frame: Frame, iterator: Any) -> list[Any]:
    step = python_dunder(iterator, "__next__")
    if step is None:
        return collect(iterator)
    items = []
    while True:
        try:
            items.append(inline(frame, step, (iterator,), {}))
        except StopIteration:
            return items


def _describe(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}.{name}" if module and module != "builtins" else str(name)


def invoke(frame: Frame, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call from a CALL instruction: ``__exit__`` of a context capture entered natively
    leaves it through the session; everything else goes to :func:`call_function`."""
    ctx = frame.entered.pop(id(fn), None) if isinstance(fn, types.MethodType) else None
    if ctx is not None:
        return frame.session.exit_context(ctx, *args)
    return call_function(frame, fn, args, kwargs)
