"""Module machinery real programs lean on: forward hooks and pre-hooks, parametrizations
(weight norm, spectral norm), ``super().forward``, a compiled bound method, ``functools.partial``,
decorated forwards, an embedding with ``max_norm`` (which renormalises its weight in place),
and common building blocks (einsum, interpolate/pad/transposed convolution, scatter/gather,
routing to experts, assertions on values, iteration over a tensor).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

import kiln

from .harness import Call, Program, check_program, params

DATA = kiln.BreakReason.DATA_DEPENDENT
CALL = kiln.BreakReason.UNSUPPORTED_CALL
IN_LOOP = kiln.SkipReason.BREAK_IN_LOOP


class Features(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Hooked(Features):
    """A forward hook stores an activation in a dict; a pre-hook scales the input; another
    forward hook replaces the output (feature extraction, input normalisation). The storing
    hook is a bound method, so ``copy.deepcopy`` gives the copy its own."""

    def __init__(self) -> None:
        super().__init__()
        self.captured: dict[str, torch.Tensor] = {}
        self.fc1.register_forward_hook(self.keep)
        self.fc2.register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
        self.fc2.register_forward_hook(lambda module, args, output: output.tanh())

    def keep(self, module, args, output):
        self.captured["fc1"] = output.detach()


def weight_normed() -> nn.Module:
    model = Features()
    parametrizations.weight_norm(model.fc1)
    return model


def spectral_normed() -> nn.Module:
    """Spectral norm's power iteration updates buffers in place on every training call."""
    model = Features()
    parametrizations.spectral_norm(model.fc1)
    return model


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Derived(Base):
    """``super().forward`` and an extra residual."""

    def forward(self, x):
        return super().forward(x) + x


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.head = nn.Linear(6, 2)

    def encode(self, x, scale=1.0):
        return F.normalize(self.fc(x), dim=-1) * scale

    def forward(self, x):
        return self.head(self.encode(x))


def bound_method() -> object:
    """``kiln.compile(model.encode)``: a bound method, not the module's call."""
    return Encoder().encode


def partial_of(x, w, *, scale):
    return torch.tanh(x @ w) * scale


class NoGradForward(nn.Module):
    """A forward decorated with ``@torch.no_grad()``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    @torch.no_grad()
    def forward(self, x):
        return self.fc(x).softmax(-1)


class BoundedEmbedding(nn.Module):
    """``nn.Embedding(max_norm=...)`` renormalises the rows it reads, in place, under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 6, max_norm=1.0)
        self.head = nn.Linear(6, 3)
        with torch.no_grad():
            self.embed.weight.mul_(3)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


