"""Inference programs: models in eval mode under ``no_grad``, structured inputs and outputs
(dicts, lists, dataclasses, named tuples), in-place work on inputs and buffers, views of inputs
returned, a parameter reassigned between calls, and small transformers models.

Outputs (container types included), inputs after the call (in-place updates), buffers and the
aliasing of outputs with inputs must match eager on every call.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch import nn

from .harness import Call, Program, WrongCounters, Xfail, check_program, params
from .models import MHA, SmallCNN, TinyLM, TorchEncoder, TransformerBlock


def evaluated(model: nn.Module) -> nn.Module:
    """Eval mode with non-trivial BatchNorm statistics."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return model.eval()


# --- structured inputs and outputs ----------------------------------------------------------


@dataclasses.dataclass
class Batch:
    features: torch.Tensor
    mask: torch.Tensor
    scale: float = 1.0


class Prediction(NamedTuple):
    logits: torch.Tensor
    probabilities: torch.Tensor


@dataclasses.dataclass
class Output:
    embedding: torch.Tensor
    norm: torch.Tensor


class DictModel(nn.Module):
    """A dict in, a dict out (as a multi-task head)."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Linear(12, 8)
        self.text = nn.Linear(6, 8)
        self.heads = nn.ModuleDict({"a": nn.Linear(8, 3), "b": nn.Linear(8, 1)})

    def forward(self, inputs):
        h = torch.relu(self.image(inputs["image"]) + self.text(inputs["text"]))
        return {name: head(h) for name, head in self.heads.items()}


class ListModel(nn.Module):
    """A list of tensors in (multi-scale features), a tuple out."""

    def __init__(self) -> None:
        super().__init__()
        self.projections = nn.ModuleList([nn.Linear(4 * (i + 1), 8) for i in range(3)])

    def forward(self, levels):
        projected = [p(level) for p, level in zip(self.projections, levels, strict=True)]
        return torch.stack(projected).sum(0), len(levels)


class DataclassModel(nn.Module):
    """A dataclass batch in, a named tuple out."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, batch: Batch):
        logits = self.fc(batch.features * batch.scale).masked_fill(~batch.mask, -1e4)
        return Prediction(logits, torch.softmax(logits, dim=-1))


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, *, normalize=True):
        e = self.fc(x)
        norm = e.norm(dim=-1, keepdim=True)
        return Output(e / norm if normalize else e, norm)


class KeywordModel(nn.Module):
    """Keyword arguments with defaults and an optional tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, bias=None, *, temperature=1.0, activation="relu"):
        h = self.fc(x) / temperature
        if bias is not None:
            h = h + bias
        return torch.relu(h) if activation == "relu" else torch.tanh(h)


# --- in-place work, buffers and views -------------------------------------------------------


class RunningNormalizer(nn.Module):
    """Updates running statistics buffers in place on every call (as in RL observation
    normalisers)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))
        self.register_buffer("count", torch.tensor(0, dtype=torch.long))

    def forward(self, x):
        self.count += x.shape[0]
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        self.var.mul_(0.9).add_(0.1 * x.var(0))
        return (x - self.mean) / self.var.sqrt()


class StepCounter(nn.Module):
    """Counts its calls in a Python int attribute (a step counter for a schedule or for
    logging every N steps) that the tensor work does not read."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.steps = 0

    def forward(self, x):
        self.steps += 1
        return torch.relu(self.fc(x))


class Streaming(nn.Module):
    """State carried across calls in a plain tensor attribute and a buffer reassigned (not
    written in place), as streaming models and EMA trackers do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.hidden = torch.zeros(8)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        h = torch.tanh(self.fc(x) + self.hidden)
        self.hidden = h.mean(0)
        self.ema = self.ema * 0.9 + 0.1 * h.mean(0)
        return h


def make_nonlocal_counter():
    """A closure counting its calls in a ``nonlocal`` int."""
    step = 0

    def program(x):
        nonlocal step
        step += 1
        return torch.tanh(x) * 2

    return program


