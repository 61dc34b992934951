"""Running a compiled forward/backward pair inside eager autograd.

:class:`TrainingGraph` differentiates a graph ahead of time (``reverse``), splits the joint
graph (``partition``), compiles both halves with the backend, and runs them in one
``torch.autograd.Function``: the forward saves what the partitioner chose, the backward maps
the outputs' cotangents to the gradients of the inputs that require grad. Gradients therefore
reach leaf parameters and inputs, accumulate over several backward calls, respect
``retain_graph``, and compose with eager code before and after the compiled region.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.autodiff.partition import Partition
from kiln.ir.graph import Graph, InputKind
from kiln.ir.interpreter import interpret
from kiln.ir.op import Tag, op_def
from kiln.ir.types import dense

CompiledGraph = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
ZERO_COTANGENT_LIMIT = 1 << 20  # elements of an unused output's zero cotangent kept


def needs_autodiff(graph: Graph) -> bool:
    """Whether running ``graph`` must record gradients (some output requires grad)."""
    return any(output.type.requires_grad for output in graph.outputs)


class TrainingGraph:
    """A graph compiled as a forward/backward pair; called like a compiled graph."""

    def __init__(
        self, graph: Graph, plan: Partition, forward: CompiledGraph, backward: CompiledGraph
    ) -> None:
        self.plan = plan
        self.name = graph.name
        self.forward = forward
        self.backward = backward
        self.output_count = len(graph.outputs)
        self.differentiable = plan.differentiable
        self.input_count = len(graph.inputs)
        # For a double backward: inputs the forward can be recomputed from under eager
        # autograd. Activations are held weakly (parameters and buffers live in modules).
        self.activations = [i for i, v in enumerate(graph.inputs) if v.kind is InputKind.USER]
        self.random = any(Tag.RANDOM in op_def(n.op).tags for n in self.plan.forward.nodes)
        self.zeros: dict[int, torch.Tensor] = {}  # kept zero cotangents, by position
        self.kept_layouts: dict[int, _Layout] = {}  # the layouts of the outputs they were for
        self.unchecked: set[int] = set()  # kept ones no backward result was checked against
        self.passed_on: set[int] = set()  # positions whose cotangent is a result: never kept

    @property
    def saved_names(self) -> list[str]:
        """What the forward keeps for the backward (explain() reports it)."""
        inputs = [self.plan.forward.inputs[i].name for i in self.plan.saved_inputs]
        start = self.output_count
        values = [v.name for v in self.plan.forward.outputs[start:]]
        return inputs + values

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if torch._C._are_functorch_transforms_active():
            return list(_Function.apply(self, *inputs))  # (it raises as PyTorch does)
        # What Function.apply does outside functorch's transforms, less its Python pass over
        # every argument (a model's 200 parameters: ~30 us a call on a CPU) to unwrap tensors a
        # finished transform leaked: only activations can be such tensors.
        args = list(inputs)
        for position in self.activations:
            args[position] = _unwrap_if_dead(args[position])
        return list(_apply(self, *args))

    def zero_cotangent(self, position: int, layout: _Layout) -> torch.Tensor:
        """The cotangent of a differentiable output nothing used: zeros, as autograd would
        make them, marked ``_kiln_zero`` (a CUDA-graph replay whose buffer holds zeros
        already copies nothing). Kept for the next step up to ``ZERO_COTANGENT_LIMIT``."""
        kept = self.zeros.get(position)
        if kept is not None and self.kept_layouts[position] == layout:
            return kept
        size, stride, dtype, device = layout
        if not dense(torch.empty_strided(size, stride, device="meta")):  # (as zeros_like)
            stride = torch.empty(size, device="meta").stride()
        zero = torch.empty_strided(size, stride, dtype=dtype, device=device).zero_()
        zero._kiln_zero = True  # type: ignore[attr-defined]
        if zero.numel() <= ZERO_COTANGENT_LIMIT and position not in self.passed_on:
            self.zeros[position], self.kept_layouts[position] = zero, layout
            self.unchecked.add(position)
        return zero

    def check_zeros(self, results: Sequence[torch.Tensor | None]) -> None:
        """Stop keeping the zero cotangents the backward handed on as a gradient (the gradient
        of ``x + y`` is the sum's cotangent): whoever gets one may write into it."""
        kept = {self.zeros[k].untyped_storage().data_ptr(): k for k in self.unchecked}
        for result in results:
            if result is not None and result.untyped_storage().data_ptr() in kept:
                position = kept[result.untyped_storage().data_ptr()]
                self.passed_on.add(position)
                del self.zeros[position]
        self.unchecked.clear()


_Layout = tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device]


