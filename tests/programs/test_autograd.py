"""Autograd beyond plain differentiation: custom ``torch.autograd.Function``s (their backward is
the user's, which need not be the forward's derivative), activation checkpointing, gradient
hooks, ``torch.autograd.grad`` inside a program, and regions without gradients.

Training programs (all but two) compare the loss, each parameter's ``.grad`` (None against a
tensor is a failure) and the gradients of inputs. A custom Function's backward that differs
from the forward's derivative (gradient reversal, straight-through estimators, clipping) makes
a compiled program that differentiates the forward itself give other gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import kiln

from .harness import (
    Program,
    check_program,
    params,
)

IO = kiln.BreakReason.IO
DATA = kiln.BreakReason.DATA_DEPENDENT
CALL = kiln.BreakReason.UNSUPPORTED_CALL

# --- custom Functions -----------------------------------------------------------------------


class Square(torch.autograd.Function):
    """Plain: the backward is the derivative, from a saved input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class GradReverse(torch.autograd.Function):
    """Domain-adversarial training: identity forward, negated and scaled backward."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class RoundSTE(torch.autograd.Function):
    """Quantisation-aware training: round forward, identity (straight-through) backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class SignSTE(torch.autograd.Function):
    """Binary networks: sign forward, gradient passed where |x| <= 1 (saved input)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sign(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1).to(grad.dtype)


class ScaledMul(torch.autograd.Function):
    """Two tensor inputs, a Python float and a string; ``needs_input_grad`` skips work."""

    @staticmethod
    def forward(ctx, a, b, scale, mode):
        ctx.save_for_backward(a, b)
        ctx.scale = scale
        ctx.mode = mode
        return a * b * scale

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = grad * b * ctx.scale
        if ctx.needs_input_grad[1]:
            grad_b = grad * a * ctx.scale
            if ctx.mode == "clip":
                grad_b = grad_b.clamp(-0.1, 0.1)
        return grad_a, grad_b, None, None


class SortWithIndex(torch.autograd.Function):
    """Several outputs, one marked non-differentiable (the indices)."""

    @staticmethod
    def forward(ctx, x):
        values, index = torch.sort(x, dim=-1)
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(index)
        return values, index

    @staticmethod
    def backward(ctx, grad_values, grad_index):
        (index,) = ctx.saved_tensors
        return torch.zeros_like(grad_values).scatter(-1, index, grad_values)


class ClipGrad(torch.autograd.Function):
    """Identity forward; the backward clips the gradient's norm (a per-layer clip)."""

    @staticmethod
    def forward(ctx, x, max_norm):
        ctx.max_norm = max_norm
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        norm = grad.norm()
        return grad * torch.clamp(ctx.max_norm / (norm + 1e-6), max=1.0), None


class DomainAdversarial(nn.Module):
    """Features -> label head, and features -> reversed gradient -> domain head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(8, 16)
        self.label = nn.Linear(16, 3)
        self.domain = nn.Linear(16, 2)

    def forward(self, x):
        f = torch.relu(self.features(x))
        return self.label(f), self.domain(GradReverse.apply(f, 0.5))


class QuantizedMLP(nn.Module):
    """Linear -> STE-rounded activations -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(RoundSTE.apply(torch.tanh(self.fc1(x))))


class BinaryMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(SignSTE.apply(self.fc1(x)))


class SquareMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(Square.apply(self.fc1(x)))


class GatedMLP(nn.Module):
    """A custom Function with two differentiable inputs, between three Linear layers."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(ScaledMul.apply(self.a(x), torch.sigmoid(self.b(x)), 0.5, self.mode))


class SortPool(nn.Module):
    """Sorted features (values differentiable, indices not) as a permutation-invariant pool."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        values, index = SortWithIndex.apply(self.fc(x))
        return self.head(values), index


class ClippedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(ClipGrad.apply(F.gelu(self.fc1(x)), 0.05))


