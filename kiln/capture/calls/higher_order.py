"""Torch functions that take the user's functions: checkpointing, ``torch.cond``, and the
``torch.func`` transforms, during capture.

* ``torch.utils.checkpoint.checkpoint(fn, *args)`` computes what ``fn(*args)`` computes; only
  what autograd keeps differs. Capture inlines ``fn`` (so its parameters are guarded graph
  inputs and get gradients) and marks its nodes for recomputation: the partitioner never saves
  them (``Node.recompute``). The reentrant variant with no input requiring grad runs ``fn``
  without gradients, as eager's does. ``checkpoint_sequential`` is the same per segment.
* ``torch.cond(pred, true_fn, false_fn, operands)``: a Python predicate inlines its branch;
  a tensor predicate breaks the graph, and the head calls the branch it selects through its
  compiled wrapper (``Router``).
* ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``, ...) run eagerly: the transformed
  function is re-created from its recipe after the graph, and calling it breaks the graph.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.func
import torch.utils.checkpoint as checkpointing

from kiln.capture.calls.dispatch import call_function
from kiln.capture.calls.iterate import iterate
from kiln.capture.calls.registry import model
from kiln.capture.core.breaks import BreakReason, GraphBreak
from kiln.capture.core.frame import Frame
from kiln.capture.core.iteration import items_of
from kiln.capture.core.session import Recipe
from kiln.frontends.proxy import ProxyTensor
from kiln.ir.builder import require_builder

# torch.func transforms returning a transformed function, and those computing directly.
TRANSFORMS = tuple(
    getattr(torch.func, name)
    for name in ("vmap", "grad", "grad_and_value", "jacrev", "jacfwd", "hessian", "functionalize")
)
DIRECT_TRANSFORMS = tuple(getattr(torch.func, name) for name in ("vjp", "jvp", "linearize"))


def _requires_grad(values: Any) -> bool:
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def _region(frame: Frame, frozen: bool) -> contextlib.ExitStack:
    """A checkpointed region: recompute hints on, gradients off when ``frozen``."""
    stack = contextlib.ExitStack()
    stack.enter_context(require_builder().recompute_scope())
    if frozen:
        stack.enter_context(torch.no_grad())
    return stack


@model(checkpointing.checkpoint)
def _checkpoint(
    frame: Frame,
    function: Any,
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Any = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    kwargs.pop("preserve_rng_state", None)  # recomputation replays the graph's own stream
    reentrant = True if use_reentrant is None else use_reentrant  # eager's default
    if reentrant and kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
    frozen = reentrant and torch.is_grad_enabled() and not _requires_grad(args)
    with _region(frame, frozen):
        return call_function(frame, function, args, kwargs)


@model(checkpointing.checkpoint_sequential)
def _checkpoint_sequential(
    frame: Frame,
    functions: Any,
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    reentrant = True if use_reentrant is None else use_reentrant
    kwargs.pop("preserve_rng_state", None)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
    steps = items_of(frame.session, functions)
    if steps is None:
        steps = iterate(frame, functions)
    size = len(steps) // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        frozen = reentrant and torch.is_grad_enabled() and not _requires_grad([input])
        with _region(frame, frozen):
            for step in steps[start : end + 1]:
                input = call_function(frame, step, (input,), {})
    for step in steps[end + 1 :]:
        input = call_function(frame, step, (input,), {})
    return input


@model(torch.cond)
def _cond(frame: Frame, pred: Any, true_fn: Any, false_fn: Any, operands: Any = ()) -> Any:
    if isinstance(pred, ProxyTensor):
        raise GraphBreak(
            BreakReason.DATA_DEPENDENT, "torch.cond on a tensor: the chosen branch runs compiled"
        )
    branch = true_fn if pred else false_fn
    return call_function(frame, branch, tuple(operands), {})


def _transform(transform: Any) -> Any:
    def build(frame: Frame, *args: Any, **kwargs: Any) -> Any:
        result = transform(*args, **kwargs)  # wraps the function; no tensor work yet
        frame.session.opaque_callables.add(id(result))
        return frame.session.new(result, Recipe(transform, args, kwargs))

    return build


def _direct(transform: Any) -> Any:
    def call(frame: Frame, *args: Any, **kwargs: Any) -> Any:
        raise GraphBreak(
            BreakReason.UNSUPPORTED_CALL, f"torch.func.{transform.__name__} runs eagerly"
        )

    return call


for _transform_fn in TRANSFORMS:
    model(_transform_fn)(_transform(_transform_fn))
for _direct_fn in DIRECT_TRANSFORMS:
    model(_direct_fn)(_direct(_direct_fn))
