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

import functools
import logging
import types
import weakref
from typing import Any

import torch

from kiln.capture.calls import registry
from kiln.capture.calls.autograd_function import apply_function, is_function_apply
from kiln.capture.calls.inline import construct, inline
from kiln.capture.calls.modules import call_module
from kiln.capture.calls.native import (
    FUNCTORCH,
    IMMUTABLE,
    MUTATING,
    call_builtin,
    describe,
    holds_tensors,
    native,
    python_dunder,
    reason_for,
    runs_natively,
)
from kiln.capture.calls.registry import MODELS
from kiln.capture.calls.routing import Router
from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.frame import NULL, Frame
from kiln.capture.guards.guards import Equals
from kiln.capture.guards.probing import probe
from kiln.capture.guards.sources import Attr, Called, Item


def call_function(frame: Frame, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call ``fn(*args, **kwargs)`` symbolically from ``frame``."""
    if fn is NULL:
        raise TypeError("'NoneType' object is not callable")
    model = MODELS.get(_key(fn))
    if model is not None:
        return model(frame, *args, **kwargs)
    if is_function_apply(fn):
        return apply_function(frame, fn.__self__, args, kwargs)
    if _stateful(fn):
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"{describe(fn)} changes random state")
    if isinstance(fn, weakref.ReferenceType) and not args and not kwargs:
        return _dereference(frame, fn)
    if isinstance(fn, _LRU_CACHED):
        return _cached_call(frame, fn, args, kwargs)
    if id(fn) in frame.session.opaque_callables:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"{name} transformed by torch.func")
    if isinstance(fn, types.MethodType):
        if isinstance(fn.__self__, logging.Logger) and _log_disabled(frame, fn, args):
            return None  # (as eager: a logger's call below its level does nothing)
        return call_function(frame, fn.__func__, (fn.__self__, *args), kwargs)
    if isinstance(fn, torch.jit.ScriptFunction):
        # TorchScript runs its own interpreter, which proxies cannot pass through; the Python
        # function it was made from (torch.jit.script keeps it) computes the same.
        original = getattr(fn, "_torchdynamo_inline", None)
        if not isinstance(original, types.FunctionType):
            raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"TorchScript function {fn.name}")
        return call_function(frame, original, args, kwargs)
    if isinstance(fn, types.FunctionType):
        if fn.__code__.co_filename.startswith(FUNCTORCH):  # (vjp's pullback, vmap's wrapper)
            raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"torch.func's {fn.__qualname__}")
        if runs_natively(fn):
            return native(frame, fn, args, kwargs)
        return inline(frame, fn, args, kwargs)
    if isinstance(fn, torch.jit.ScriptModule):  # (keeps no Python forward to follow)
        name = getattr(fn, "original_name", type(fn).__name__)
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"TorchScript module {name}")
    if isinstance(fn, torch.nn.Module):
        return call_module(frame, fn, args, kwargs)
    if isinstance(fn, type):
        return construct(frame, fn, args, kwargs)
    if isinstance(fn, functools.partial):
        return call_function(frame, fn.func, (*fn.args, *args), {**fn.keywords, **kwargs})
    if isinstance(fn, types.BuiltinFunctionType | types.BuiltinMethodType):
        return call_builtin(frame, fn, args, kwargs)
    if isinstance(fn, types.MethodDescriptorType | types.WrapperDescriptorType):
        owner = getattr(fn, "__objclass__", object)
        if args and isinstance(args[0], list | dict | set) and fn.__name__ in MUTATING:
            frame.session.touch_container(args[0])
        if issubclass(owner, torch._C.TensorBase) or owner in (*IMMUTABLE, list, dict, set):
            return native(frame, fn, args, kwargs)
    if isinstance(fn, types.MethodWrapperType):
        if fn.__name__ == "__call__":  # ``f.__call__(x)``: calling ``f`` itself
            return call_function(frame, fn.__self__, args, kwargs)
        return call_builtin(frame, fn, args, kwargs)
    call = python_dunder(fn, "__call__")
    if call is not None:
        return inline(frame, call, (fn, *args), kwargs)
    if isinstance(fn, Router):  # code Kiln routed (``route(f)(x)``): capture follows f itself
        return args[0]
    if getattr(type(fn), "__module__", "").startswith("torch"):
        return native(frame, fn, args, kwargs)
    raise GraphBreak(reason_for(fn), f"call to {describe(fn)}")


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


_LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LOG_LEVELS.update(warn=logging.WARNING, error=logging.ERROR, exception=logging.ERROR)
_LOG_LEVELS.update(critical=logging.CRITICAL, fatal=logging.CRITICAL)


def _log_disabled(frame: Frame, method: types.MethodType, args: tuple[Any, ...]) -> bool:
    """Whether ``logger.debug(...)`` (or another level's call) is below the logger's level, so
    that eager does nothing: no graph break then. Guarded on the logger's own cache of that
    answer, which ``logging`` empties whenever a level changes anywhere (the guard then fails,
    and a new capture asks again)."""
    logger: Any = method.__self__  # (a logging.Logger: its private answer cache is read)
    name = method.__func__.__name__
    level = _LOG_LEVELS.get(name)
    if name == "log" and args and type(args[0]) is int:
        level = args[0]
    if level is None or method.__func__ is not getattr(logging.Logger, name, None):
        return False  # (a subclass's own method may do something even then)
    source = frame.session.source_of(logger)
    if source is None or logger.disabled or logger.isEnabledFor(level):
        return False
    if logger._cache.get(level) is not False:  # (a logging without the cache: break as before)
        return False
    reason = f"{name} below the logger's level"
    frame.session.add_guard(Equals(Attr(source, "disabled"), reason, False))
    frame.session.add_guard(Equals(Item(Attr(source, "_cache"), level), reason, False))
    return True


def _stateful(fn: Any) -> bool:
    """Random state the graph cannot hold: global seeds, and ``torch.Generator`` objects
    (constructed, seeded, read) whose state PyTorch alone advances."""
    if _key(fn) in _RANDOM_STATE or _key(probe(fn, "__wrapped__")) in _RANDOM_STATE:
        return True  # (importing torch._dynamo wraps torch.manual_seed)
    if isinstance(fn, type):
        return issubclass(fn, torch.Generator)
    return isinstance(probe(fn, "__self__"), torch.Generator)


def _key(fn: Any) -> Any:
    try:
        hash(fn)
    except TypeError:
        return None
    return fn


_LRU_CACHED = type(functools.lru_cache(lambda: None))


def _cached_call(frame: Frame, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A ``functools.lru_cache`` function (transformers' ``is_torch_distributed_available``,
    ``logger.warning_once``): without tensor arguments it runs natively, answering from its
    cache as eager's call would (a first call's side effect happens now, during the first
    call); with tensors the function itself is followed."""
    if not any(holds_tensors(value) for value in (*args, *kwargs.values())):
        return native(frame, fn, args, kwargs)
    return call_function(frame, fn.__wrapped__, args, kwargs)


def _dereference(frame: Frame, ref: weakref.ReferenceType[Any]) -> Any:
    """``ref()``: the target, read through the reference's source (guarded, a graph input for
    a tensor), so code comparing it with the object it expects (``ref() is weight`` in
    ``nn.RNNBase``) sees the same traced value."""
    session = frame.session
    target = ref()
    source = session.source_of(ref)
    if target is None or source is None or session.is_new(ref):
        return session.traced_version(target)
    return session.wrap(target, Called(source))


def invoke(frame: Frame, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call from a CALL instruction: ``__exit__`` of a context capture entered natively
    leaves it through the session; everything else goes to :func:`call_function`."""
    ctx = frame.entered.pop(id(fn), None) if isinstance(fn, types.MethodType) else None
    if ctx is not None:
        return frame.session.exit_context(ctx, *args)
    return call_function(frame, fn, args, kwargs)


# Modules below this one (module calls, Function.apply, attribute reads) call back through it.
registry.call_function = call_function