class KVCache(nn.Module):
    """Writes this step's keys into a cache buffer at a position (a decoder's KV cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.key = nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(2, 10, 8))

    def forward(self, x, position):
        k = self.key(x)
        self.cache[:, position : position + x.shape[1]] = k
        return self.cache[:, : position + x.shape[1]].sum(1)


def inplace_on_inputs(x, y):
    """In-place updates of the caller's tensors, a view of an input returned."""
    x.mul_(2).add_(1)
    y[:, 0] = x[:, 0] * 3
    x.clamp_(min=-1.0)
    return x[1:], y.t()


def returns_views(x):
    """Several views of one input, and the input itself."""
    return x, x.view(-1), x[:, ::2], x.transpose(0, 1), x.unsqueeze(0), x.narrow(1, 1, 2)


def inplace_through_view(x):
    """In place through a view writes into the input."""
    rows = x[:2]
    rows.relu_()
    x.diagonal().zero_()
    return x.sum(dim=1)


def appends_to_list(x, log):
    """Appends tensors to a caller's list (collected activations)."""
    h = torch.tanh(x)
    log.append(h)
    log.append(h.shape[0])
    return h * 2


def make_recorder():
    """A closure that records into its own dict and list on every call."""
    seen: dict[str, torch.Tensor] = {}
    order: list[int] = []

    def record(x):
        y = x.softmax(-1)
        seen["last"] = y
        order.append(y.shape[0])
        return y.log()

    return record


class Recorder(nn.Module):
    """Stores the last activation and its shape as attributes (forward hooks done by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.last_shape: tuple[int, ...] = ()
        self.history: list[tuple[int, ...]] = []

    def forward(self, x):
        h = self.fc(x)
        self.last = h.detach()
        self.last_shape = tuple(h.shape)
        self.history.append(self.last_shape)
        return h.relu()


class Swappable(nn.Module):
    """A Parameter reassigned between calls (weights loaded into a live model)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


def load_new_weight(model: nn.Module, call: int) -> None:
    model.fc.weight = nn.Parameter(torch.randn(8, 8) * 0.3)
    with torch.no_grad():
        model.out.bias.copy_(torch.randn(3))


# --- transformers models --------------------------------------------------------------------


def tiny_bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    from tiny_models import tiny_bert_config

    return transformers.BertModel(tiny_bert_config()).eval()


def tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    from tiny_models import tiny_gpt2_config

    return transformers.GPT2LMHeadModel(tiny_gpt2_config()).eval()


def bert_inputs(variant: int) -> Call:
    b, t = 2, 7 + 2 * variant
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, -3:] = 0
    return Call((), {"input_ids": torch.randint(1, 99, (b, t)), "attention_mask": mask})


def gpt2_inputs(variant: int) -> Call:
    return Call((), {"input_ids": torch.randint(1, 99, (2, 6 + 2 * variant))})


# --- inputs ---------------------------------------------------------------------------------


def rows(variant: int) -> tuple[torch.Tensor]:
    return (torch.randn(4 + 2 * variant, 8),)


def images(variant: int) -> tuple[torch.Tensor]:
    return (torch.randn(2 + variant, 3, 8, 8),)


def sequences(variant: int) -> tuple[torch.Tensor]:
    return (torch.randn(2, 5 + 2 * variant, 16),)


def dict_inputs(variant: int) -> tuple[dict[str, torch.Tensor]]:
    b = 3 + variant
    return ({"image": torch.randn(b, 12), "text": torch.randn(b, 6)},)


def list_inputs(variant: int) -> tuple[list[torch.Tensor]]:
    b = 2 + variant
    return ([torch.randn(b, 4), torch.randn(b, 8), torch.randn(b, 12)],)


def batch_inputs(variant: int) -> tuple[Batch]:
    b = 3 + variant
    mask = torch.rand(b, 5) > 0.3
    mask[:, 0] = True
    return (Batch(torch.randn(b, 8), mask, 0.5),)


def keyword_inputs(variant: int) -> Call:
    b = 3 + variant
    return Call((torch.randn(b, 8),), {"bias": torch.randn(8), "temperature": 2.0})


def kv_inputs(variant: int) -> tuple[torch.Tensor, int]:
    return torch.randn(2, 3, 8), 2


def two_matrices(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3 + variant, 4), torch.randn(3 + variant, 4)


