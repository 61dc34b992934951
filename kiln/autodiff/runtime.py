"""Running a compiled forward/backward pair inside eager autograd.

:class:`TrainingGraph` differentiates a graph ahead of time (``reverse``), splits the joint
graph (``partition``), compiles both halves with the backend, and runs them in one
``torch.autograd.Function``: the forward saves what the partitioner chose, the backward maps
the outputs' cotangents to the gradients of the inputs that require grad. Gradients therefore
reach leaf parameters and inputs, accumulate over several backward calls, respect
``retain_graph``, and compose with eager code before and after the compiled region.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.autodiff.partition import Partition, partition
from kiln.autodiff.reverse import build_joint
from kiln.ir.graph import Graph
from kiln.ir.verify import verify
from kiln.passes import optimize

Compile = Callable[[Graph], Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]]


def needs_autodiff(graph: Graph) -> bool:
    """Whether running ``graph`` must record gradients (some output requires grad)."""
    return any(output.type.requires_grad for output in graph.outputs)


class TrainingGraph:
    """A graph compiled as a forward/backward pair; called like a compiled graph."""

    def __init__(self, graph: Graph, compile_graph: Compile) -> None:
        joint = build_joint(graph)
        self.plan: Partition = partition(joint, graph)
        self.plan.forward = verify(optimize(verify(self.plan.forward)))
        self.plan.backward = verify(optimize(verify(self.plan.backward)))
        self.name = graph.name
        self.forward = compile_graph(self.plan.forward)
        self.backward = compile_graph(self.plan.backward)
        self.output_count = len(graph.outputs)
        self.mutation_count = len(graph.mutations)
        self.differentiable = joint.differentiable_outputs
        self.input_count = len(graph.inputs)

    @property
    def saved_names(self) -> list[str]:
        """What the forward keeps for the backward (explain() reports it)."""
        inputs = [self.plan.forward.inputs[i].name for i in self.plan.saved_inputs]
        start = self.output_count
        values = [v.name for v in self.plan.forward.outputs[start:]]
        return inputs + values

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(_Function.apply(self, *inputs))


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, owner: TrainingGraph, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # The compiled forward returns its outputs (the original ones, then the saved values),
        # then the new values of mutated inputs.
        results = owner.forward(list(inputs))
        count, saved_count = owner.output_count, owner.plan.saved_count
        saved = [inputs[i] for i in owner.plan.saved_inputs]
        saved += results[count : count + saved_count]
        ctx.save_for_backward(*saved)
        ctx.owner = owner
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
            raise RuntimeError(
                f"kiln: double backward (create_graph=True) through the compiled graph "
                f"{owner.name!r} is not supported; compute higher-order gradients eagerly"
            )
        cotangents = [grads[i] for i in owner.differentiable]
        results = owner.backward([*ctx.saved_tensors, *cotangents])
        input_grads: list[torch.Tensor | None] = [None] * owner.input_count
        for position, grad in zip(owner.plan.grad_inputs, results, strict=True):
            input_grads[position] = grad
        return (None, *input_grads)


def compile_training(graph: Graph, compile_graph: Compile) -> TrainingGraph:
    return TrainingGraph(graph, compile_graph)
