"""Training programs: a compiled model (or model-and-loss) stepped by an optimizer, as a user's
training loop does it. After every call the loss, every parameter's gradient and, after each
optimizer step, every parameter and buffer (BatchNorm running statistics) must match eager.

Randomness: Kiln does not promise eager's dropout stream, so dropout here is ``p=0`` or the
module is in eval mode (seeded random streams are in ``test_random.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln

from .harness import (
    Call,
    Program,
    WrongCounters,
    Xfail,
    check_program,
    params,
)
from .models import MHA, SmallCNN, TinyLM, TorchEncoder, TransformerBlock

CALL = kiln.BreakReason.UNSUPPORTED_CALL
DATA = kiln.BreakReason.DATA_DEPENDENT
IO = kiln.BreakReason.IO


def sgd(parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)


def adamw(parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Only for models without parameters whose true gradient is zero (an attention key's
    bias): Adam turns a rounding-level gradient into a full-size step of either sign."""
    return torch.optim.AdamW(parameters, lr=1e-2, weight_decay=0.01)


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def lm_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), targets.flatten(), ignore_index=-100)


# --- MLPs and CNNs --------------------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5)
    )


def cnn_eval_batchnorm() -> nn.Module:
    """Fine-tuning with frozen BatchNorm statistics: the model trains with BN in eval mode."""
    model = SmallCNN()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.eval()
    return model


class BatchNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


class BatchNormBreak(nn.Module):
    """BatchNorm before and after a print: running statistics are updated in both graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm1d(8)
        self.fc = nn.Linear(8, 8)
        self.bn2 = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = self.fc(self.bn1(x))
        print("batch", h.shape[0])
        return self.head(torch.relu(self.bn2(h)))


def switch_to_eval(model: nn.Module, call: int) -> None:
    """Validation after training steps: the third call runs in eval mode."""
    if call == 2:
        model.eval()


# --- attention and transformer blocks -------------------------------------------------------


class MaskedEncoder(nn.Module):
    """Padding-masked SDPA encoder with mean pooling over real tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16, padding_idx=0)
        self.block = TransformerBlock("sdpa")
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        keep = tokens != 0
        x = self.block(self.embed(tokens), keep)
        pooled = (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
        return self.head(pooled)


# --- recurrent models -----------------------------------------------------------------------


class RecurrentClassifier(nn.Module):
    def __init__(self, cell: str) -> None:
        super().__init__()
        kind = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}[cell]
        self.rnn = kind(8, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 4)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class BiLSTMTagger(nn.Module):
    """Embedding -> bidirectional LSTM -> per-token tags."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True, bidirectional=True)
        self.tags = nn.Linear(16, 5)

    def forward(self, tokens):
        out, (h, _) = self.lstm(self.embed(tokens))
        return self.tags(out), h


# --- embeddings, losses, autocast -----------------------------------------------------------


class BagOfWords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(40, 12, mode="mean")
        self.head = nn.Linear(12, 3)

    def forward(self, tokens):
        return self.head(self.bag(tokens))


class TextCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 8)
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        h = F.relu(self.conv(self.embed(tokens).transpose(1, 2)))
        return self.head(h.amax(dim=2))


class WithLoss(nn.Module):
    """A model and its loss in one compiled forward (``loss = model(x, y)``)."""

    def __init__(self, loss: str, outputs: int = 5) -> None:
        super().__init__()
        self.loss = loss
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, outputs))

    def forward(self, x, y):
        out = self.net(x)
        if self.loss == "ce-ignore-smooth":
            return F.cross_entropy(out, y, ignore_index=-100, label_smoothing=0.1)
        if self.loss == "ce-probabilities":
            return F.cross_entropy(out, torch.softmax(y, dim=-1))
        if self.loss == "ce-weighted":
            weight = torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0])
            return F.cross_entropy(out, y, weight=weight)
        if self.loss == "mse":
            return F.mse_loss(out, y)
        if self.loss == "bce-logits":
            return F.binary_cross_entropy_with_logits(out, y, pos_weight=torch.full((5,), 2.0))
        if self.loss == "nll":
            return F.nll_loss(F.log_softmax(out, dim=-1), y)
        if self.loss == "kl-div":
            return F.kl_div(F.log_softmax(out, dim=-1), F.softmax(y, dim=-1), reduction="batchmean")
        if self.loss == "smooth-l1":
            return F.smooth_l1_loss(out, y, beta=0.5)
        if self.loss == "huber-sum":
            return F.huber_loss(out, y, delta=0.3, reduction="sum")
        raise ValueError(self.loss)


class L2Regularised(nn.Module):
    """An explicit L2 penalty over every parameter, inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))

    def forward(self, x, y):
        penalty = sum((p * p).sum() for p in self.parameters())
        return F.cross_entropy(self.net(x), y) + 1e-3 * penalty


