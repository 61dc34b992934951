"""``torch.compile(backend="kiln")``: Dynamo captures, Kiln compiles (its own autodiff for
training); outputs, every parameter's gradient and buffers match eager, batch sizes change,
and the counters show Kiln compiled (no silent eager fallback)."""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Callable
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import SmallResNet, tiny_gpt2_config
from torch import nn

import kiln
import kiln.dynamo
from kiln.backends.kiln import CompiledProgramRecord
from kiln.bench.tiny_gpt import TinyGPT
from kiln.recording import recording

kiln.dynamo.register()


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    torch._dynamo.reset()
    kiln.reset()
    yield
    torch._dynamo.reset()


def test_entry_point_is_declared_and_loads_the_backend() -> None:
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    value = pyproject["project"]["entry-points"]["torch_dynamo_backends"]["kiln"]
    entry = EntryPoint(name="kiln", value=value, group="torch_dynamo_backends")
    assert entry.load() is kiln.dynamo.backend
    assert torch._dynamo.lookup_backend("kiln") is kiln.dynamo.backend


def _compare(actual: Any, expected: Any) -> None:
    leaves = torch.utils._pytree.tree_leaves
    for got, want in zip(leaves(actual), leaves(expected), strict=True):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _check(
    model: nn.Module,
    make_input: Callable[[int], torch.Tensor],
    sizes: list[int],
    train: bool,
    output: Callable[[Any], torch.Tensor] = lambda result: result,
) -> None:
    """Compiled and eager copies of ``model`` on fresh inputs of each batch size: outputs,
    every parameter's gradient (training) and the buffers agree; Kiln compiled each size."""
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="kiln")
    with recording(CompiledProgramRecord) as programs:
        for size in sizes:
            x = make_input(size)
            with torch.set_grad_enabled(train):
                actual, expected = output(compiled(x)), output(reference(x))
            _compare(actual, expected)
            if train:
                assert "_Function" in type(actual.grad_fn).__name__  # Kiln's TrainingGraph
                weights = torch.randn_like(expected)
                (actual * weights).sum().backward()
                (expected * weights).sum().backward()
                for (name, parameter), twin in zip(
                    model.named_parameters(), reference.parameters(), strict=True
                ):
                    assert parameter.grad is not None, name
                    torch.testing.assert_close(
                        parameter.grad, twin.grad, rtol=1e-4, atol=1e-4, msg=name
                    )
                model.zero_grad()
                reference.zero_grad()
            for (name, buffer), twin in zip(
                model.named_buffers(), reference.buffers(), strict=True
            ):
                torch.testing.assert_close(buffer, twin, msg=name)
    # Once per size, plus once more for a size the first (static) Dynamo graph already had.
    assert len(set(sizes)) <= kiln.counters.dynamo_graphs <= len(sizes)
    assert not kiln.counters.dynamo_fallbacks
    assert programs and not [p for p in programs if p.fallback]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).log_softmax(-1)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_mlp_with_changing_batch_sizes(train: bool) -> None:
    torch.manual_seed(0)
    _check(MLP(), lambda n: torch.randn(n, 12), [3, 5, 3, 8], train)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_small_resnet(train: bool) -> None:
    torch.manual_seed(0)
    _check(SmallResNet().train(train), lambda n: torch.randn(n, 3, 16, 16), [2], train)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_tiny_gpt(train: bool) -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, width=32, depth=2, heads=2, context=16)
    _check(model, lambda n: torch.randint(0, 64, (n, 12)), [2, 3], train)


def test_untraceable_graph_runs_eagerly_with_a_warning() -> None:
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item()

    gm = torch.fx.symbolic_trace(scaled)
    compiled = kiln.dynamo.backend(gm, [torch.randn(3)])
    x = torch.randn(3)
    with pytest.warns(RuntimeWarning, match="eagerly"):
        torch.testing.assert_close(compiled(x), scaled(x))
    assert len(kiln.counters.dynamo_fallbacks) == 1 and kiln.counters.dynamo_graphs == 0
    strict = kiln.dynamo.backend(gm, [x], options={"strict": True})
    with pytest.raises(kiln.TraceError, match="item"):
        strict(x)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_tiny_gpt2(train: bool) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tiny_gpt2_config(vocab_size=100, n_positions=32, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config)
    make_input = lambda n: torch.randint(0, 100, (n, 10))
    _check(model, make_input, [2], train, output=lambda result: result.logits)


class Regions(nn.Module):
    """Grad-mode and autocast regions inside the Dynamo graph."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.mixed = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = self.frozen(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = self.mixed(x + y)
        return z.float().relu()


def test_grad_mode_and_autocast_regions() -> None:
    torch.manual_seed(0)
    model = Regions()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    actual = torch.compile(model, backend="kiln")(x)
    expected = reference(x)
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected)
    actual.sum().backward()
    expected.sum().backward()
    assert model.frozen.weight.grad is None
    for parameter, twin in zip(model.mixed.parameters(), reference.mixed.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, twin.grad)
    assert kiln.counters.dynamo_graphs == 1 and not kiln.counters.dynamo_fallbacks


@pytest.mark.parametrize("backend", ["kiln", "eager"])
def test_parameters_and_buffers_as_graph_module_attributes(backend: str) -> None:
    # A graph that reads parameters and buffers as its own attributes (symbolic_trace's):
    # Kiln takes them from the GraphModule and writes the BatchNorm statistics back there
    # (the kiln backend's kernels update them in place; the interpreter's results are copied).
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(SmallResNet())
    reference = copy.deepcopy(gm)
    x = torch.randn(2, 3, 16, 16)
    actual = kiln.dynamo.backend(gm, [x], options={"backend": backend})(x)
    expected = reference(x)
    torch.testing.assert_close(actual, expected)
    actual.square().sum().backward()
    expected.square().sum().backward()
    for (name, parameter), twin in zip(gm.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, twin.grad, rtol=1e-4, atol=1e-4, msg=name)
    for (name, buffer), twin in zip(gm.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(buffer, twin, msg=name)
    assert kiln.counters.dynamo_graphs == 1
