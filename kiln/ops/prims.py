"""One Python function per primitive, usable in two modes.

Called on :class:`~kiln.ir.Value` operands inside an active ``GraphBuilder``, a prim appends a
node and returns its output value(s); called on tensors, it runs the reference implementation.
Translations are written against these functions, and printed graphs import them
(``from kiln.ops.prims import *``), which is what makes a printed graph runnable.

``add(x, y)``, ``sum(x, dims=(1,))``, ``convert(x, dtype=torch.float16)``: operands are
positional, attributes are keywords naming the op's attribute dataclass fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.ir.builder import active_builder
from kiln.ir.graph import Value
from kiln.ir.op import Op, OpDef, Tag, op_def


def call(op: Op, *operands: Any, **attributes: Any) -> Any:
    """Apply ``op``: emit a node when any operand is a Value (or when a creation op without
    tensor operands runs inside a builder), else run the reference impl."""
    definition = op_def(op)
    if definition.attrs is None:
        if attributes:
            raise TypeError(f"{op.printed_name} takes no attributes, got {sorted(attributes)}")
        attrs = None
    else:
        attrs = definition.attrs(**attributes)
    builder = active_builder()
    traced = any(isinstance(operand, Value) for operand in operands)
    if builder is not None and (traced or _creates_from_nothing(definition, operands)):
        return builder.emit(op, operands, attrs)
    if traced:
        raise RuntimeError(f"{op.printed_name} on graph values outside a GraphBuilder")
    result = definition.impl(attrs, *operands)
    # A one-output node prints as ``t = op(...)``: an impl's 1-tuple is that one value.
    return result[0] if isinstance(result, tuple) and len(result) == 1 else result


def _creates_from_nothing(definition: OpDef, operands: tuple[Any, ...]) -> bool:
    """A creation op without tensor operands (``full``, ``iota``): no Value marks it as traced,
    yet inside a builder it belongs to the graph rather than to the tracing Python."""
    return Tag.CREATION in definition.tags and not any(
        isinstance(operand, torch.Tensor) for operand in operands
    )


def _prim(op: Op) -> Callable[..., Any]:
    def prim(*operands: Any, **attributes: Any) -> Any:
        return call(op, *operands, **attributes)

    prim.__name__ = prim.__qualname__ = op.printed_name
    prim.__doc__ = f"The {op.name} primitive (see kiln.ops for its registry row)."
    return prim


__all__ = ["Slot", "call"]
for _op in Op:
    globals()[_op.printed_name] = _prim(_op)
    __all__.append(_op.printed_name)


def __getattr__(name: str) -> Callable[..., Any]:  # for type checkers: prims are generated
    raise AttributeError(name)


from kiln.ops.attrs import Slot  # noqa: E402  (printed extern nodes refer to Slot)
