"""Small real models through the ``kiln`` backend's code generators, inference and training,
against eager (the C++ kernels on CPU; the Triton kernels through Triton's interpreter)."""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from tests.tiny_models import SmallResNet, tiny_bert_config, tiny_gpt2_config

transformers = pytest.importorskip("transformers")
CODEGENS = ["cpp", "triton"] if importlib.util.find_spec("triton") else ["cpp"]


def small_resnet() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return SmallResNet(), (torch.randn(2, 3, 16, 16),)


def tiny_bert() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    cfg = tiny_bert_config()
    cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = 0.0
    return transformers.BertForMaskedLM(cfg), (torch.randint(0, cfg.vocab_size, (2, 8)),)


def tiny_gpt2() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    cfg = tiny_gpt2_config()
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return transformers.GPT2LMHeadModel(cfg), (torch.randint(0, cfg.vocab_size, (2, 8)),)


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "small_resnet": small_resnet,
    "tiny_bert": tiny_bert,
    "tiny_gpt2": tiny_gpt2,
}


def _first(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


@pytest.fixture
def codegen(request: pytest.FixtureRequest) -> Any:
    """The options of kiln.compile for one code generator (strict: no silent fallback)."""
    kiln.reset()
    yield {"codegen": request.param, "strict": True}
    kiln.reset()


@pytest.mark.parametrize("codegen", CODEGENS, indirect=True)
@pytest.mark.parametrize("name", list(MODELS))
def test_inference_matches_eager(codegen: dict[str, Any], name: str) -> None:
    model, args = MODELS[name]()
    model.eval()
    with torch.no_grad():
        expected = _first(model(*args))
        actual = _first(kiln.compile(model, fullgraph=True, options=codegen)(*args))
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("codegen", CODEGENS, indirect=True)
@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_matches_eager(codegen: dict[str, Any], name: str) -> None:
    model, args = MODELS[name]()
    model.train()
    twin = copy.deepcopy(model)
    expected = _first(model(*args)).float().square().mean()
    expected.backward()
    actual = (
        _first(kiln.compile(twin, fullgraph=True, options=codegen)(*args)).float().square().mean()
    )
    actual.backward()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-6)
    for (name_, want), got in zip(model.named_parameters(), twin.parameters(), strict=True):
        if want.grad is None:
            assert got.grad is None, name_
            continue
        assert got.grad is not None, name_
        scale = want.grad.abs().max().clamp(min=1e-6)
        error = (got.grad - want.grad).abs().max() / scale
        assert error < 1e-4, f"{name_}: relative error {error:.2e}"


class _SequenceFirstAttention(nn.Module):
    """torchvision's ViT attention: ``nn.MultiheadAttention`` on [L, B, E] inputs, whose q
    reaches the CPU flash kernel laid out [L, B, H, E]."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


class _LearnedBiasAttention(nn.Module):
    """T5's attention: a position bias that requires grad as SDPA's mask (the math kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.bias = nn.Parameter(torch.randn(1, 4, 17, 17))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 17, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias).transpose(1, 2)


ATTENTION_FORMS = {
    "bert": tiny_bert,
    "sequence_first": lambda: (_SequenceFirstAttention(), (torch.randn(17, 2, 32),)),
    "learned_bias": lambda: (_LearnedBiasAttention(), (torch.randn(2, 17, 32),)),
}


@pytest.mark.parametrize("codegen", ["cpp"], indirect=True)
@pytest.mark.parametrize("form", list(ATTENTION_FORMS))
def test_attention_layouts_are_predicted_so_nothing_rebuilds(
    codegen: dict[str, Any], form: str
) -> None:
    """SDPA and its backward return the flash kernels' layouts (the forward's output in the
    query's dim order), or the math kernel's where a mask requires grad (asked of PyTorch on
    uninitialized tensors); the schedule predicts them, so no extern result is copied and no
    graph is compiled a second time. Every gradient matches eager's on each call."""
    from kiln.backends.kiln import CompiledProgramRecord
    from kiln.recording import listen, unlisten

    model, args = ATTENTION_FORMS[form]()
    model.train()
    twin = copy.deepcopy(model)
    records: list[Any] = []
    listen(records, CompiledProgramRecord)
    try:
        compiled = kiln.compile(twin, options=codegen)
        for _ in range(2):
            for module in (model, twin):
                module.zero_grad()
            _first(model(*args)).float().square().mean().backward()
            _first(compiled(*args)).float().square().mean().backward()
            for (name, want), got in zip(model.named_parameters(), twin.parameters(), strict=True):
                assert want.grad is not None and got.grad is not None, name
                torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)
    finally:
        unlisten(records)
    assert [r.graph.rsplit("_", 1)[-1] for r in records] == ["forward", "backward"]


@pytest.mark.parametrize("codegen", ["cpp"], indirect=True)
def test_cpu_convolution_inputs_are_channels_last(codegen: dict[str, Any]) -> None:
    """On the CPU, kernels feeding a convolution (or its backward) store channels-last, in
    inference and training graphs (oneDNN is faster on them), and an NCHW graph input a
    convolution reads is copied channels-last first (so the convolution answers channels-last
    and no kernel after it converts layouts); forward and gradients match eager."""
    from kiln.backends.kiln import CompiledProgramRecord
    from kiln.recording import listen, unlisten
    from kiln.schedule.program import ExternCall

    def conv_operand_layouts(train: bool) -> set[tuple[str, bool]]:
        model, args = small_resnet()
        model.train(train)
        reference = copy.deepcopy(model)
        records: list[Any] = []
        listen(records, CompiledProgramRecord)
        try:
            out = kiln.compile(model, options=codegen)(*args)
            torch.testing.assert_close(out, reference(*args), rtol=1e-4, atol=1e-4)
            if train:
                out.square().mean().backward()
                reference(*args).square().mean().backward()
                for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
                    assert mine.grad is not None and theirs.grad is not None
                    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-4)
        finally:
            unlisten(records)
        layouts = set()
        for record in records:
            for step in record.program.steps:
                if isinstance(step, ExternCall) and step.node.op.name == "CONVOLUTION":
                    view = step.operands[0]
                    layouts.add((view.buffer.kind.value, view.strides[1] == 1))
        return layouts

    with torch.no_grad():
        assert conv_operand_layouts(train=False) == {("temp", True)}
    assert conv_operand_layouts(train=True) == {("temp", True)}
