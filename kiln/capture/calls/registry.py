"""What a call resolves to, registered by the modules that implement it.

``MODELS`` maps callables capture models rather than runs natively (``map``, ``getattr``,
``torch.utils.checkpoint``...) to their models; ``kiln.capture.calls.builtins`` and
``higher_order`` fill it at import time with :func:`model`.

``call_function`` is the calls layer's entry point, ``dispatch.call_function``, installed
here by ``dispatch`` when it is imported (``kiln.capture.calls`` imports it with the package).
The modules ``dispatch`` itself dispatches to -- module calls, ``Function.apply``, attribute
reads that inline a property -- call back into it through this hook (read as
``registry.call_function`` at each call) instead of importing the module that imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.capture.core.frame import Frame

Model = Callable[..., Any]
MODELS: dict[Any, Model] = {}


def model(*fns: Any) -> Callable[[Model], Model]:
    def register(implementation: Model) -> Model:
        for fn in fns:
            MODELS[fn] = implementation
        return implementation

    return register


CallFunction = Callable[[Frame, Any, tuple[Any, ...], dict[str, Any]], Any]


def _not_installed(frame: Frame, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    raise RuntimeError("kiln.capture.calls.dispatch is not imported: no call_function installed")


call_function: CallFunction = _not_installed
