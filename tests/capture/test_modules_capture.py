"""Real models through ``kiln.compile(model, fullgraph=True)``: a ResNet-style CNN (BatchNorm in
eval and train mode) and, when transformers is installed, tiny BERT and GPT-2 (eager and SDPA
attention). Outputs, BatchNorm buffers and parameter gradients match eager.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from harness import assert_same
from tiny_models import SmallResNet, tiny_bert_config, tiny_gpt2_config
from torch import nn

import kiln
from kiln.capture.driver import convert

try:
    import transformers
except ImportError:  # pragma: no cover - optional dependency
    transformers = None

needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers not installed")

ATOL = RTOL = 1e-4


def _randomize_batchnorm(model: nn.Module) -> nn.Module:
    """Non-trivial running statistics, so eval-mode BatchNorm does real work."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model


def _compare_grads(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=ATOL, rtol=RTOL, msg=f"grad of {name}")


def _run(model: nn.Module, make_inputs: Any, *, backward: bool, calls: int = 2) -> None:
    """Compile with fullgraph=True; outputs, buffers (and gradients) match eager each call."""
    kiln.reset()
    reference = copy.deepcopy(model)
    compiled = kiln.compile(model, fullgraph=True)
    for _ in range(calls):
        args, kwargs = make_inputs()
        expected = reference(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        actual = compiled(*args, **kwargs)
        assert_same(actual, expected, atol=ATOL, rtol=RTOL)
        if backward:
            _first_tensor(expected).sum().backward()
            _first_tensor(actual).sum().backward()
            _compare_grads(model, reference)
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
    for (name, buffer), ref in zip(model.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(buffer, ref, atol=ATOL, rtol=RTOL, msg=f"buffer {name}")
    assert kiln.counters.fallbacks == [], kiln.counters.fallbacks
    assert kiln.counters.graph_breaks == [], kiln.counters.graph_breaks


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits") and output.logits is not None:
        return output.logits
    return output[0]


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_resnet_style_cnn_forward(train: bool) -> None:
    model = _randomize_batchnorm(SmallResNet()).train(train)
    with torch.no_grad():
        _run(model, lambda: ((torch.randn(2, 3, 16, 16),), {}), backward=False)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_resnet_style_cnn_gradients(train: bool) -> None:
    model = _randomize_batchnorm(SmallResNet()).train(train)
    _run(model, lambda: ((torch.randn(2, 3, 16, 16),), {}), backward=True)


def test_resnet_style_cnn_one_graph() -> None:
    model = SmallResNet().eval()
    report = kiln.explain(model, torch.randn(1, 3, 8, 8))
    assert report.graph_count == 1 and not report.breaks and not report.skips, str(report)


def _bert() -> nn.Module:
    return transformers.BertModel(tiny_bert_config()).eval()


def _gpt2(attention: str) -> nn.Module:
    return transformers.GPT2LMHeadModel(tiny_gpt2_config(attn_implementation=attention)).eval()


def _token_inputs(with_mask: bool) -> Any:
    ids = torch.randint(0, 99, (2, 7))
    kwargs: dict[str, Any] = {}
    if with_mask:
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, 5:] = 0
        kwargs["attention_mask"] = mask
    return (ids,), kwargs


@needs_transformers
@pytest.mark.parametrize("with_mask", [False, True], ids=["ids", "ids_mask"])
def test_tiny_bert(with_mask: bool) -> None:
    with torch.no_grad():
        _run(_bert(), lambda: _token_inputs(with_mask), backward=False)


@needs_transformers
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_tiny_gpt2_forward(attention: str) -> None:
    with torch.no_grad():
        _run(_gpt2(attention), lambda: _token_inputs(False), backward=False)


@needs_transformers
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_tiny_gpt2_gradients(attention: str) -> None:
    model = _gpt2(attention).train()
    _run(model, lambda: _token_inputs(False), backward=True)


@needs_transformers
def test_tiny_gpt2_with_labels_loss() -> None:
    """The loss path (shifted cross-entropy inside the model) matches, with its gradients.
    transformers logs a warning on this path (a needed IO break), so no fullgraph here."""
    model = _gpt2("sdpa").train()

    def inputs() -> Any:
        ids = torch.randint(0, 99, (2, 7))
        return (ids,), {"labels": ids}

    kiln.reset()
    reference = copy.deepcopy(model)
    compiled = kiln.compile(model)
    args, kwargs = inputs()
    expected = reference(*args, **kwargs)
    actual = compiled(*args, **kwargs)
    torch.testing.assert_close(actual.loss, expected.loss, atol=ATOL, rtol=RTOL)
    expected.loss.backward()
    actual.loss.backward()
    _compare_grads(model, reference)


def test_the_head_reads_each_module_once_and_sees_replaced_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The head that calls the graph computes each module's path once (a nested model's
    parameters share their prefixes), and a parameter replaced or a submodule's weight swapped
    after compiling is what the next call reads, as in eager, without recompiling."""
    kiln.reset()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8)),
        nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)),
    )
    heads: list[str] = []
    original = convert.compiled_code

    def spy(source: str, name: str) -> Any:
        if name.startswith("<kiln head"):
            heads.append(source)
        return original(source, name)

    monkeypatch.setattr(convert, "compiled_code", spy)
    compiled = kiln.compile(model)
    x = torch.randn(5, 4)
    torch.testing.assert_close(compiled(x), model(x))
    (head,) = heads
    assert head.count("_modules") == 3  # (the model's and its two blocks': 16 unhoisted)
    with torch.no_grad():
        model[1][2].weight = nn.Parameter(torch.randn(3, 8))
        model[0][0].weight.copy_(torch.randn(8, 4))
    for _ in range(2):
        x = torch.randn(5, 4)
        torch.testing.assert_close(compiled(x), model(x))
    assert kiln.counters.captures == 1
