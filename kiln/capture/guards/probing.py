"""Kiln's own questions about user objects (``fn.__self__``, ``fn.__wrapped__``,
``fn.__qualname__``), asked without running the object's ``__getattr__``.

``getattr(obj, "__self__", None)`` falls back to a class's ``__getattr__`` for a name the object
lacks. User code may raise anything there (``self.__dict__["store"][name]`` raises KeyError, not
AttributeError) or have effects, and eager Python never asked: a capture that asks turns a
plain program into an internal error. :func:`probe` asks only when the attribute is really there.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch

_MISSING = object()
# Objects whose attribute lookup runs no user code: asked directly (the common, fast case).
_BUILTIN_KINDS = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.MethodWrapperType,
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.ModuleType,
)
# Fallbacks known to raise AttributeError for a missing name (nn.Module's: parameters,
# buffers, submodules), so a class that has no other is asked directly too.
_TRUSTED_FALLBACKS = (None, torch.nn.Module.__getattr__)
_DIRECT: dict[type, bool] = {}


def probe(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr(obj, name, default)``, but a class's own ``__getattr__`` is never run: a
    name found nowhere statically (instance, class, metaclass) gives ``default``, as does any
    error the lookup raises."""
    cls = type(obj)
    direct = _DIRECT.get(cls)
    if direct is None:
        direct = _DIRECT[cls] = isinstance(obj, _BUILTIN_KINDS) or (
            cls.__getattribute__ is object.__getattribute__
            and getattr(cls, "__getattr__", None) in _TRUSTED_FALLBACKS
        )
    try:
        if direct:
            return getattr(obj, name, default)
        if inspect.getattr_static(obj, name, _MISSING) is _MISSING:
            return default
        return getattr(obj, name)
    except Exception:  # (a property or descriptor that raises: absent, as far as Kiln asks)
        return default