def square(variant: int) -> tuple[torch.Tensor]:
    return (torch.randn(4 + variant, 4 + variant),)


def with_log(variant: int) -> tuple[torch.Tensor, list]:
    return torch.randn(3 + variant, 4), [torch.ones(1)]


def lm_tokens(variant: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, 50, (2, 6 + 2 * variant)),)


def with_padding(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, t = 3, 5 + variant
    padding = torch.zeros(b, t, dtype=torch.bool)
    padding[1, -2:] = True
    return torch.randn(b, t, 16), padding


def query_memory(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3 + variant, 16), torch.randn(2, 5 + variant, 16)


NO_GRAD = {"context": torch.no_grad}

COUNTER_GUARD = Xfail(
    WrongCounters,
    "a Python int incremented on every call (self.steps += 1 in forward, or a nonlocal "
    "counter) and never read by tensor work is guarded by value (L['self'].steps == 0, "
    "C['step'] == 0): every call recompiles, and past recompile_limit the frame runs "
    "uncompiled",
)

PROGRAMS = [
    Program("cnn-batchnorm-eval", lambda: evaluated(SmallCNN()), images, **NO_GRAD),
    Program("cnn-eval-with-grad-enabled", lambda: evaluated(SmallCNN()), images),
    Program(
        "cnn-batchnorm-inference-mode",
        lambda: evaluated(SmallCNN()),
        images,
        context=torch.inference_mode,
    ),
    Program(
        "transformer-block-eval", lambda: TransformerBlock("hand").eval(), sequences, **NO_GRAD
    ),
    Program("tiny-lm-eval", lambda: TinyLM().eval(), lm_tokens, **NO_GRAD),
    Program("torch-encoder-layer-eval", lambda: TorchEncoder().eval(), with_padding, **NO_GRAD),
    Program("multihead-attention-eval", lambda: MHA().eval(), query_memory, **NO_GRAD),
    Program("dict-in-dict-out", DictModel, dict_inputs, **NO_GRAD),
    Program("list-in-tuple-out", ListModel, list_inputs, **NO_GRAD),
    Program("dataclass-in-namedtuple-out", DataclassModel, batch_inputs, **NO_GRAD),
    Program(
        "dataclass-out-keyword-only",
        DataclassOut,
        lambda v: Call(rows(v), {"normalize": True}),
        **NO_GRAD,
    ),
    Program("keywords-and-optional-tensor", KeywordModel, keyword_inputs, **NO_GRAD),
    Program("buffers-updated-in-place", RunningNormalizer, rows, **NO_GRAD),
    Program("python-int-step-counter", StepCounter, rows, **NO_GRAD, xfail=COUNTER_GUARD),
    Program("nonlocal-int-counter", make_nonlocal_counter, rows, xfail=COUNTER_GUARD),
    Program("state-in-tensor-attributes", Streaming, rows, **NO_GRAD),
    Program("kv-cache-buffer", KVCache, kv_inputs, variants=(0, 0, 0), **NO_GRAD),
    Program("inplace-on-inputs", lambda: inplace_on_inputs, two_matrices),
    Program("returns-views-of-input", lambda: returns_views, square),
    Program("inplace-through-view", lambda: inplace_through_view, square),
    Program("appends-to-argument-list", lambda: appends_to_list, with_log),
    Program("closure-records-state", make_recorder, rows),
    Program("module-records-attributes", Recorder, rows, **NO_GRAD),
    Program(
        "parameter-reassigned-between-calls",
        Swappable,
        rows,
        variants=(0, 0, 0),
        between=load_new_weight,
        **NO_GRAD,
    ),
    Program(
        "hf-bert-eval",
        tiny_bert,
        bert_inputs,
        atol=1e-4,
        rtol=1e-4,
        slow=True,
        **NO_GRAD,
    ),
    Program(
        "hf-gpt2-eval",
        tiny_gpt2,
        gpt2_inputs,
        atol=1e-4,
        rtol=1e-4,
        slow=True,
        **NO_GRAD,
    ),
]


@pytest.mark.parametrize("program", params(PROGRAMS))
def test_inference(program: Program) -> None:
    check_program(program)
