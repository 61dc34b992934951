"""Context managers capture enters natively: they only switch torch's global state (grad mode,
autocast, backend flags), so the builder sees that state while it records the block; the
session leaves them again if capture stops inside it, and heads re-enter them around a break.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class BackendFlags:
    """``torch.backends.cudnn.flags(...)`` as capture sees it: the same switch of backend
    flags, but a context manager that can be entered again (the generator-based original
    cannot), so a head and a resume function can re-enter it around a graph break."""

    def __init__(self, flags: Any, *args: Any, **kwargs: Any) -> None:
        self.flags, self.args, self.kwargs = flags, args, kwargs
        self._active: list[Any] = []

    def __enter__(self) -> Any:
        self._active.append(self.flags(*self.args, **self.kwargs))
        return self._active[-1].__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._active.pop().__exit__(*exc)


# Context managers capture enters natively: they only switch torch's global state.
KNOWN_CONTEXTS: tuple[type, ...] = (
    BackendFlags,
    torch.no_grad,
    torch.enable_grad,
    torch.set_grad_enabled,
    torch.inference_mode,
    torch.autocast,
    contextlib.nullcontext,
)


def is_known_context(ctx: Any) -> bool:
    return isinstance(ctx, KNOWN_CONTEXTS)
