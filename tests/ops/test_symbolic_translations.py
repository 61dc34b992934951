"""Symbolic sizes through the translations: a program compiled with ``dynamic=True`` and called
at several sizes is captured once (no size specialized, nothing run uncompiled) and computes
what eager computes at every size.

With ``dynamic=True`` every dim of every input tensor is symbolic, and dims of one size share a
symbol; so the dims that stay fixed here (2, 4, 5, 6, 8, 16) never equal a varying size (3, 7,
13: odd, and never 0 or 1, which are always specialized). When a case captures more than once,
the message lists what was specialized and every guard, with the line that decided it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
import kiln.capture.driver.cache as cache
from kiln.ir import Op

SIZES = (3, 7, 13)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def _indices(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape)


def _x(n: int) -> tuple[torch.Tensor, ...]:
    """The usual input: (batch 2, n, channels 8)."""
    return (_randn(2, n, 8),)


def _square(n: int) -> tuple[torch.Tensor, ...]:
    return (_randn(2, n, n),)


def _size(x: torch.Tensor) -> Any:
    return x.shape[1]


def _setitem(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[y > 0] = 0.0
    return y


def _causal(x: torch.Tensor) -> torch.Tensor:
    t = x.shape[-1]
    mask = torch.ones(t, t).tril() == 0
    return x.masked_fill(mask, float("-inf")).softmax(-1)


def _heads(x: torch.Tensor) -> torch.Tensor:
    b, t, c = x.shape
    return x.view(b, t, 2, c // 2).transpose(1, 2).reshape(b * 2, t, c // 2)


def _pad_to(x: torch.Tensor) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, 16 - x.shape[1]))


def _positions(x: torch.Tensor) -> torch.Tensor:
    t = x.shape[1]
    return x + torch.arange(t).unsqueeze(-1) / t


def _symbolic_scalars(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[1]
    y = x * 2
    y += n
    return torch.add(y, n - 1) / (n // 2) - torch.full((2, n, 1), n) + x.masked_fill(x > 0, n)


CONV = nn.Conv2d(4, 6, 3, padding=1)
EMBEDDING = nn.Embedding(10, 8)


def case(
    name: str,
    fn: Callable[..., Any],
    inputs: Callable[[int], tuple[torch.Tensor, ...]] = _x,
    externs: tuple[str, ...] = (),
) -> Any:
    """A table row: ``fn`` on ``inputs(n)`` for each size; ``externs``: the functions allowed to
    run as extern nodes (those kiln translates for no size)."""
    return pytest.param(fn, inputs, externs, id=name)


MOVEMENT = [
    case("view-minus-one", lambda x: x.view(x.shape[0], -1) * 2),
    case("view-heads", _heads),
    case("reshape-computed", lambda x: x.reshape(x.shape[0] * x.shape[1], 8) + 1),
    case("reshape-minus-one-first", lambda x: x.reshape(-1, 4) * 2),
    case("permute", lambda x: x.permute(2, 0, 1) * 2),
    case("transpose-contiguous-view", lambda x: x.transpose(0, 1).contiguous().view(_size(x), -1)),
    case("flatten", lambda x: x.flatten(0, 1) + 1),
    case("unflatten", lambda x: x.flatten(0, 1).unflatten(0, (2, -1)) * 2),
    case("movedim", lambda x: x.movedim(1, -1) * 2),
    case("cat", lambda x: torch.cat([x, x * 2], dim=1)),
    case("cat-new-zeros", lambda x: torch.cat([x, x.new_zeros(2, 1, 8)], 1)),
    case("stack", lambda x: torch.stack([x, x + 1], dim=1)),
    case("split-fixed-dim", lambda x: x.split(3, dim=2)[1] * 2),
    case("chunk", lambda x: x.chunk(2, dim=1)[0] + 1),
    case("chunk-fixed-dim", lambda x: x.chunk(2, dim=2)[1] + 1),
    case("narrow", lambda x: x.narrow(1, 1, x.shape[1] - 2) * 2),
    case("slice-to-size-minus-one", lambda x: x[:, : x.shape[1] - 1] * 2),
    case("slice-difference", lambda x: x[:, 1:] - x[:, :-1]),
    case("slice-last-two", lambda x: x[:, -2:] * 2),
    case("slice-step", lambda x: x[:, ::2] * 2),
    case("select-last", lambda x: x[..., -1] * 2),
    case("select-last-symbolic", lambda x: x[:, -1] * 2),
    case("select-symbolic-index", lambda x: x[:, _size(x) - 2] * 2),
    case("expand", lambda x: x[:, :, :1].expand(-1, -1, 8) + x),
    case("expand-symbolic", lambda x: x.sum(1, keepdim=True).expand(2, _size(x), 8) + x),
    case("expand-as", lambda x: x[:, :1].expand_as(x) + x),
    case("repeat", lambda x: x.repeat(1, 2, 1)),
    case("broadcast-to", lambda x: x[0].broadcast_to(5, _size(x), 8) * 2),
    case("pad-to-length", _pad_to),
    case("pad-symbolic", lambda x: F.pad(x, (0, x.shape[-1] + _size(x)))),
    case("pad-reflect", lambda x: F.pad(x, (1, 2), mode="reflect"), lambda n: (_randn(2, 4, n),)),
    case("roll", lambda x: x.roll(1, 1)),
    case("flip", lambda x: x.flip(1)),
    case("diagonal", lambda x: x.diagonal(dim1=-2, dim2=-1) * 2, _square),
    case("tril", lambda x: x.tril(), _square),
    case("triu-offset", lambda x: x.triu(1), lambda n: (_randn(2, n, n + 1),)),
    case("unfold", lambda x: x.unfold(1, 2, 1), externs=("unfold",)),
    case(
        "repeat-interleave", lambda x: x.repeat_interleave(2, dim=1), externs=("repeat_interleave",)
    ),
    case("glu-halves", lambda x: F.glu(x, 1), lambda n: (_randn(2, 2 * n, 8),), ("glu",)),
    case(
        "interpolate-nearest",
        lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
        lambda n: (_randn(2, 4, n, n + 2),),
    ),
]

INDEXING = [
    case("index-select", lambda x, i: x.index_select(1, i), lambda n: (_x(n)[0], _indices(n, 5))),
    case(
        "index-select-by-symbolic",
        lambda x, i: x.index_select(0, i),
        lambda n: (_randn(6, 4), _indices(6, n)),
    ),
    case("gather", lambda x, i: x.gather(1, i), lambda n: (_randn(4, n), _indices(n, 4, n))),
    case("embedding", lambda i: EMBEDDING(i), lambda n: (_indices(10, 2, n),)),
    case("advanced-index", lambda x, i: x[i], lambda n: (_randn(n, 4), _indices(n, 5))),
    case("advanced-index-dim1", lambda x, i: x[:, i], lambda n: (_randn(4, n), _indices(n, n))),
    case(
        "index-add",
        lambda x, i, v: x.index_add(0, i, v),
        lambda n: (_randn(n, 4), _indices(n, 5), _randn(5, 4)),
    ),
    case(
        "scatter-add",
        lambda x, i, s: x.scatter_add(1, i, s),
        lambda n: (_randn(2, n), _indices(n, 2, n), _randn(2, n)),
    ),
    case("masked-fill-tril", _causal, _square),
    case(
        "masked-fill-triu",
        lambda x: x.masked_fill(torch.triu(torch.ones(_size(x), _size(x)), 1).bool(), 0.0),
        _square,
    ),
    case("setitem-mask", _setitem),
    case("where", lambda x: torch.where(x > 0, x, 0.0)),
    case("clamp", lambda x: x.clamp(-0.5, 0.5)),
    case(
        "one-hot",
        lambda i: F.one_hot(i, 6).float() * 2,
        lambda n: (_indices(6, 2, n),),
        externs=("one_hot",),
    ),
]

CREATION = [
    case("arange", lambda x: x[0, :, 0] + torch.arange(_size(x))),
    case("arange-float", lambda x: x[0, :, 0] * torch.arange(_size(x), dtype=torch.float32)),
    case("arange-step", lambda x: x[:, torch.arange(0, _size(x), 2)]),
    case("arange-start", lambda x: torch.arange(1, _size(x) + 1) * x[0, :, 0]),
    case("positions", _positions),
    case("new-zeros", lambda x: x.new_zeros(x.shape[0], _size(x)) + x.sum(-1)),
    case("new-ones-shape", lambda x: x.new_ones(x.shape) + x),
    case("new-full", lambda x: x.new_full((2, _size(x)), 2.0) + x.sum(-1)),
    case("full", lambda x: torch.full((x.shape[0], _size(x)), 3.0) * x.sum(-1)),
    case("ones", lambda x: torch.ones(_size(x)) + x[0, :, 0]),
    case("zeros-long", lambda x: torch.zeros(2, _size(x), dtype=torch.long) + x.argmax(-1)),
    case("zeros-like", lambda x: torch.zeros_like(x) + x),
    case("eye", lambda x: torch.eye(_size(x)) + x[0, :, :1]),
    case(
        "lengths-mask",
        lambda x, lengths: x.masked_fill(torch.arange(_size(x)) >= lengths[:, None], 0.0),
        lambda n: (_randn(2, n), torch.randint(1, n, (2,))),
    ),
]

ARITHMETIC = [
    case("times-size", lambda x: x * x.shape[0] + x * _size(x)),
    case("over-size", lambda x: x / x.size(-1) + x / _size(x)),
    case("plus-numel", lambda x: x + x.numel()),
    case("size-minus", lambda x: _size(x) - x),
    case("symbolic-scalars", _symbolic_scalars),
    case("integer-tensor", lambda i: i // _size(i) + i % _size(i), lambda n: (_indices(20, 2, n),)),
    case("compare-size", lambda x: (x.argmax(1) == _size(x) - 1) | (x.argmax(1) < 2)),
    case("half", lambda x: (x.half() * _size(x)).float()),
]

REDUCTIONS = [
    case("sum", lambda x: x.sum(1)),
    case("sum-fixed-dim", lambda x: x.sum(-1)),
    case("mean", lambda x: x.mean(1)),
    case("mean-all", lambda x: x.mean()),
    case("mean-keepdim", lambda x: x - x.mean(dim=(1, 2), keepdim=True)),
    case("var", lambda x: x.var(1)),
    case("std", lambda x: x.std(1)),
    case("var-fixed-dim", lambda x: x.var(-1)),
    case("std-mean", lambda x: torch.std_mean(x, 1)[0]),
    case("softmax", lambda x: x.softmax(1)),
    case("log-softmax", lambda x: x.log_softmax(-1)),
    case("layer-norm", lambda x: F.layer_norm(x, (8,))),
    case("rms-norm", lambda x: F.rms_norm(x, (8,))),
    case("group-norm", lambda x: F.group_norm(x, 2), lambda n: (_randn(2, 8, n),)),
    case("batch-norm-train", lambda x: F.batch_norm(x, None, None, training=True)),
    case("argmax", lambda x: x.argmax(1)),
    case("max", lambda x: x.max(1).values),
    case("amax", lambda x: x.amax((0, 1))),
    case("logsumexp", lambda x: x.logsumexp(1)),
    case("norm", lambda x: x.norm(dim=1)),
    case("cumsum", lambda x: x.cumsum(1)),
    case("topk", lambda x: x.topk(2, dim=1).values),
    case("topk-half", lambda x: x.topk(_size(x) // 2, dim=1).values),
    case("sort", lambda x: x.sort(1).values),
    case(
        "cross-entropy",
        lambda x, t: F.cross_entropy(x, t),
        lambda n: (_randn(n, 5), _indices(5, n)),
    ),
    case(
        "cross-entropy-classes",
        lambda x, t: F.cross_entropy(x, t),
        lambda n: (_randn(4, n), _indices(n, 4)),
    ),
    case("mse", lambda x, y: F.mse_loss(x, y), lambda n: (_randn(2, n), _randn(2, n))),
    case("avg-pool", lambda x: F.avg_pool2d(x, 2), lambda n: (_randn(2, 4, n, n + 4),)),
    case("max-pool", lambda x: F.max_pool1d(x, 2), lambda n: (_randn(2, 4, n),)),
    case(
        "adaptive-avg-pool",
        lambda x: F.adaptive_avg_pool1d(x, 4),
        lambda n: (_randn(2, 4, n + 8),),
    ),
]

EXTERNS = [
    case("matmul", lambda x, w: x @ w, lambda n: (_x(n)[0], _randn(8, 5))),
    case("matmul-broadcast", lambda a, b: a @ b, lambda n: (_randn(2, 1, n, 4), _randn(5, 4, 6))),
    case(
        "linear", lambda x, w, b: F.linear(x, w, b), lambda n: (_x(n)[0], _randn(5, 8), _randn(5))
    ),
    case("bmm", lambda x: torch.bmm(x, x.transpose(1, 2))),
    case(
        "einsum",
        lambda a, b: torch.einsum("bij,bjk->bik", a, b),
        lambda n: (_randn(2, n, 4), _randn(2, 4, n)),
    ),
    case("conv2d", lambda x: CONV(x), lambda n: (_randn(2, 4, n, n + 2),)),
    case(
        "sdpa-causal",
        lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
        lambda n: (_randn(2, 2, n, 8),),
    ),
    case(
        "sdpa-mask",
        lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m),
        lambda n: (_randn(2, 2, n, 8), torch.rand(n, n) > 0.3),
    ),
]


def _clone(values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(v.clone() for v in values)


def _entries() -> list[Any]:
    return [entry for _, code in cache._CACHES.values() for entry in code.entries]


def shapes_report() -> str:
    """What each capture specialized and guarded on sizes, for an assertion message."""
    lines = []
    for entry in _entries():
        shapes = entry.capture.shapes
        if shapes is None:
            continue
        lines.append("capture:")
        lines += [
            f"  specialized {expression}: {why}" for expression, why in shapes.specializations
        ]
        lines += [f"  guard {relation.text()}  ({relation.why})" for relation in shapes.relations]
    return "\n".join(lines)


def extern_names() -> set[str]:
    """The functions that captured graphs call as extern nodes."""
    return {
        getattr(node.attrs.fn, "__name__", repr(node.attrs.fn))
        for entry in _entries()
        if entry.capture.graph is not None
        for node in entry.capture.graph.nodes
        if node.op is Op.EXTERN
    }


def assert_captured_once(externs: tuple[str, ...] = ()) -> None:
    assert kiln.counters.captures == 1, (
        f"captured {kiln.counters.captures} times\n{shapes_report()}"
    )
    assert kiln.counters.graph_breaks == []
    assert kiln.counters.fallbacks == []
    assert extern_names() <= set(externs), f"fell back to externs: {extern_names()}"


@pytest.mark.parametrize(
    ("fn", "inputs", "externs"),
    [*MOVEMENT, *INDEXING, *CREATION, *ARITHMETIC, *REDUCTIONS, *EXTERNS],
)
def test_captured_once_at_every_size(
    fn: Callable[..., Any],
    inputs: Callable[[int], tuple[torch.Tensor, ...]],
    externs: tuple[str, ...],
) -> None:
    kiln.reset()
    compiled = kiln.compile(fn, dynamic=True, options={"strict": True})
    for n in SIZES:
        values = inputs(n)
        expected = fn(*_clone(values))
        actual = compiled(*_clone(values))
        torch.testing.assert_close(actual, expected, msg=lambda m, n=n: f"size {n}: {m}")
    assert_captured_once(externs)


def test_dropout_draws_at_every_size() -> None:
    """Random numbers of a symbolic count: each size gets its own draws, scaled as eager."""
    kiln.reset()
    compiled = kiln.compile(lambda x: F.dropout(x, 0.5), dynamic=True, options={"strict": True})
    for n in SIZES:
        x = _randn(2, n, 8)
        y = compiled(x)
        assert y.shape == x.shape
        kept = y != 0
        torch.testing.assert_close(y[kept], 2 * x[kept])
    assert_captured_once()


def test_tensor_of_a_size_specializes() -> None:
    """``torch.tensor(n)`` is data whose uses may need its value as a Python number (a slice
    bound): the size specializes, one capture per size, each right."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x[:, : 16 - torch.tensor(_size(x))] * torch.tensor(_size(x))

    kiln.reset()
    compiled = kiln.compile(fn, dynamic=True, options={"strict": True})
    for n in SIZES:
        x = _randn(2, n + 8, 8)
        torch.testing.assert_close(compiled(x), fn(x))
    assert kiln.counters.captures == len(SIZES)
    assert kiln.counters.graph_breaks == []


