"""``kiln.export``'s capture: one whole graph of a call, traced with ``dynamic_shapes``' dims as
symbols of the graph.

Capture is ``kiln.trace`` (proxy tracing: one graph by construction, and each tensor argument
maps to one graph input, which is the input spec). What would be a graph break under
``kiln.compile`` (control flow on tensor values, a call no node can hold) is an
:class:`~kiln.exported.program.ExportError` naming the user's line. A dim named in
``dynamic_shapes`` becomes a symbol (``f32[batch, 8]``); what tracing decided about one
(``batch > 8``) is checked on every call, and a size it had to specialize (``int(batch)``) is
an error here::

    prog = kiln.export(model, (x,), dynamic_shapes={"x": {0: kiln.Dim(2, 64, name="batch")}})
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from kiln.errors import TraceError
from kiln.exported.program import ExportedProgram, ExportError
from kiln.frontends.source import user_location
from kiln.frontends.trace import trace_call
from kiln.ir.graph import Graph, InputKind
from kiln.ir.specialize import used_symbols
from kiln.ir.symbolic import ShapeEnv, Sym, active_env
from kiln.ir.types import TensorType


@dataclass(frozen=True)
class Dim:
    """A dynamic dim for ``dynamic_shapes``: sizes ``min..max`` (``max=None``: unbounded).
    Dims of one ``name`` are one size. Sizes 0 and 1 stay specialized, so ``min`` is at least 2.
    """

    min: int = 2
    max: int | None = None
    name: str | None = None


def export(
    fn_or_module: Callable[..., Any],
    args: Any,
    kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
) -> ExportedProgram:
    """Export ``fn_or_module(*args, **kwargs)`` as one graph (see the module docstring).

    ``dynamic_shapes``: per argument (a tuple in ``args``'s order, or a dict by parameter
    name; nested like the argument), ``{dim: name or Dim(min, max, name=...)}`` or None."""
    args = tuple(args) if isinstance(args, tuple | list) else (args,)
    kwargs = dict(kwargs or {})
    module = fn_or_module if isinstance(fn_or_module, torch.nn.Module) else None
    target = module.forward if module is not None else fn_or_module
    env = ShapeEnv(location=lambda: str(user_location() or ""))
    marks = _marks(target, args, kwargs, dynamic_shapes)

    def type_of(tensor: torch.Tensor) -> TensorType:
        shape = tuple(marks.get(id(tensor), {}).get(d, n) for d, n in enumerate(tensor.shape))
        return TensorType(shape, tensor.dtype, tensor.device)

    try:
        with torch.no_grad(), active_env(env):
            graph = trace_call(fn_or_module, args, kwargs, type_of)
    except TraceError as error:
        message = f"kiln.export needs one whole graph: {error.message}"
        raise ExportError(message, error.location) from error
    if env.specializations:
        what = "; ".join(f"{expr} ({why})" for expr, why in env.specializations)
        raise ExportError(f"kiln.export: dynamic sizes were specialized: {what}")
    graph.symbols = tuple(sorted(used_symbols(graph)))
    weights = _weights(graph, module)
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    firsts = {id(t): t for t in leaves if isinstance(t, torch.Tensor)}
    slots = {key: i for i, key in enumerate(firsts)}
    plan = [slots[id(x)] if isinstance(x, torch.Tensor) else ("constant", x) for x in leaves]
    program = ExportedProgram(graph, weights, in_spec, plan, tuple(env.relations))
    program(*args, **kwargs)  # compiles now, so save() holds the kernels
    return program


def _weights(graph: Graph, module: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """Copies of the tensors the graph holds (parameters, buffers, constants), by input name;
    every input typed as not requiring grad (an exported program is for inference)."""
    graph.constants = {name: t.detach().clone() for name, t in graph.constants.items()}
    weights = dict(graph.constants)
    for value in graph.inputs:
        value.type = value.type.with_(requires_grad=False)
        if module is not None and value.kind is InputKind.PARAMETER:
            weights[value.name] = module.get_parameter(value.source).detach().clone()
        elif module is not None and value.kind is InputKind.BUFFER:
            weights[value.name] = module.get_buffer(value.source).detach().clone()
    return weights


def _marks(
    target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: Any
) -> dict[int, dict[int, Sym]]:
    """id of each tensor argument with dynamic dims -> its dims' symbols."""
    if dynamic is None:
        return {}
    if isinstance(dynamic, dict):
        try:
            bound = inspect.signature(target).bind(*args, **kwargs).arguments
        except TypeError as error:
            raise ExportError(f"dynamic_shapes: {error}") from error
        pairs = [(bound[name], spec, name) for name, spec in dynamic.items() if name in bound]
        unknown = set(dynamic) - set(bound)
        if unknown:
            raise ExportError(f"dynamic_shapes names {sorted(unknown)}, not arguments")
    else:
        if len(dynamic) > len(args):
            raise ExportError(f"dynamic_shapes has {len(dynamic)} entries for {len(args)} args")
        named = [(arg, f"arg{i}") for i, arg in enumerate(args)]
        pairs = [(arg, spec, name) for (arg, name), spec in zip(named, dynamic, strict=False)]
    marks: dict[int, dict[int, Sym]] = {}
    symbols: dict[str, Sym] = {}
    for value, spec, name in pairs:
        _mark(value, spec, name, marks, symbols)
    return marks


def _mark(
    value: Any, spec: Any, name: str, marks: dict[int, dict[int, Sym]], symbols: dict[str, Sym]
) -> None:
    if spec is None:
        return
    if isinstance(value, tuple | list) and isinstance(spec, tuple | list):
        for i, (item, sub) in enumerate(zip(value, spec, strict=True)):
            _mark(item, sub, f"{name}_{i}", marks, symbols)
        return
    if not isinstance(value, torch.Tensor) or not isinstance(spec, dict):
        raise ExportError(f"dynamic_shapes for {name}: expected {{dim: Dim}} for a tensor")
    for dim, choice in spec.items():
        choice = choice if isinstance(choice, Dim) else Dim(name=choice)
        symbol_name = "".join(c if c.isalnum() else "_" for c in choice.name or f"{name}_{dim}")
        size = value.shape[dim]
        low, high = max(choice.min, 2), choice.max
        if size < low or (high is not None and size > high):
            raise ExportError(f"{name}.shape[{dim}] is {size}, outside [{low}, {high}]")
        known = symbols.setdefault(symbol_name, Sym.symbol(symbol_name, size, low, high))
        (symbol,) = known.symbols()
        if (symbol.hint, symbol.low, symbol.high) != (size, low, high):
            raise ExportError(f"dim {symbol_name} is {size} in {name}, {symbol.hint} elsewhere")
        marks.setdefault(id(value), {})[dim % value.dim()] = known
