"""Routing: the callable a compiled frame calls in place of each callee, so that nested Python
frames run through compiled wrappers of their own (in a head's native step at a graph break,
and in a frame that runs uncompiled with its calls routed).
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as module_globals

from kiln.capture.calls.distributed import WrapperCall, wrapped_module, wrapper_name
from kiln.capture.calls.native import runs_natively
from kiln.capture.guards.probing import probe


def run_cond(route: Any, pred: Any, true_fn: Any, false_fn: Any, operands: Any = ()) -> Any:
    """``torch.cond`` performed by a head at a break: the selected branch, compiled."""
    branch = true_fn if bool(pred) else false_fn
    return route(branch)(*operands)


class Router:
    """The callable a compiled frame calls in place of each callee: Python functions, methods
    and plain modules go through their compiled wrappers made with the capture's own options
    (backend, fullgraph, limits), so nested frames are compiled as the caller asked."""

    def __init__(self, compiled_function: Callable[[types.FunctionType], Any]) -> None:
        self.compiled_function = compiled_function

    def __call__(self, callee: Any) -> Any:
        compiled = self.compiled_function
        if callee is torch.cond:  # a tensor predicate: the chosen branch runs compiled
            return functools.partial(run_cond, self)
        if isinstance(callee, Router) or probe(callee, "_kiln_cache") is not None:
            return callee  # compiled already (code routed twice routes its own wrappers)
        if isinstance(callee, types.FunctionType) and not _runs_natively(callee):
            return compiled(callee)
        method = getattr(callee, "__func__", None) if isinstance(callee, types.MethodType) else None
        if isinstance(method, types.FunctionType) and not _runs_natively(method):
            return types.MethodType(compiled(method), callee.__self__)
        if isinstance(callee, torch.nn.Module) and wrapper_name(callee) is not None:
            inner = wrapped_module(callee)
            forward = getattr(type(inner), "forward", None)
            if isinstance(forward, types.FunctionType) and not _runs_natively(forward):
                return WrapperCall(callee, types.MethodType(compiled(forward), inner))
            return callee
        if isinstance(callee, torch.nn.Module) and _plain_call(callee):
            forward = getattr(callee.forward, "__func__", None)
            if isinstance(forward, types.FunctionType) and not _runs_natively(forward):
                return types.MethodType(compiled(forward), callee)
        return callee


def _runs_natively(fn: types.FunctionType) -> bool:
    """Torch internals, the standard library and Kiln are not worth compiling as separate
    frames; the models ``kiln.bench`` runs (their wrappers) are user code."""
    name = fn.__module__ or ""
    kiln = name.split(".")[0] == "kiln" and not name.startswith("kiln.bench.")
    return runs_natively(fn) or name.split(".")[0] in sys.stdlib_module_names or kiln


def _plain_call(module: torch.nn.Module) -> bool:
    if type(module).__call__ is not torch.nn.Module.__call__:
        return False
    hooks = (
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        module._backward_pre_hooks,
        module_globals._global_forward_hooks,
        module_globals._global_forward_pre_hooks,
        module_globals._global_backward_hooks,
        module_globals._global_backward_pre_hooks,
    )
    return not any(hooks)
