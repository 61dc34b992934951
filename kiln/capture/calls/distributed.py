"""Data-parallel wrappers during capture: their machinery runs eagerly, their model compiled.

``DistributedDataParallel``'s forward (moving inputs, the reducer's bookkeeping, broadcasting
buffers) and the hooks ``fully_shard`` (FSDP2) registers (all-gathers, resharding, prefetch,
the hooks of its backward) keep state of their own and launch collectives: capturing them
would trace into that state (the ``FSDPCommContext`` crash of issue 24). So capture stops at a
call to such a module (a graph break), and the head performs it through
:class:`WrapperCall`: the wrapper runs as its original code, and the module doing the math
(``ddp.module``, or the fully sharded module itself) runs its compiled ``forward``, as
Dynamo's skip of DDP lets it compile the inner module's frame::

    kiln.compile(DDP(model))(x)
      capture: ddp(x) -> graph break "DistributedDataParallel runs eagerly"
      head:    WrapperCall(ddp)(x) -> DDP.forward (eager) -> model(x) -> compiled forward
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

# The wrapper classes by module and name, looked up only once their module was imported, so
# that capture imports no part of torch.distributed.
_WRAPPERS = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel"),
    ("torch.distributed.fsdp", "FSDPModule"),
)
_NAMES = {"FSDPModule": "fully_shard"}


def wrapper_name(module: object) -> str | None:
    """The name of the data-parallel wrapper ``module`` is (or was made by), else None."""
    for module_name, class_name in _WRAPPERS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and isinstance(module, cls):
            return _NAMES.get(class_name, class_name)
    return None


def wrapped_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward does the math: DDP's ``module``; FSDP2 keeps the module."""
    inner = module.__dict__.get("_modules", {}).get("module")
    if wrapper_name(module) == "DistributedDataParallel" and isinstance(inner, torch.nn.Module):
        return inner
    return module


class WrapperCall:
    """Calls ``module`` natively, with ``compiled_forward`` standing in for the forward of
    :func:`wrapped_module` for the length of the call (an instance attribute that shadows the
    class's method; what was there before is put back, so the module is left unchanged).

    >>> WrapperCall(ddp, compiled_forward)(x)  # DDP.forward eager, model.forward compiled
    """

    def __init__(self, module: torch.nn.Module, compiled_forward: Callable[..., Any]) -> None:
        self.module = module
        self.compiled_forward = compiled_forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        target = wrapped_module(self.module).__dict__
        missing = object()
        previous = target.get("forward", missing)
        target["forward"] = self.compiled_forward
        try:
            return self.module(*args, **kwargs)
        finally:
            if previous is missing:
                del target["forward"]
            else:
                target["forward"] = previous
