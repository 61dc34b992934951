"""Scheduled programs on disk (kiln/backends/programs.py): a second compile of the same graph
for the same input layouts reads the program and its generated code instead of scheduling and
generating, runs it bound to its own graph (new weights, fresh inputs, every gradient equal to
eager's) with the same buffer plan; another layout schedules anew."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import kiln
from kiln.backends import kernels as backend_kernels
from kiln.backends.kiln import CompiledProgramRecord
from kiln.codegen import cpp
from kiln.codegen.wrapper import Wrapper
from kiln.config import config
from kiln.recording import recording


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(config, "artifact_cache", True)
    kiln.reset()
    yield tmp_path / "artifacts"
    kiln.reset()


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 36, 5),
    )


def _programs(events: list) -> list[str]:
    """Each compiled program as its host source (buffer plan included) and kernels."""
    texts = []
    for record in events:
        if isinstance(record, CompiledProgramRecord) and record.program is not None:
            wrapper = Wrapper(record.program, {k.name: print for k in record.program.kernels()})
            texts.append(wrapper.source())
    return texts


def test_a_second_compile_reads_the_programs(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = _model()
    reference = copy.deepcopy(model)
    with recording(CompiledProgramRecord) as first:
        loss = kiln.compile(model)(torch.randn(2, 3, 6, 6)).square().sum()
        loss.backward()
    assert kiln.counters.programs_reused == 0 and len(first) >= 2  # forward and backward
    assert len(list(cache.glob("p-*.kart"))) == len(first)
    assert len(list(cache.glob("g-*.kart"))) == len(first)  # their generated code
    kiln.reset()

    def unexpected(*args: object, **kwargs: object) -> None:
        raise AssertionError("generated again: the stored code was not used")

    monkeypatch.setattr(backend_kernels, "deduplicate", unexpected)
    monkeypatch.setattr(cpp, "generate_cpp", unexpected)
    for module in (model, reference):  # other weights than the stored programs saw
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.mul_(-0.5).add_(0.1)
        module.zero_grad()
    x = torch.randn(2, 3, 6, 6)
    with recording(CompiledProgramRecord) as second:
        out = kiln.compile(model)(x)
        out.square().sum().backward()
    assert kiln.counters.programs_reused == len(first)
    expected = reference(x)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    pairs = zip(model.named_parameters(), reference.named_parameters(), strict=True)
    for (name, a), (_, b) in pairs:  # (the conv's bias gradient is zero up to rounding: BN)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=name)
    assert _programs(second) == _programs(first)  # the same steps and buffer plan


def test_another_layout_schedules_again(cache: Path) -> None:
    model = _model().eval()
    with torch.no_grad():
        kiln.compile(model)(torch.randn(2, 3, 6, 6))
        kiln.reset()
        x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
        torch.testing.assert_close(kiln.compile(model)(x), model(x))
    assert kiln.counters.programs_reused == 0


def test_a_program_in_symbolic_sizes_is_read_back_for_other_sizes(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program compiled for a range of sizes (``dynamic=True``) is kept with the relations
    it holds for: a later process (``kiln.reset()``) meeting other sizes in that range reads
    it, rehinted by its own sizes, instead of scheduling, forward and backward, and every
    result and gradient equals eager's; sizes whose relations fail schedule anew."""
    from kiln.backends import kiln as backend

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))
    reference = copy.deepcopy(model)

    def step(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = module(x)
        out.square().sum().backward()
        return out

    step(kiln.compile(model, dynamic=True), torch.randn(5, 6))
    assert kiln.counters.programs_reused == 0
    assert len(list(cache.glob("s-*.kart"))) == 2  # forward and backward
    kiln.reset()
    scheduled: list[str] = []
    original = backend.schedule

    def counting(graph: Any, *args: Any) -> Any:
        scheduled.append(graph.name)
        return original(graph, *args)

    monkeypatch.setattr(backend, "schedule", counting)
    compiled = kiln.compile(model, dynamic=True)
    for batch in (7, 11, 100):  # (100: past the forward's "16*s0 <= 1024", CPU)
        if batch == 100:
            assert scheduled == [] and kiln.counters.programs_reused == 2, scheduled
        model.zero_grad()
        reference.zero_grad()
        x = torch.randn(batch, 6)
        torch.testing.assert_close(step(compiled, x), step(reference, x))
        for (name, a), (_, b) in zip(
            model.named_parameters(), reference.named_parameters(), strict=True
        ):
            torch.testing.assert_close(a.grad, b.grad, msg=name)
    assert len(scheduled) == 2 and kiln.counters.programs_reused == 2, scheduled


def test_a_constant_is_keyed_by_the_storage_it_views_hashed_once() -> None:
    """A program's key hashes each tensor constant's viewed stretch of storage: an expanded
    constant (DeBERTa's relative positions, [12, 512, 512] over one [512, 512]) is hashed at
    its storage's size, once however many constants view it; a changed value inside the
    view changes the key."""
    from kiln.backends.programs import _span_digest

    base = torch.arange(16, dtype=torch.int64).reshape(4, 4)
    digests: dict = {}
    expanded = [base.expand(3, 4, 4) for _ in range(5)]
    first = _span_digest(expanded[0], digests)
    assert all(_span_digest(view, digests) == first for view in expanded)
    assert len(digests) == 1  # (one stretch of one storage, hashed once)
    assert _span_digest(base.clone().expand(3, 4, 4), {}) == first  # (equal bytes elsewhere)
    changed = base.clone()
    changed[2, 3] = -1
    assert _span_digest(changed.expand(3, 4, 4), {}) != first
    column = base[:, 1]
    other = base.clone()
    other[3, 1] = 99
    assert _span_digest(column, {}) != _span_digest(other[:, 1], {})
    assert _span_digest(torch.tensor(1.5, dtype=torch.bfloat16), {}) == _span_digest(
        torch.tensor([0.0, 1.5], dtype=torch.bfloat16)[1], {}
    )
    assert _span_digest(torch.ones(3, 0), {}) == ""
