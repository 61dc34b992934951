"""User lowerings: a ``torch.library`` custom op (or any torch function) expressed in prims.

Without a lowering a custom op is an ``extern`` node, compiled around: the kernels before and
after it cannot fuse through it. ``kiln.register_lowering(op, fn)`` gives it a translation:
``fn`` takes the op's arguments (proxies, during tracing) and calls torch functions on them,
which translate to prims, so the op's work joins its neighbours' kernels and is differentiated
by Kiln's autodiff of those prims::

    @torch.library.custom_op("mylib::scaled_sin", mutates_args=())
    def scaled_sin(x: torch.Tensor, k: float) -> torch.Tensor: ...

    kiln.register_lowering(scaled_sin, lambda x, k: torch.sin(x) * k)

    before:  t1 = extern(t0, fn=mylib.scaled_sin.default, ...)   (a kernel, an extern, a kernel)
    after:   t1 = sin(t0); t2 = mul(t1, 2.0)                      (one fused kernel)

An op that mutates arguments (``mutates_args``) keeps eager's semantics: ``fn`` writes them in
place (``x.add_(y)``, ``x.copy_(...)``); the frontend rebinds the caller's tensors to the new
values (a graph input's new value is written back, as for BatchNorm's running statistics). A
lowering that leaves a mutated argument unwritten raises :class:`~kiln.errors.OpError`.

Lowerings apply to graphs traced after registration (``kiln.reset()`` drops compiled code).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from kiln.errors import OpError
from kiln.frontends.proxy import ProxyTensor
from kiln.frontends.source import user_location
from kiln.ir.graph import Value
from kiln.ops.translations import api_name, assign_input, override


def register_lowering(op: Any, fn: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """Lower ``op`` (a ``torch.library.custom_op``, an ``OpOverloadPacket`` or ``OpOverload``,
    or a torch function) to what ``fn`` computes from its arguments; ``fn=None`` removes the
    lowering. Returns ``fn``.

    >>> kiln.register_lowering(torch.ops.mylib.scaled_sin, lambda x, k: torch.sin(x) * k)
    """
    for key in _keys(op):
        override(key, None if fn is None else _translation(key, fn))
    return fn


def _keys(op: Any) -> list[Any]:
    """The callables a call of ``op`` reaches ``__torch_function__`` as."""
    op = getattr(op, "_opoverload", op)  # a CustomOpDef calls its OpOverload
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [op, *(getattr(op, name) for name in op.overloads())]
    return [op]


def _written(op: Any) -> list[tuple[int, str]]:
    """(position, name) of each argument the op's schema says it mutates."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return []
    return [
        (index, argument.name)
        for index, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    ]


def _translation(op: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A translation (Values in, Values out) running ``fn`` on proxies of its operands."""
    written = _written(op)

    def lowered(*args: Any, **kwargs: Any) -> Any:
        proxies: dict[Value, ProxyTensor] = {}

        def wrap(item: Any) -> Any:
            if not isinstance(item, Value):
                return item
            return proxies.setdefault(item, ProxyTensor(item))

        wrapped_args, wrapped_kwargs = pytree.tree_map(wrap, (args, kwargs))
        result = fn(*wrapped_args, **wrapped_kwargs)
        for index, name in written:
            operand = args[index] if index < len(args) else kwargs.get(name)
            if not isinstance(operand, Value):
                continue
            new = proxies[operand].current()
            if new is operand:
                raise OpError(
                    f"the lowering of {api_name(op)} does not write its mutated argument "
                    f"'{name}' in place (call an in-place op such as {name}.copy_(...))",
                    user_location(),
                )
            assign_input(operand, new)
        return pytree.tree_map(
            lambda item: item.current() if isinstance(item, ProxyTensor) else item, result
        )

    lowered.__name__ = f"lowering_of_{getattr(fn, '__name__', 'fn')}"
    return lowered
