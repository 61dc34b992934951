"""``nn.Module.__call__`` during capture: forward pre-hooks, ``forward`` inlined, forward hooks.

This follows ``Module._call_impl`` for the hooks model code uses. Global module hooks and
backward hooks need eager autograd machinery around the call, so they stop capture with an
explicit reason. The hook dicts of each called module are guarded (length), so registering a
hook after compilation causes a recompile rather than a stale result.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch.nn.modules import module as module_globals

from kiln.capture.calls import registry
from kiln.capture.calls.attributes import get_attribute
from kiln.capture.calls.distributed import wrapper_name
from kiln.capture.calls.inline import inline
from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.frame import Frame
from kiln.capture.guards.guards import LengthIs
from kiln.capture.guards.sources import Attr

_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_forward_hooks_always_called",
)


def call_module(
    frame: Frame, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    wrapper = wrapper_name(module)
    if wrapper is not None:  # its collectives and state stay eager (calls/distributed.py)
        raise GraphBreak(
            BreakReason.UNSUPPORTED_CALL, f"{wrapper} runs eagerly around its compiled forward"
        )
    call = type(module).__call__
    if call is not torch.nn.Module.__call__ and isinstance(call, types.FunctionType):
        return inline(frame, call, (module, *args), kwargs)
    for name in _GLOBAL_HOOKS:
        if getattr(module_globals, name, None):
            raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"global module hooks ({name})")
    if module._backward_hooks or module._backward_pre_hooks:
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, "module backward hooks")
    _guard_hooks(frame, module)
    for key, hook in list(module._forward_pre_hooks.items()):
        if key in module._forward_pre_hooks_with_kwargs:
            result = registry.call_function(frame, hook, (module, args, kwargs), {})
            if result is not None:
                args, kwargs = result
        else:
            result = registry.call_function(frame, hook, (module, args), {})
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    forward = get_attribute(frame, module, "forward")
    output = registry.call_function(frame, forward, args, kwargs)
    for key, hook in list(module._forward_hooks.items()):
        if key in module._forward_hooks_with_kwargs:
            result = registry.call_function(frame, hook, (module, args, kwargs, output), {})
        else:
            result = registry.call_function(frame, hook, (module, args, output), {})
        if result is not None:
            output = result
    return output


def _guard_hooks(frame: Frame, module: torch.nn.Module) -> None:
    session = frame.session
    source = session.source_of(module)
    if source is None or session.is_new(module):
        return
    for name in ("_forward_pre_hooks", "_forward_hooks"):
        hooks = getattr(module, name)
        session.add_guard(LengthIs(Attr(source, name), "module hooks", len(hooks)))
