"""Real models traced into graphs and interpreted: outputs (and BatchNorm stats) match eager."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import kiln
from kiln.demo import TinyGPT
from kiln.ir import Op


class BasicBlock(nn.Module):
    def __init__(self, channels: int, stride: int = 1) -> None:
        super().__init__()
        out = channels * stride
        self.conv1 = nn.Conv2d(channels, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels, out, 1, stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + self.shortcut(x))


class SmallResNet(nn.Module):
    """ResNet-style: stem conv/BN/ReLU/max-pool, residual blocks, global pool, classifier."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, 1, 1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        self.layers = nn.Sequential(BasicBlock(8), BasicBlock(8, stride=2))
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def _check(model: nn.Module, *inputs: Any, rtol: float = 1e-4, atol: float = 1e-4) -> None:
    reference = copy.deepcopy(model)
    graph = kiln.trace(model, *inputs)
    externs = sorted({str(node.attrs.fn) for node in graph.nodes if node.op is Op.EXTERN})
    assert not externs, f"untranslated calls: {externs}"
    actual = kiln.run_traced(graph, model, *inputs)
    expected = reference(*inputs)
    leaves = torch.utils._pytree.tree_leaves
    for a, e in zip(leaves(actual), leaves(expected), strict=True):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol)
    for (name, buffer), ref in zip(model.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(buffer, ref, msg=f"buffer {name}")


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_resnet_style_cnn(train: bool) -> None:
    torch.manual_seed(0)
    model = SmallResNet().train(train)
    with torch.no_grad():
        _check(model, torch.randn(2, 3, 16, 16))


def test_tiny_gpt_demo_model() -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        _check(
            TinyGPT(vocab=64, width=32, depth=2, heads=2, context=16).eval(),
            torch.randint(0, 64, (2, 16)),
        )


transformers = pytest.importorskip("transformers")


def test_tiny_bert() -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    model = transformers.BertForMaskedLM(config).eval()
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        _check(model, ids)


def test_tiny_gpt2() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=100,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        _check(model, ids)