def square_fn(x, w):
    return Square.apply(x @ w).sum(dim=1)


def reverse_fn(x, w):
    return GradReverse.apply(x @ w, 2.0) * x.sum()


def scaled_mul_partial(a, b):
    """Only ``a`` requires grad: ``needs_input_grad`` is (True, False, False, False)."""
    return ScaledMul.apply(a, b, 3.0, "plain").tanh()


# --- checkpointing --------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Checkpointed(nn.Module):
    """Blocks under ``torch.utils.checkpoint.checkpoint`` (reentrant or not)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


class CheckpointedFunction(nn.Module):
    """``checkpoint`` of a function with keyword arguments and a Python flag."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 8)

    @staticmethod
    def mix(a, b, *, scale, relu):
        out = a * torch.sigmoid(b) * scale
        return torch.relu(out) if relu else out

    def forward(self, x):
        y = checkpoint(
            self.mix, self.fc(x), self.gate(x), scale=0.5, relu=True, use_reentrant=False
        )
        return y.sum(dim=1)


class Sequential(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(8, 16), nn.GELU(), Block(), Block(), nn.Linear(16, 4), nn.Tanh()
        )

    def forward(self, x):
        return checkpoint_sequential(self.layers, 3, x, use_reentrant=False)


def reassign_weight(model: nn.Module, call: int) -> None:
    """Between calls, a new Parameter object replaces a weight inside the checkpointed block
    (weight loading, re-initialisation): compiled code must read the new one."""
    block = model.blocks[0]
    block.fc1.weight = nn.Parameter(torch.randn_like(block.fc1.weight) * 0.2)


# --- hooks, autograd.grad, grad-free regions ------------------------------------------------


class HookedMLP(nn.Module):
    """A hook registered in forward on an activation scales its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if h.requires_grad:
            h.register_hook(lambda g: g * 0.25)
        return self.fc2(h)


class GradientPenalty(nn.Module):
    """WGAN-GP: the critic's gradient w.r.t. its input, inside the training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        x = x.detach().requires_grad_(True)
        score = self.critic(x)
        (grad,) = torch.autograd.grad(score.sum(), x, create_graph=True)
        penalty = ((grad.norm(dim=1) - 1) ** 2).mean()
        return score.mean() + 10 * penalty


class FrozenEncoder(nn.Module):
    """A frozen encoder under ``no_grad`` feeding a trained head (fine-tuning)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        with torch.no_grad():
            features = self.encoder(x)
        return self.head(features)


class Teacher(nn.Module):
    """Distillation: the teacher's targets under ``inference_mode`` (cloned out of it), the
    student trained on a KL loss."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Linear(8, 5)
        self.student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))

    def forward(self, x):
        with torch.inference_mode():
            soft = torch.softmax(self.teacher(x) / 2.0, dim=-1)
        soft = soft.clone()
        logp = torch.log_softmax(self.student(x) / 2.0, dim=-1)
        return F.kl_div(logp, soft, reduction="batchmean")


class DetachedTarget(nn.Module):
    """BYOL-style: one branch's output detached as the other's target."""

    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Linear(8, 8)
        self.target = nn.Linear(8, 8)

    def forward(self, x):
        p = F.normalize(self.online(x), dim=-1)
        z = F.normalize(self.target(x), dim=-1).detach()
        return (2 - 2 * (p * z).sum(dim=-1)).mean()


class PartlyFrozen(nn.Module):
    """``requires_grad_(False)`` on one layer: its parameters keep ``grad=None``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.fc1.requires_grad_(False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class EnableGradInside(nn.Module):
    """``enable_grad`` inside a forward run under ``no_grad`` (an inner optimisation)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        with torch.no_grad():
            base = self.fc(x)
            with torch.enable_grad():
                tuned = self.fc(x * 2)
        return base + tuned


# --- inputs ---------------------------------------------------------------------------------


