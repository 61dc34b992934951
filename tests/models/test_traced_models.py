"""Real models traced into graphs and interpreted: outputs (and BatchNorm stats) match eager."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from tiny_models import SmallResNet, tiny_bert_config, tiny_gpt2_config
from torch import nn

import kiln
from kiln.bench.tiny_gpt import TinyGPT
from kiln.ir import Op


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
    config = tiny_bert_config(
        vocab_size=100,
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
    config = tiny_gpt2_config(vocab_size=100, n_head=2, n_positions=32, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        _check(model, ids)
