"""``torch.compile(backend="kiln")`` on the transformer zoo (``zoo_models.py``): a training
step at each of a row's sizes, the loss, every output and every parameter's ``.grad`` against
eager; Kiln compiled every graph Dynamo captured (no eager fallback)."""

from __future__ import annotations

import copy

import pytest
import torch
from zoo_models import ZOO, output_tensors

import kiln
import kiln.dynamo
from kiln.backends.kiln import CompiledProgramRecord
from kiln.recording import recording

pytest.importorskip("transformers")
kiln.dynamo.register()

FAST = ["llama", "bert"]
SLOW = ["gpt2", "t5", "vit"]


@pytest.mark.parametrize(
    "name", FAST + [pytest.param(name, marks=pytest.mark.slow) for name in SLOW]
)
def test_training_steps_match_eager(name: str) -> None:
    row = ZOO[name]
    torch.manual_seed(0)
    model = row.build().train()
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    kiln.reset()
    compiled = torch.compile(model, backend="kiln")
    with recording(CompiledProgramRecord) as programs:
        for size in row.sizes:
            batch = row.batch(size)
            actual, expected = compiled(**batch), reference(**batch)
            for (path, got), (_, want) in zip(
                output_tensors(actual), output_tensors(expected), strict=True
            ):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=path)
            actual.loss.backward()
            expected.loss.backward()
            for (key, parameter), twin in zip(
                model.named_parameters(), reference.parameters(), strict=True
            ):
                assert (parameter.grad is None) == (twin.grad is None), key
                if twin.grad is not None:
                    torch.testing.assert_close(
                        parameter.grad, twin.grad, rtol=1e-4, atol=1e-4, msg=key
                    )
            model.zero_grad()
            reference.zero_grad()
    assert kiln.counters.dynamo_graphs >= len(row.sizes) and not kiln.counters.dynamo_fallbacks
    assert programs and not [p for p in programs if p.fallback]
    torch._dynamo.reset()