class AutocastMLP(nn.Module):
    """bfloat16 autocast with float32 additive biases: ``bf16 matmul + fp32 bias`` promotes
    to float32, as in mixed-precision models with learned offsets and scales."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.offset = nn.Parameter(torch.randn(32) * 0.1)
        self.scale = nn.Parameter(torch.ones(32))
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x):
        h = self.fc1(x) + self.offset
        h = self.norm(F.gelu(h) * self.scale)
        return self.fc2(h)


class AutocastBlock(nn.Module):
    """A transformer block under autocast, followed by a float32 learned bias."""

    def __init__(self) -> None:
        super().__init__()
        self.block = TransformerBlock("sdpa")
        self.bias = nn.Parameter(torch.randn(16) * 0.1)

    def forward(self, x):
        return self.block(x) + self.bias


def autocast_linear(x, w, b):
    """A function under autocast: a bf16 matmul plus a float32 bias input (float32 result)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ w + b
        return torch.relu(h).sum(-1) + (h * h).mean(-1)


class DropoutOff(nn.Module):
    """Dropout modules present but inert (p=0 in training, p=0.5 in eval)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.ReLU(), nn.Dropout(p), nn.Linear(16, 5), nn.Dropout(p)
        )

    def forward(self, x):
        return self.net(x)


def dropout_eval() -> nn.Module:
    model = DropoutOff(0.5)
    model.eval()
    return model


# --- whole training steps compiled -----------------------------------------------------------


def train_step(optimizer: str, log: bool = True):
    """``kiln.compile(train_step)``: zero_grad, forward, loss, backward, optimizer step (and a
    logged ``loss.item()``) in one compiled function, the model and optimizer in its closure."""

    def build():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
        parameters = list(model.parameters())
        opt = sgd(parameters) if optimizer == "sgd" else adamw(parameters)
        history: list[float] = []

        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if log:
                history.append(round(loss.item(), 3))
            return loss.detach()

        return step

    return build


def optimizer_step_only():
    """``opt.step()`` compiled, then the model run on the new parameters; the gradients are
    set between calls (``new_gradients``)."""
    model = nn.Linear(8, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.randn_like(p)

    def step(x):
        opt.step()
        return model(x)

    step.model = model  # type: ignore[attr-defined]
    return step


def new_gradients(program, call: int) -> None:
    for p in program.model.parameters():
        p.grad = torch.randn_like(p)


def gradient_assignment():
    """Gradients assigned inside the compiled function (federated averaging, custom
    clipping), then the optimizer step."""
    model = nn.Linear(8, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def step(grad_weight, grad_bias):
        model.weight.grad = grad_weight
        model.bias.grad = grad_bias
        opt.step()
        return model.weight.detach().clone(), model.bias.detach().clone()

    return step


def parameter_grads(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(5, 8), torch.randn(5)


# --- inputs ---------------------------------------------------------------------------------


def classify(variant: int) -> Call:
    b = 4 + 2 * variant
    return Call((torch.randn(b, 8),), targets=(torch.randint(0, 5, (b,)),))


def classify_in_forward(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = 4 + 2 * variant
    return torch.randn(b, 8), torch.randint(0, 5, (b,))


def images(variant: int) -> Call:
    b = 4 + 2 * variant
    return Call((torch.randn(b, 3, 8, 8),), targets=(torch.randint(0, 5, (b,)),))


def sequences(variant: int) -> tuple[torch.Tensor]:
    return (torch.randn(2 + variant, 6 + 2 * variant, 16),)


def padded_tokens(variant: int) -> tuple[torch.Tensor]:
    b, t = 3, 6 + 2 * variant
    tokens = torch.randint(1, 30, (b, t))
    lengths = torch.tensor([t, t - 2, 2])
    tokens[torch.arange(t)[None, :] >= lengths[:, None]] = 0
    return (tokens,)


def lm_tokens(variant: int) -> Call:
    b, t = 2, 6 + 2 * variant
    tokens = torch.randint(0, 50, (b, t))
    targets = torch.randint(0, 50, (b, t))
    targets[:, -2:] = -100  # padding positions ignored by the loss
    return Call((tokens,), targets=(targets,))


def with_padding(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, t = 3, 5 + variant
    padding = torch.zeros(b, t, dtype=torch.bool)
    padding[1, -2:] = True
    return torch.randn(b, t, 16), padding


def query_memory(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3 + variant, 16), torch.randn(2, 5 + variant, 16)


def time_series(variant: int) -> Call:
    b = 3 + variant
    return Call((torch.randn(b, 5 + 2 * variant, 8),), targets=(torch.randint(0, 4, (b,)),))


def tokens(variant: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, 40, (3 + variant, 7 + variant)),)


def loss_inputs(loss: str):
    def make(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = 4 + 2 * variant
        x = torch.randn(b, 8)
        if loss in ("ce-ignore-smooth", "ce-weighted", "nll"):
            y = torch.randint(0, 5, (b,))
            if loss == "ce-ignore-smooth":
                y[0] = -100
            return x, y
        if loss == "bce-logits":
            return x, torch.randint(0, 2, (b, 5)).float()
        return x, torch.randn(b, 5)

    return make


LOSSES = (
    "ce-ignore-smooth",
    "ce-probabilities",
    "ce-weighted",
    "mse",
    "bce-logits",
    "nll",
    "kl-div",
    "smooth-l1",
    "huber-sum",
)

BF16 = {"atol": 3e-2, "rtol": 3e-2}

APPEND_ITEM = (
    "history.append(loss.item()) after the step: the resume function guards the bound method "
    "history.append by identity (L['__stack_3_0'] is append@0x...; a bound method is a new "
    "object on every attribute read) and the .item() value, so every call recompiles"
)


def x_w_b(variant: int) -> tuple[torch.Tensor, ...]:
    return (
        torch.randn(4 + 2 * variant, 8, requires_grad=True),
        (torch.randn(8, 8) / 3).requires_grad_(),
        torch.randn(8, requires_grad=True),
    )


def autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


PROGRAMS = [
    Program("mlp-sgd", mlp, classify, train=True, loss=cross_entropy, optimizer=sgd),
    Program("mlp-adamw", mlp, classify, train=True, loss=cross_entropy, optimizer=adamw),
    Program(
        "mlp-grad-accumulation",
        mlp,
        classify,
        variants=(0, 0, 1, 1),
        train=True,
        loss=cross_entropy,
        optimizer=sgd,
        accumulate=2,
    ),
    Program("cnn-batchnorm-train", SmallCNN, images, train=True, loss=cross_entropy, optimizer=sgd),
    Program(
        "cnn-batchnorm-frozen-stats", cnn_eval_batchnorm, images, train=True, loss=cross_entropy
    ),
    Program("cnn-groupnorm", lambda: SmallCNN("group"), images, train=True, loss=cross_entropy),
    Program(
        "cnn-instancenorm", lambda: SmallCNN("instance"), images, train=True, loss=cross_entropy
    ),
    Program(
        "batchnorm1d-train-then-eval",
        BatchNormMLP,
        classify,
        variants=(0, 0, 0),
        graphs=(1, 0, 1),  # eval mode is another graph
        between=switch_to_eval,
        train=True,
        loss=cross_entropy,
        optimizer=sgd,
    ),
    Program(
        "batchnorm-across-break",
        BatchNormBreak,
        classify,
        train=True,
        loss=cross_entropy,
        optimizer=sgd,
        graphs=2,
        breaks=(IO, IO),
        captures=4,
    ),
    Program("transformer-hand-attention", TransformerBlock, sequences, train=True, optimizer=sgd),
    Program(
        "transformer-sdpa-causal",
        lambda: TransformerBlock("sdpa"),
        sequences,
        train=True,
        optimizer=sgd,
    ),
    Program("sdpa-padding-mask", MaskedEncoder, padded_tokens, train=True),
    Program("torch-encoder-layer", TorchEncoder, with_padding, train=True),
    Program("multihead-attention", MHA, query_memory, train=True),
    Program("tiny-lm-tied-weights", TinyLM, lm_tokens, train=True, loss=lm_loss, optimizer=sgd),
    Program(
        "tiny-lm-hand-attention",
        lambda: TinyLM("hand"),
        lm_tokens,
        train=True,
        loss=lm_loss,
        slow=True,
    ),
    Program(
        "rnn",
        lambda: RecurrentClassifier("rnn"),
        time_series,
        train=True,
        loss=cross_entropy,
    ),
    Program(
        "lstm",
        lambda: RecurrentClassifier("lstm"),
        time_series,
        train=True,
        loss=cross_entropy,
    ),
    Program(
        "gru",
        lambda: RecurrentClassifier("gru"),
        time_series,
        train=True,
        loss=cross_entropy,
    ),
    Program("bilstm-tagger", BiLSTMTagger, tokens, train=True),
    Program("embedding-bag", BagOfWords, tokens, train=True),
    Program("text-cnn", TextCNN, tokens, train=True, optimizer=sgd),
    *(
        Program(f"loss-{loss}", lambda loss=loss: WithLoss(loss), loss_inputs(loss), train=True)
        for loss in LOSSES
    ),
    Program("l2-penalty-in-forward", L2Regularised, classify_in_forward, train=True, optimizer=sgd),
    Program(
        "autocast-bf16-mlp-fp32-bias",
        AutocastMLP,
        classify,
        train=True,
        loss=cross_entropy,
        context=autocast,
        **BF16,
    ),
    Program(
        "autocast-bf16-transformer-fp32-bias",
        AutocastBlock,
        sequences,
        train=True,
        context=autocast,
        **BF16,
    ),
    Program("autocast-bf16-function-fp32-bias", lambda: autocast_linear, x_w_b, train=True, **BF16),
    Program(
        "autocast-bf16-loss-in-forward",
        lambda: WithLoss("ce-ignore-smooth"),
        loss_inputs("ce-ignore-smooth"),
        train=True,
        context=autocast,
        **BF16,
    ),
    Program(
        "autocast-bf16-cnn-batchnorm",
        SmallCNN,
        images,
        train=True,
        loss=cross_entropy,
        context=autocast,
        **BF16,
    ),
    *(
        Program(
            f"compiled-train-step-{name}",
            train_step(name),
            classify_in_forward,
            graphs=2,
            # zero_grad and step read p.grad, which capture cannot re-read (reported as
            # DATA_DEPENDENT) and run natively, as does loss.backward(); then loss.item()
            breaks=(DATA, CALL, DATA, DATA),
            captures=5,
            xfail=Xfail(WrongCounters, APPEND_ITEM),
        )
        for name in ("sgd", "adamw")
    ),
    Program(
        "compiled-train-step-no-item",
        train_step("sgd", log=False),
        classify_in_forward,
        graphs=2,
        later_graphs=1,
        breaks=(CALL, CALL, CALL),  # zero_grad and step read p.grad; backward runs natively
        captures=4,
    ),
    Program(
        "compiled-optimizer-step",
        optimizer_step_only,
        lambda v: (torch.randn(4, 8),),
        variants=(0, 0, 0),
        between=new_gradients,
        breaks=(CALL,),  # opt.step() reads p.grad: it runs natively
        captures=2,
    ),
    Program(
        "gradient-assigned-in-program",
        gradient_assignment,
        parameter_grads,
        # p.grad = g runs natively (twice), then opt.step() reads p.grad natively; the
        # parameters fix the shapes, so the later variant reuses every entry
        graphs=1,
        later_graphs=0,
        breaks=(CALL, CALL, CALL),
        captures=4,
    ),
    Program("dropout-p0-train", lambda: DropoutOff(0.0), classify, train=True, loss=cross_entropy),
    Program("dropout-eval", dropout_eval, classify, train=True, loss=cross_entropy),
]


@pytest.mark.parametrize("program", params(PROGRAMS))
def test_training(program: Program) -> None:
    check_program(program)