def _layout(tensor: torch.Tensor) -> _Layout:
    return tensor.size(), tensor.stride(), tensor.dtype, tensor.device


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, owner: TrainingGraph, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # The compiled forward returns its outputs (the original ones, then the saved values),
        # then the new values of mutated inputs.
        results = owner.forward(list(inputs))
        count, saved_count = owner.output_count, owner.plan.saved_count
        saved = [inputs[i] for i in owner.plan.saved_inputs]
        static_input = getattr(owner.forward, "static_input", None)
        if static_input is not None:  # (CUDA graphs: the copy the replay read, not the caller's)
            buffers = [static_input(i) for i in owner.plan.saved_inputs]
            saved = [t if b is None else b for t, b in zip(saved, buffers, strict=True)]
        saved += results[count : count + saved_count]
        ctx.save_for_backward(*saved)
        ctx.owner = owner
        ctx.set_materialize_grads(False)  # (unused outputs' cotangents: owner.zero_cotangent)
        ctx.layouts = [_layout(results[i]) for i in owner.differentiable]
        held: list[Any] = list(inputs)
        for position in owner.activations:
            held[position] = weakref.ref(inputs[position])
        ctx.inputs = held
        outputs = [*results[:count], *results[count + saved_count :]]
        differentiable = set(owner.differentiable)
        frozen = [o for i, o in enumerate(outputs) if i not in differentiable]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        owner: TrainingGraph = ctx.owner
        if torch.is_grad_enabled():
            return (None, *_differentiable_backward(ctx, owner, grads))
        cotangents = [
            grads[i] if grads[i] is not None else owner.zero_cotangent(k, ctx.layouts[k])
            for k, i in enumerate(owner.differentiable)
        ]
        results = owner.backward([*ctx.saved_tensors, *cotangents])
        if owner.unchecked:
            owner.check_zeros(results)
        input_grads: list[torch.Tensor | None] = [None] * owner.input_count
        for position, grad in zip(owner.plan.grad_inputs, results, strict=True):
            input_grads[position] = grad
        return (None, *input_grads)


_apply = super(torch.autograd.Function, _Function).apply  # (autograd's C++ apply)
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _differentiable_backward(
    ctx: Any, owner: TrainingGraph, grads: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """The input gradients as functions of the inputs (``create_graph=True``: a gradient
    penalty, a Hessian-vector product): the forward graph is run again by the reference
    interpreter under eager autograd, and eager autograd differentiates it."""
    found = [held() if isinstance(held, weakref.ref) else held for held in ctx.inputs]
    inputs: list[torch.Tensor] = [value for value in found if value is not None]
    if owner.random or len(inputs) != len(found):
        why = "draws random numbers" if owner.random else "an input was freed since the forward"
        raise RuntimeError(
            f"kiln: double backward (create_graph=True) through the compiled graph "
            f"{owner.name!r} is not possible: it {why}; compute higher-order gradients eagerly"
        )
    with torch.enable_grad():
        outputs = interpret(owner.plan.forward, inputs)[: owner.output_count]
        wanted = [(outputs[i], grads[i]) for i in owner.differentiable if grads[i] is not None]
        wrt = [position for position, t in enumerate(inputs) if t.requires_grad]
        results = torch.autograd.grad(
            [o for o, _ in wanted],
            [inputs[position] for position in wrt],
            [g for _, g in wanted],
            create_graph=True,
            allow_unused=True,
        )
    input_grads: list[torch.Tensor | None] = [None] * owner.input_count
    for position, grad in zip(wrt, results, strict=True):
        input_grads[position] = grad
    return input_grads
