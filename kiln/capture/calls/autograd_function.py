"""``Fn.apply(...)`` of a custom ``torch.autograd.Function`` during capture.

Eager PyTorch runs ``Fn.forward`` without recording gradients and hands the output cotangents
to ``Fn.backward`` later. Capture does the same ahead of time:

1. ``forward`` (or ``forward`` then ``setup_context``) is inlined under ``no_grad`` with a
   :class:`FunctionContext` standing for ``ctx``, so its prims carry no gradient;
2. when a tensor argument requires grad, ``backward`` is inlined too, into a graph of its own
   whose inputs are one cotangent per output; the values of the main graph it reads
   (``ctx.saved_tensors``, tensors kept on ``ctx``, parameters) become its saved inputs;
3. the outputs go through a marker node whose VJP is that backward graph
   (``kiln/ops/autograd_function.py``).

Anything the backward does that a graph cannot replay when autograd calls it (I/O, writes to
objects that outlive the call, data-dependent code, random numbers) breaks the graph at the
``apply`` call instead, which then runs in eager autograd: the Function is never given a
gradient other than its own.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch.autograd.function import _SingleLevelFunction
from torch.utils import _pytree as pytree

from kiln.capture.calls import registry
from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.frame import Frame
from kiln.frontends.proxy import ProxyTensor
from kiln.frontends.source import user_location
from kiln.ir.builder import GraphBuilder, require_builder
from kiln.ir.graph import Graph, InputKind, Origin, Value
from kiln.ir.op import Tag, op_def
from kiln.ops.autograd_function import CustomBackward, emit_function_outputs

_APPLY = vars(torch.autograd.Function)["apply"].__func__  # the classmethod's function


def is_function_apply(fn: Any) -> bool:
    """Whether ``fn`` is ``SomeFunction.apply`` of a custom ``torch.autograd.Function``."""
    return (
        isinstance(fn, types.MethodType)
        and fn.__func__ is _APPLY
        and isinstance(fn.__self__, type)
        and fn.__self__ is not torch.autograd.Function
    )


class FunctionContext:
    """``ctx`` of a Function while capture traces it: what ``forward`` saves and marks."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.to_save: tuple[Any, ...] = ()
        self.non_differentiable: list[Any] = []
        self.dirty: list[Any] = []
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Any) -> None:
        self.to_save = tensors

    def save_for_forward(self, *tensors: Any) -> None:
        pass  # forward-mode AD is not captured

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        return tuple(self.to_save)

    saved_variables = saved_tensors

    def mark_non_differentiable(self, *tensors: Any) -> None:
        self.non_differentiable.extend(tensors)

    def mark_dirty(self, *tensors: Any) -> None:
        self.dirty.extend(tensors)

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def apply_function(
    frame: Frame, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``function.apply(*args)`` captured (see the module docstring)."""
    name = function.__qualname__
    if kwargs:
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"{name}.apply with keyword arguments")
    recording = torch.is_grad_enabled()
    needs = tuple(recording and isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    ctx = frame.session.new(FunctionContext(needs))
    with torch.no_grad():
        if function.setup_context is not _SingleLevelFunction.setup_context:
            output = registry.call_function(frame, function.forward, args, {})
            registry.call_function(frame, function.setup_context, (ctx, args, output), {})
        else:
            output = registry.call_function(frame, function.forward, (ctx, *args), {})
    if not any(needs):
        return output
    leaves, structure = pytree.tree_flatten(output)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, ProxyTensor)]
    if not positions:
        return output
    outputs = [leaves[i] for i in positions]
    tensors = [i for i, a in enumerate(args) if isinstance(a, ProxyTensor)]
    backward, saved = _trace_backward(frame, function, ctx, outputs, args, tensors)
    frame.restore_location()  # the apply call's line (inlining moved it)
    location = user_location()
    origin = Origin(f"{name}.apply", location.file, location.line) if location else Origin("")
    with require_builder().origin_scope(origin):
        marked = emit_function_outputs(
            [o.current() for o in outputs], [args[i].current() for i in tensors], saved, backward
        )
    frozen = {id(t) for t in ctx.non_differentiable}
    for value, original in zip(marked, outputs, strict=True):
        if id(original) in frozen:
            value.type = value.type.with_(requires_grad=False)
    for position, value in zip(positions, marked, strict=True):
        leaves[position] = ProxyTensor(value)
    return pytree.tree_unflatten(leaves, structure)


def _trace_backward(
    frame: Frame,
    function: Any,
    ctx: FunctionContext,
    outputs: list[ProxyTensor],
    args: tuple[Any, ...],
    tensors: list[int],
) -> tuple[CustomBackward, list[Value]]:
    """``function.backward`` as a graph, and the main graph's values it reads (its saved
    inputs); a GraphBreak when it cannot be replayed as a graph."""
    name = function.__qualname__
    session = frame.session
    graph = Graph(name=f"{function.__name__}_backward")
    cotangents = [
        graph.add_input(o.current().type.with_(requires_grad=False), name=f"grad_{i}")
        for i, o in enumerate(outputs)
    ]
    backward = function.backward
    if getattr(backward, "__module__", "") == "torch.autograd.function":
        backward = getattr(backward, "__wrapped__", backward)  # once_differentiable
    effects = (len(session.effects), len(session.journal))
    try:
        with GraphBuilder(graph), torch.no_grad():
            grads = [ProxyTensor(c) for c in cotangents]
            result = registry.call_function(frame, backward, (ctx, *grads), {})
            results = _gradients(name, result, args, tensors, graph)
    except GraphBreak as error:
        raise GraphBreak(error.reason, f"backward of {name}: {error.detail}") from error
    except Exception as error:
        detail = f"backward of {name} cannot be traced: {type(error).__name__}: {error}"
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, detail) from error
    if (len(session.effects), len(session.journal)) != effects:
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"backward of {name} has side effects")
    if any(Tag.RANDOM in op_def(node.op).tags for node in graph.nodes):
        raise GraphBreak(BreakReason.UNSUPPORTED_CALL, f"backward of {name} draws random numbers")
    graph.outputs = [value for _, value in results]
    saved = _saved_inputs(graph, cotangents)
    custom = CustomBackward(
        function=name,
        graph=graph,
        saved_count=len(saved),
        gradients=tuple(argument for argument, _ in results),
        materialize=ctx.materialize_grads,
    )
    return custom, saved


def _gradients(
    name: str, result: Any, args: tuple[Any, ...], tensors: list[int], graph: Graph
) -> list[tuple[int, Value]]:
    """(index among the tensor arguments, gradient value) for each gradient ``backward``
    returned, checked as eager autograd checks it (a mismatch makes eager raise, later)."""
    results = result if isinstance(result, tuple) else (result,)
    if len(results) < len(args) or any(r is not None for r in results[len(args) :]):
        raise TypeError(f"{name}.backward returned {len(results)} gradients for {len(args)}")
    gradients = []
    for index, position in enumerate(tensors):
        grad = results[position]
        if grad is None:
            continue
        if isinstance(grad, torch.Tensor) and not isinstance(grad, ProxyTensor):
            grad = ProxyTensor(graph.add_constant(grad.detach()))  # made from Python data
        if not isinstance(grad, ProxyTensor):
            raise TypeError(f"{name}.backward returned {type(grad).__name__} for a tensor")
        shape = tuple(args[position].shape)
        if not _expandable(shape, tuple(grad.shape)):
            raise ValueError(f"{name}.backward: gradient of shape {tuple(grad.shape)} for {shape}")
        gradients.append((index, grad.current()))
    for position, grad in enumerate(results[: len(args)]):
        if grad is not None and position not in tensors:
            raise TypeError(f"{name}.backward returned a gradient for a non-tensor argument")
    return gradients


def _expandable(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (autograd sums such a gradient down)."""
    if len(shape) > len(target):
        return False
    return all(s == t or s == 1 for s, t in zip(reversed(shape), reversed(target), strict=False))


def _saved_inputs(graph: Graph, cotangents: list[Value]) -> list[Value]:
    """Turn every main-graph value the backward graph reads into an input of it (before the
    cotangents); those main-graph values, in order."""
    defined = set(graph.inputs) | {out for node in graph.nodes for out in node.outputs}
    external: dict[Value, Value] = {}

    def local(value: Any) -> Any:
        if not isinstance(value, Value) or value in defined:
            return value
        if value not in external:
            external[value] = Value(
                graph.fresh_name("saved"),
                value.type.with_(requires_grad=False),
                kind=InputKind.USER,
                source="saved",
            )
        return external[value]

    for node in graph.nodes:
        node.inputs = tuple(local(operand) for operand in node.inputs)
    graph.outputs = [local(value) for value in graph.outputs]
    constants = [value for value in graph.inputs if value.kind is InputKind.CONSTANT]
    graph.inputs = [*external.values(), *cotangents, *constants]
    return list(external)