def features(variant: int, requires_grad: bool = True) -> tuple[torch.Tensor]:
    return (torch.randn(4 + 2 * variant, 8, requires_grad=requires_grad),)


def x_w(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(4 + 2 * variant, 8, requires_grad=True),
        (torch.randn(8, 6) / 3).requires_grad_(),
    )


def a_b(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (3 + variant, 5)
    return torch.randn(shape, requires_grad=True), torch.randn(shape)


def sequence(variant: int) -> tuple[torch.Tensor]:
    return (torch.randn(2 + variant, 8),)


def leaf_in_program(x):
    """A new leaf made inside the program, its flag read after a break."""
    leaf = x.detach().requires_grad_(True)
    print("leaf requires grad:", leaf.requires_grad)
    return leaf * 2


PROGRAMS = [
    Program("square-mlp", SquareMLP, features, train=True),
    Program("square-function", lambda: square_fn, x_w, train=True),
    Program("grad-reverse-module", DomainAdversarial, features, train=True),
    Program("grad-reverse-function", lambda: reverse_fn, x_w, train=True),
    Program("ste-round", QuantizedMLP, features, train=True),
    Program("ste-sign-saved-input", BinaryMLP, features, train=True),
    Program("scaled-mul-clip", lambda: GatedMLP("clip"), features, train=True),
    Program("scaled-mul-plain", lambda: GatedMLP("plain"), features, train=True),
    Program("needs-input-grad", lambda: scaled_mul_partial, a_b, train=True),
    Program("several-outputs-non-differentiable", SortPool, features, train=True),
    Program("clip-grad-function", ClippedBlock, features, train=True),
    Program(
        "square-mlp-inference",
        SquareMLP,
        lambda v: features(v, requires_grad=False),
        context=torch.no_grad,
    ),
    Program("checkpoint-reentrant", lambda: Checkpointed(True), features, train=True),
    Program(
        "checkpoint-nonreentrant",
        lambda: Checkpointed(False),
        features,
        train=True,
    ),
    Program("checkpoint-kwargs", CheckpointedFunction, features, train=True),
    Program("checkpoint-sequential", Sequential, features, train=True),
    Program(
        "checkpoint-reassigned-parameter-train",
        lambda: Checkpointed(False),
        features,
        variants=(0, 0, 0),
        between=reassign_weight,
        train=True,
    ),
    Program(
        "checkpoint-reassigned-parameter-infer",
        lambda: Checkpointed(False),
        lambda v: features(v, requires_grad=False),
        variants=(0, 0, 0),
        between=reassign_weight,
        context=torch.no_grad,
    ),
    Program(
        "hook-on-activation",
        HookedMLP,
        features,
        train=True,
        graphs=2,
        breaks=(CALL, CALL),  # register_hook cannot be a graph node
    ),
    Program(
        "autograd-grad-penalty",
        GradientPenalty,
        features,
        train=True,
        # requires_grad_ makes a leaf autograd must see (a break, in the module call and in
        # forward), then torch.autograd.grad runs natively; the gradient penalty's double
        # backward re-runs the critic's forward under eager autograd
        graphs=3,
        breaks=(CALL, CALL, CALL),
        captures=5,
    ),
    Program(
        "requires-grad-leaf-in-program",
        lambda: leaf_in_program,
        lambda v: features(v, requires_grad=False),
        graphs=2,
        breaks=(CALL, IO),  # requires_grad_ runs natively: the leaf is autograd's
        captures=3,
    ),
    Program("no-grad-frozen-encoder", FrozenEncoder, features, train=True),
    Program("inference-mode-teacher", Teacher, features, train=True),
    Program("detached-target", DetachedTarget, features, train=True),
    Program("requires-grad-false-layer", PartlyFrozen, features, train=True),
    Program("enable-grad-in-no-grad", EnableGradInside, features, train=True),
]


@pytest.mark.parametrize("program", params(PROGRAMS))
def test_autograd(program: Program) -> None:
    check_program(program)