class Bilinear(nn.Module):
    """Attention-like scores with einsum."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, 8) * 0.2)

    def forward(self, a, b):
        scores = torch.einsum("bid,hde,bje->bhij", a, self.w, b)
        return torch.einsum("bhij,bjd->bhid", scores.softmax(-1), b).sum(1)


class TinyUNet(nn.Module):
    """Down (conv, pool), up (transposed conv, interpolate), pad and skip concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.fuse = nn.Conv2d(11, 4, 3, padding=1)

    def forward(self, x):
        d = F.max_pool2d(F.relu(self.down(x)), 2)
        u = self.up(d)
        u = F.pad(u, (0, x.shape[-1] - u.shape[-1], 0, x.shape[-2] - u.shape[-2]))
        smooth = F.interpolate(d, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return self.fuse(torch.cat([x, u + smooth], dim=1))


class ScatterGather(nn.Module):
    """Segment sums with scatter_add / index_add and lookups with gather (graph pooling)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, segment, index):
        h = self.fc(x)
        pooled = torch.zeros(3, 8).scatter_add(0, segment[:, None].expand_as(h), h)
        counts = torch.zeros(3).index_add(0, segment, torch.ones(x.shape[0]))
        picked = h.gather(1, index)
        return pooled / counts[:, None], picked


class MixtureOfExperts(nn.Module):
    """Hash-style routing: each expert runs on the rows routed to it, ``out[rows] =
    expert(x[rows])`` (boolean masks; the routing is balanced, so the sizes follow the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x, choice):
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = choice == i
            out[rows] = expert(x[rows])
        return out


class DenseMixture(nn.Module):
    """Soft routing without data-dependent shapes: every expert weighted by the router."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 3)
        self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        weights = self.router(x).softmax(-1)
        outs = torch.stack([expert(x) for expert in self.experts], dim=-1)
        return (outs * weights[:, None, :]).sum(-1)


class CheckedInput(nn.Module):
    """Input validation: a shape assert (static) and a value check (data-dependent)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        assert x.shape[-1] == 8, "expects 8 features"
        if not torch.isfinite(x).all():
            raise ValueError("non-finite input")
        return self.fc(x)


class ClippedWeights(nn.Module):
    """WGAN critic: weights clipped in place through ``.data`` at the start of forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        self.fc1.weight.data.clamp_(-0.1, 0.1)
        self.fc2.weight.data.clamp_(-0.1, 0.1)
        return self.fc2(torch.relu(self.fc1(x)))


class ManualEMA(nn.Module):
    """A buffer updated in place under ``no_grad`` inside a training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("average", torch.zeros(8))

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            self.average.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return h - self.average


def replace_data(model: nn.Module, call: int) -> None:
    """``param.data = new`` between calls (a checkpoint loaded into the live parameters)."""
    model.fc.weight.data = torch.randn(8, 8)


def iterate_rows(x):
    total = torch.zeros(x.shape[1])
    for row in x:
        total = total + row.relu()
    return total, len(x)


# --- inputs ---------------------------------------------------------------------------------


def rows(variant: int, requires_grad: bool = False) -> tuple[torch.Tensor]:
    return (torch.randn(4 + 2 * variant, 8, requires_grad=requires_grad),)


def train_rows(variant: int) -> tuple[torch.Tensor]:
    return rows(variant, requires_grad=True)


def routed_rows(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = 4 + 2 * variant
    return torch.randn(b, 8, requires_grad=True), torch.randperm(b) % 3


def tokens(variant: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, 20, (3 + variant, 5)),)


def pairs(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3 + variant, 8), torch.randn(2, 4 + variant, 8)


def images(variant: int) -> tuple[torch.Tensor]:
    return (torch.randn(2, 3, 8 + 2 * variant, 8 + 2 * variant),)


def segments(variant: int) -> tuple[torch.Tensor, ...]:
    n = 6 + 2 * variant
    return torch.randn(n, 8), torch.arange(n) % 3, torch.randint(0, 8, (n, 2))


def partial_inputs(variant: int) -> tuple[torch.Tensor]:
    return (torch.randn(3 + variant, 8, requires_grad=True),)


def build_partial():
    w = torch.randn(8, 8) / 3
    return functools.partial(partial_of, w=w, scale=2.0)


def partial_caller():
    """``functools.partial`` objects are not functions: call one from a compiled function."""
    fn = build_partial()

    def program(x):
        return fn(x) + 1

    return program


PROGRAMS = [
    Program("forward-hooks", Hooked, train_rows, train=True),
    Program("weight-norm-parametrization", weight_normed, train_rows, train=True),
    Program(
        "spectral-norm-power-iteration",
        spectral_normed,
        train_rows,
        train=True,
    ),
    Program("super-forward", Derived, train_rows, train=True),
    Program("bound-method", bound_method, lambda v: Call(rows(v), {"scale": 2.0}), train=True),
    Program(
        "functools-partial-callee",
        partial_caller,
        partial_inputs,
        train=True,
        breaks=(CALL,),  # the partial's bound tensor cannot be re-read by a guard
        captures=2,
    ),
    Program("no-grad-decorated-forward", NoGradForward, train_rows),
    Program("embedding-max-norm", BoundedEmbedding, tokens, train=True),  # (renorm in graph)
    Program("einsum-bilinear", Bilinear, pairs, train=True),
    Program("unet-interpolate-pad-convtranspose", TinyUNet, images, train=True),
    Program("scatter-add-index-add-gather", ScatterGather, segments, train=True),
    Program(
        "moe-top1-routing",
        MixtureOfExperts,
        routed_rows,
        train=True,
        # __call__ breaks at its call of forward, which runs uncompiled; the experts' Linear
        # forwards compile per row count (2 and 1 rows, then 2 rows again)
        graphs=(3, 0, 2),
        breaks=(DATA,),
        captures=5,
        skips=(IN_LOOP,),  # out[rows] = expert(x[rows]) breaks inside the loop over experts
    ),
    Program("moe-dense-routing", DenseMixture, train_rows, train=True),
    Program("assert-on-values", CheckedInput, rows, graphs=2, breaks=(DATA, DATA)),
    Program("iterate-tensor-rows", lambda: iterate_rows, rows),
    Program("manual-ema-buffer-train", ManualEMA, train_rows, train=True),
    Program(
        "parameter-data-replaced",
        ManualEMA,
        rows,
        variants=(0, 0, 0),
        between=replace_data,
        context=torch.no_grad,
    ),
    Program(
        "weight-clip-through-data",
        ClippedWeights,
        train_rows,
        train=True,
    ),
]


@pytest.mark.parametrize("program", params(PROGRAMS))
def test_modules(program: Program) -> None:
    check_program(program)