# ---------------------------------------------------------------------------------------------
# training: gradients of every parameter at each size


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), labels)


class Block(nn.Module):
    """A causal self-attention block, sized by its input as GPT-style code writes it."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            part.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for part in self.qkv(self.norm1(x)).split(c, dim=2)
        )
        scores = (q @ k.transpose(-2, -1)) * (1.0 / k.size(-1) ** 0.5)
        hidden = torch.ones(t, t).tril() == 0
        weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        y = (weights @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.proj(y)
        return (x + self.mlp(self.norm2(x))).pow(2).mean()


@pytest.mark.parametrize(
    ("model", "inputs"),
    [
        pytest.param(Classifier, lambda n: (_randn(n, 8), _indices(4, n)), id="mlp-batch"),
        pytest.param(Block, lambda n: (_randn(2, n, 16),), id="block-sequence"),
        pytest.param(Block, lambda n: (_randn(n, 5, 16),), id="block-batch"),
    ],
)
def test_gradients_at_every_size(
    model: type[nn.Module], inputs: Callable[[int], tuple[torch.Tensor, ...]]
) -> None:
    kiln.reset()
    eager = model()
    mine = copy.deepcopy(eager)
    compiled = kiln.compile(mine, dynamic=True, options={"strict": True})
    for n in SIZES:
        values = inputs(n)
        eager.zero_grad()
        mine.zero_grad()
        eager(*values).backward()
        compiled(*values).backward()
        for (name, got), want in zip(mine.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad, msg=lambda m, k=name: f"{k}: {m}")
    assert_captured_once()
