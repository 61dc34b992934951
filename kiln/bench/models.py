"""The benchmark suites: which models ``kiln bench`` runs, at which sizes, built how.

Every model is built from a config with random weights (nothing is downloaded), on the CPU
under ``torch.manual_seed(0)``, so every worker process builds bit-identical weights and can
compare its results with the eager process's. Dropout is off in the transformer configs:
Kiln draws its own random numbers (``docs/architecture.md``), so a training step with dropout
could never match eager's, and a correctness column that always fails would hide real bugs.

``reference`` is the suite of ``TARGETS.md`` (GPU, its batch sizes); ``overhead`` the
host-bound steps that ``mode="reduce-overhead"`` is for (ResNet-50 at 64 images, BERT-base
and GPT-2 small at batch 1); ``cpu`` holds small models that finish in minutes on two
cores. Models whose package (torchvision, transformers) is missing are skipped, and the bench
says so.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kiln.bench.tiny_gpt import TinyGPT

InputMaker = Callable[[torch.Generator], tuple[torch.Tensor, ...]]


@dataclass
class Workload:
    """A built model and how to draw one input set for it (CPU tensors; the worker moves them)."""

    model: nn.Module
    make_input: InputMaker


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: ``build(batch)`` makes the workload; ``requires`` are the optional
    packages it needs (checked before anything is imported)."""

    name: str
    summary: str
    build: Callable[[int], Workload]
    batch: int
    requires: tuple[str, ...] = ()

    def missing(self) -> list[str]:
        """The required packages that are not installed."""
        return [package for package in self.requires if importlib.util.find_spec(package) is None]


def _images(batch: int, size: int) -> InputMaker:
    return lambda generator: (torch.randn(batch, 3, size, size, generator=generator),)


def _tokens(batch: int, length: int, vocab: int) -> InputMaker:
    return lambda generator: (torch.randint(0, vocab, (batch, length), generator=generator),)


def _quiet_transformers() -> None:
    """Silence transformers' config chatter (it would interleave with the progress display)."""
    from transformers.utils import logging

    logging.set_verbosity_error()


def _torchvision(name: str, size: int, **kwargs: int) -> Callable[[int], Workload]:
    def build(batch: int) -> Workload:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None, **kwargs)
        return Workload(model, _images(batch, size))

    return build


def _gpt2(length: int, **config: Any) -> Callable[[int], Workload]:
    def build(batch: int) -> Workload:
        _quiet_transformers()
        from transformers import GPT2Config, GPT2LMHeadModel

        settings = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **config)
        model = GPT2LMHeadModel(settings)
        return Workload(model, _tokens(batch, length, settings.vocab_size))

    return build


def _bert(length: int, **config: Any) -> Callable[[int], Workload]:
    def build(batch: int) -> Workload:
        _quiet_transformers()
        from transformers import BertConfig, BertForMaskedLM

        settings = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **config)
        model = BertForMaskedLM(settings)
        return Workload(model, _tokens(batch, length, settings.vocab_size))

    return build


class SmallCNN(nn.Module):
    """A three-stage conv/BatchNorm/ReLU classifier: the CPU suite's CNN when torchvision is
    missing (it needs nothing beyond torch)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for inputs, outputs, stride in ((3, 32, 1), (32, 64, 2), (64, 128, 2)):
            layers += [
                nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False),
                nn.BatchNorm2d(outputs),
                nn.ReLU(),
            ]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def _small_cnn(batch: int) -> Workload:
    return Workload(SmallCNN(), _images(batch, 32))


def _tiny_gpt(batch: int) -> Workload:
    return Workload(TinyGPT(), _tokens(batch, 64, 512))


_TINY_GPT2: dict[str, Any] = dict(
    n_layer=2,
    n_embd=128,
    n_head=4,
    vocab_size=2048,
    n_positions=128,
    bos_token_id=0,
    eos_token_id=0,
)
_TINY_BERT: dict[str, Any] = dict(
    num_hidden_layers=2,
    hidden_size=128,
    num_attention_heads=4,
    intermediate_size=512,
    vocab_size=2048,
    max_position_embeddings=128,
)

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # The reference suite: TARGETS.md's models and batch sizes.
        ModelSpec(
            "resnet50",
            "ResNet-50, Bx3x224x224",
            _torchvision("resnet50", 224),
            64,
            ("torchvision",),
        ),
        ModelSpec(
            "vit_b_16", "ViT-B/16, Bx3x224x224", _torchvision("vit_b_16", 224), 64, ("torchvision",)
        ),
        ModelSpec("bert_base", "BERT-base MLM, Bx512", _bert(512), 16, ("transformers",)),
        ModelSpec("gpt2", "GPT-2 small LM, Bx1024", _gpt2(1024), 8, ("transformers",)),
        # The overhead suite: the host-bound steps of the modes issue (reduce-overhead).
        ModelSpec("bert_base_128", "BERT-base MLM, Bx128", _bert(128), 1, ("transformers",)),
        ModelSpec("gpt2_32", "GPT-2 small LM, Bx32", _gpt2(32), 1, ("transformers",)),
        # The cpu suite: small sizes.
        ModelSpec("tiny_gpt", "kiln.bench.tiny_gpt.TinyGPT (0.5M), Bx64", _tiny_gpt, 4),
        ModelSpec("small_cnn", "3-stage conv/BN/ReLU CNN, Bx3x32x32", _small_cnn, 8),
        ModelSpec(
            "gpt2_tiny",
            "GPT-2 LM, 2 layers x 128, Bx128",
            _gpt2(128, **_TINY_GPT2),
            4,
            ("transformers",),
        ),
        ModelSpec(
            "bert_tiny",
            "BERT MLM, 2 layers x 128, Bx128",
            _bert(128, **_TINY_BERT),
            4,
            ("transformers",),
        ),
        ModelSpec(
            "resnet18_small",
            "ResNet-18, 100 classes, Bx3x64x64",
            _torchvision("resnet18", 64, num_classes=100),
            8,
            ("torchvision",),
        ),
    )
}

SUITES: dict[str, tuple[str, ...]] = {
    "reference": ("resnet50", "vit_b_16", "bert_base", "gpt2"),
    "overhead": ("resnet50", "bert_base_128", "gpt2_32"),
    "cpu": ("tiny_gpt", "small_cnn", "gpt2_tiny", "bert_tiny", "resnet18_small"),
}


def primary_output(output: object) -> torch.Tensor:
    """The tensor a model's result is judged by: ``logits`` of a transformers output, the
    first element of a tuple, or the tensor itself."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, tuple | list):
        return primary_output(output[0])
    if isinstance(output, torch.Tensor):
        return output
    raise TypeError(f"cannot find the output tensor of a {type(output).__name__}")


def training_loss(output: object) -> torch.Tensor:
    """The loss of the training benchmark (the reference scripts' ``logsumexp().mean()``):
    one scalar that depends on every logit, with no labels to draw."""
    return primary_output(output).float().logsumexp(-1).mean()
