"""Training steps of tiny random-weight transformers (``zoo_models.py``), compiled against eager.

Each test deep-copies one model for eager and for ``kiln.compile``, runs SGD steps on fresh
random batches (the last at a second sequence length, image side or audio length) and compares,
every step, each output tensor, the ``.grad`` of every parameter (None where eager's is None)
and every updated parameter: float32 within rtol=atol=1e-4; under bfloat16 autocast (a few
rows) within bfloat16's precision of eager or no further than eager from a float64 run. No frame
may run uncompiled, and the graphs and graph breaks an architecture makes are pinned in its row,
so a new break fails the test.

A row that fails because of a Kiln bug carries ``xfail`` (strict) with the cause: the fix turns
it into an XPASS failure until the mark is removed (its counts are those of a run past the
failure, which the fix may change). The rows' counts are for transformers 5.24;
``breaks`` maps ``REASON: detail`` to how many break records it made (one per frame the break
cut, for each size).
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from zoo_models import ZOO, output_tensors

import kiln

pytest.importorskip("transformers")

# wav2vec2 and hubert (CTC heads): a label check and the CTC loss's masked_select and
# ctc_loss depend on data; the feature encoder sets requires_grad on a tensor, which only
# eager autograd can do.
CTC_BREAKS = {
    "DATA_DEPENDENT: data-dependent control flow: __bool__": 6,
    "UNSUPPORTED_CALL: setting tensor attribute 'requires_grad'": 10,
    "DATA_DEPENDENT: data-dependent result: the result of aten.masked_select.default depends on "
    "tensor data": 4,
    "DATA_DEPENDENT: data-dependent result: the result of aten._ctc_loss.Tensor depends on "
    "tensor data": 2,
}


# CI trains on the CPU; on a GPU machine, KILN_TEST_DEVICE=cuda trains through Triton kernels.
DEVICE = torch.device(os.environ.get("KILN_TEST_DEVICE", "cpu"))


@dataclass(frozen=True)
class Row:
    """What compiling one architecture makes over its steps: graphs compiled (those for the
    second size included) and break records by ``REASON: detail``; and how the test is run."""

    graphs: int
    breaks: dict[str, int] = field(default_factory=dict)
    xfail: str = ""  # the Kiln bug that makes it fail today
    slow: bool = False


# The default run keeps 1-5 architectures of each family: about 65 s of CPU with a cold kernel
# cache, 50 s with a warm one (under 3 minutes on 2 busy cores); the rows marked slow cost more
# or repeat what default rows cover (rotary, GQA, learned positions, relative position bias).
# fmt: off
TRAINING: dict[str, Row] = {
    # decoders
    "gpt2": Row(2),
    "gpt_neo": Row(2),
    "gptj": Row(2, slow=True),
    "opt": Row(2, slow=True),
    "bloom": Row(2),
    "gpt_neox": Row(2, slow=True),
    "falcon": Row(2, slow=True),
    "llama": Row(2),
    "mistral": Row(2, slow=True),
    "qwen2": Row(2, slow=True),
    "qwen3": Row(2, slow=True),
    "gemma": Row(2, slow=True),
    "gemma2": Row(2, slow=True),
    "phi": Row(2),
    # encoders
    "bert": Row(2),
    "roberta": Row(2, slow=True),
    "distilbert": Row(2),
    "albert": Row(2, slow=True),
    "electra": Row(2, slow=True),
    "deberta": Row(2),
    "deberta_v2": Row(2, slow=True),
    "mpnet": Row(2),
    # encoder-decoders
    "t5": Row(2),
    "bart": Row(2, slow=True),
    "marian": Row(2, slow=True),
    "pegasus": Row(2, slow=True),
    # vision
    "vit": Row(3),
    "deit": Row(3, slow=True),
    "beit": Row(3, slow=True),
    "swin": Row(3, slow=True),
    "convnext": Row(3),
    "clip": Row(2, slow=True),
    # speech
    "whisper": Row(2),
    "speech2text": Row(2),
    "wav2vec2": Row(14, CTC_BREAKS, slow=True),
    "hubert": Row(14, CTC_BREAKS, slow=True),
}

# Under torch.autocast("cpu", dtype=torch.bfloat16).
AUTOCAST: dict[str, Row] = {
    "t5": Row(2, slow=True),
    "bart": Row(2, slow=True),
    "llama": Row(2),
    "bert": Row(2, slow=True),
    "vit": Row(3, slow=True),
    "whisper": Row(2, slow=True),
}
# fmt: on

# bfloat16 keeps 8 bits of mantissa: a tensor passes when its distance to eager's is within
# BF16_RTOL of eager's norm, or when it is no further from a float64 run than BF16_AS_ACCURATE
# times eager's distance (two eager attention implementations differ by up to 2.5x in that).
BF16_RTOL = 3e-2
BF16_AS_ACCURATE = 3.0


def _params(table: dict[str, Row]) -> list[Any]:
    params = []
    for name, row in table.items():
        marks: list[Any] = [pytest.mark.slow] if row.slow else []
        if row.xfail:
            marks.append(pytest.mark.xfail(strict=True, reason=row.xfail))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


# A check compares kiln's tensor with eager's (and float64 eager's under autocast), all as
# float64: None when they agree, else more detail for the mismatch's line ("" for none).
Check = Callable[[torch.Tensor, torch.Tensor, Any], str | None]
Rows = list[tuple[str, Any, Any, Any]]  # name, kiln's, eager's, float64 eager's or None


def _float32_mismatch(got: torch.Tensor, want: torch.Tensor, exact: None) -> str | None:
    return None if torch.allclose(got, want, rtol=1e-4, atol=1e-4, equal_nan=True) else ""


def _bf16_mismatch(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor) -> str | None:
    if float((got - want).norm()) <= BF16_RTOL * float(want.norm()):
        return None
    ours, theirs = (float((t - exact).norm()) for t in (got, want))
    if ours <= BF16_AS_ACCURATE * theirs:
        return None
    relative = float((got - want).norm() / want.norm())
    return f"; |diff|/|eager| {relative:.3g}; against float64: kiln {ours:.3g}, eager {theirs:.3g}"


def _compare(label: str, rows: Rows, check: Check) -> None:
    """Checks every row and reports all mismatches at once (the list is a work queue)."""
    problems = []
    for name, got, want, exact in rows:
        if got is None or want is None:
            if (got is None) != (want is None):
                problems.append(f"{name}: kiln {_describe(got)}, eager {_describe(want)}")
            continue
        if got.shape != want.shape or got.dtype != want.dtype:
            problems.append(f"{name}: kiln {_describe(got)}, eager {_describe(want)}")
            continue
        got, want = got.detach().double(), want.detach().double()
        more = check(got, want, None if exact is None else exact.detach().double())
        if more is not None:
            difference = (got - want).abs().nan_to_num(nan=float("inf")).max()
            scale = want.abs().max()
            problems.append(f"{name}: max |diff| {difference:.3g} (max |eager| {scale:.3g}){more}")
    assert not problems, f"{label}: {len(problems)} differ\n" + "\n".join(problems)


def _describe(tensor: torch.Tensor | None) -> str:
    return "None" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"


def _output_rows(outputs: list[Any]) -> Rows:
    """Outputs are [eager's, kiln's] or [eager's, kiln's, float64 eager's]."""
    eager, mine, *exact = (dict(output_tensors(output)) for output in outputs)
    assert mine.keys() == eager.keys(), f"outputs {list(mine)} != eager's {list(eager)}"
    return [
        (path, mine[path], want, exact[0][path] if exact else None) for path, want in eager.items()
    ]


def _parameter_rows(models: list[nn.Module], grads: bool) -> Rows:
    """Parameters (or their gradients) of models ordered as ``_output_rows``' outputs."""
    pick: Callable[[Any], Any] = (lambda p: p.grad) if grads else (lambda p: p)
    rows = []
    for (name, want), mine, *exact in zip(
        models[0].named_parameters(), *(m.parameters() for m in models[1:]), strict=True
    ):
        rows.append((name, pick(mine), pick(want), pick(exact[0]) if exact else None))
    return rows


# The transformers release the rows' counts were taken with: another release's models make
# other graphs and breaks (5.17 draws torch.rand([]) for LayerDrop inside Whisper's layer loop),
# so there the counts are not compared, and a frame may run routed for a break in a loop, but
# never uncompiled for a Kiln error.
PINNED_TRANSFORMERS = "5.24"


def _check_counts(row: Row) -> None:
    import transformers

    if not transformers.__version__.startswith(PINNED_TRANSFORMERS + "."):
        failures = [
            str(record)
            for record in kiln.counters.fallbacks
            if record.reason.name in ("INTERNAL_ERROR", "UNRECONSTRUCTIBLE", "BACKEND_ERROR")
        ]
        assert failures == [], "frames ran uncompiled:\n" + "\n".join(failures)
        return
    fallbacks = [str(record) for record in kiln.counters.fallbacks]
    assert fallbacks == [], "frames ran uncompiled:\n" + "\n".join(fallbacks)
    records = kiln.counters.graph_breaks
    breaks = dict(Counter(f"{r.reason.name}: {r.detail}" for r in records))
    made = (kiln.counters.graphs, breaks)
    assert made == (row.graphs, row.breaks), f"made {made}\n" + "\n".join(map(str, records))


def _train(name: str, row: Row, autocast: bool) -> None:
    """Steps at the first size twice, then once at the second; under autocast a float64 copy
    runs too and every step starts from eager's parameters (so rounding does not compound)."""
    zoo = ZOO[name]
    kiln.reset()
    eager = zoo.build().train().to(DEVICE)
    models = [eager, copy.deepcopy(eager)] + ([copy.deepcopy(eager).double()] if autocast else [])
    runners = [eager, kiln.compile(models[1]), *models[2:]]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]
    check = _bf16_mismatch if autocast else _float32_mismatch
    for step, size in enumerate([zoo.sizes[0], *zoo.sizes]):
        batch = {k: _on_device(v) for k, v in zoo.batch(size).items()}
        outputs = []
        for index, (runner, optimizer) in enumerate(zip(runners, optimizers, strict=True)):
            optimizer.zero_grad(set_to_none=True)
            if index == 2:
                output = runner(**{k: _double(v) for k, v in batch.items()})
            else:
                with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
                    output = runner(**batch)
            output.loss.backward()
            outputs.append(output)
        label = f"step {step} (size {size})"
        _compare(f"{label} outputs", _output_rows(outputs), check)
        _compare(f"{label} gradients", _parameter_rows(models, grads=True), check)
        for optimizer in optimizers:
            optimizer.step()
        _compare(f"{label} parameters", _parameter_rows(models, grads=False), check)
        if autocast:
            with torch.no_grad():
                for want, *others in zip(*(m.parameters() for m in models), strict=True):
                    for other in others:
                        other.copy_(want)
    _check_counts(row)


def _on_device(value: Any) -> Any:
    return value.to(DEVICE) if isinstance(value, torch.Tensor) else value


def _double(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    return value


@pytest.mark.parametrize("name", _params(TRAINING))
def test_training_matches_eager(name: str) -> None:
    _train(name, TRAINING[name], autocast=False)


@pytest.mark.parametrize("name", _params(AUTOCAST))
def test_bfloat16_autocast_training_matches_eager(name: str) -> None:
    _train(name, AUTOCAST[name], autocast=True)


def test_zoo_spans_the_families() -> None:
    families = Counter(ZOO[name].family for name in TRAINING)
    assert set(TRAINING) == set(ZOO)
    assert families["decoder"] >= 8 and families["encoder"] >= 5, families
    assert families["encoder-decoder"] >= 3, families
    assert families["vision"] >= 2 and families["speech"] >= 2, families
    assert sum(not row.slow for row in TRAINING.values()) >= 10
