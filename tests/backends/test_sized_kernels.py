"""Programs in symbolic sizes: one compiled program (kernels taking their sizes as arguments,
the host program computing sizes, grids and buffers at run time) serves every size that
satisfies what compiling decided on the sizes (``kiln/backends/kiln.py``).

Triton's code generator writes such kernels (on CPU tensors these tests run them in
Triton's interpreter; ``KILN_TEST_DEVICE=cuda`` runs them compiled), and so does the C++
one. Every test checks results (and gradients) against eager at every size, and counts
the programs compiled, so that a program reused where it does not hold, or one compiled per
size where one should serve all, fails."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.recording import recording
from kiln.schedule.loops import kernel_symbols

pytest.importorskip("triton")

DEVICE = torch.device(os.environ.get("KILN_TEST_DEVICE", "cpu"))
TRITON = {"codegen": "triton"} if DEVICE.type == "cpu" else {}


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE)


def _run(
    fn: Callable[..., Any], inputs: Callable[[int], tuple[torch.Tensor, ...]], sizes: list[int]
) -> list[CompiledProgramRecord]:
    """``fn`` compiled with ``dynamic=True``, called at each of ``sizes`` against eager; the
    programs it compiled."""
    kiln.reset()
    compiled = kiln.compile(fn, dynamic=True, options={"strict": True, **TRITON})
    with recording(CompiledProgramRecord) as records:
        for n in sizes:
            values = inputs(n)
            expected = fn(*values)
            torch.testing.assert_close(
                compiled(*values), expected, msg=lambda m, n=n: f"size {n}: {m}"
            )
    assert kiln.counters.captures == 1
    assert all(r.program is not None for r in records), [r.fallback for r in records]
    return records


def _sized(record: CompiledProgramRecord) -> bool:
    """Whether the program is written in symbolic sizes (kernels take ``size_s*``)."""
    return record.sizes.startswith("any sizes")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(self.norm(x)))
        return x + self.down(h).softmax(-1) * h.sum(-1, keepdim=True)


def test_one_program_serves_a_range_of_batch_sizes() -> None:
    """Pointwise, persistent-reduction and extern steps with a symbolic row count: sizes in
    one block bucket share a program (0 for a bucket already compiled)."""
    torch.manual_seed(0)
    block = Block().to(DEVICE).eval()
    sizes = [300, 301, 303, 260, 511, 7, 5, 6, 300]
    with torch.no_grad():
        records = _run(block, lambda n: (_randn(n, 32),), sizes)
    assert all(_sized(r) for r in records), [r.sizes for r in records]
    # 260-511 rows share a bucket, as do 5-7: two programs (a third at most, on a GPU,
    # where the blocks of 5-7 rows and 260-511 rows may fall in other buckets)
    assert 2 <= len(records) <= 3, [r.sizes for r in records]


def test_a_growing_cache_needs_one_program_per_bucket() -> None:
    """A key-value cache grown by ``cat`` and attention scores over it (a softmax whose row
    length is the cache's): the decode step of text generation."""

    def step(cache: torch.Tensor, new: torch.Tensor, q: torch.Tensor) -> Any:
        keys = torch.cat([cache, new], dim=2)
        scores = (q @ keys.transpose(-1, -2)) * 0.125
        return keys, scores.softmax(-1) @ keys

    torch.manual_seed(0)
    lengths = list(range(17, 31))  # one bucket of row lengths: (16, 32]
    with torch.no_grad():
        records = _run(
            step,
            lambda t: (_randn(2, 4, t, 16), _randn(2, 4, 1, 16), _randn(2, 4, 1, 16)),
            lengths,
        )
    assert len(records) == 1 and _sized(records[0]), [r.sizes for r in records]


def test_training_serves_a_range_of_batch_sizes() -> None:
    """Forward and backward programs in symbolic sizes: every parameter's gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 8))
    model = model.to(DEVICE)
    reference = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 8))
    reference = reference.to(DEVICE)
    reference.load_state_dict(model.state_dict())
    kiln.reset()
    compiled = kiln.compile(model, dynamic=True, options={"strict": True, **TRITON})
    with recording(CompiledProgramRecord) as records:
        for n in [40, 47, 33, 63, 40]:
            x = _randn(n, 16)
            out = compiled(x)
            out.square().mean().backward()
            expected = reference(x)
            expected.square().mean().backward()
            torch.testing.assert_close(out, expected)
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"{n}: {m}")
            model.zero_grad()
            reference.zero_grad()
    assert all(_sized(r) for r in records), [r.sizes for r in records]
    assert len(records) == 2, [r.graph for r in records]  # one forward, one backward


@pytest.mark.parametrize("n", [7, 8191 * 3, 1000003])
def test_odd_sizes(n: int) -> None:
    """Sizes no block divides: every lane past the end is masked."""
    torch.manual_seed(0)
    records = _run(
        lambda x, y: (x * y + 1).relu().sum(-1),
        lambda m: (_randn(2, m), _randn(2, m)),
        [n, n + 2],
    )
    assert all(_sized(r) for r in records)


def test_layouts_key_the_programs() -> None:
    """The same sizes in another dim order compile another program, never reuse one."""
    torch.manual_seed(0)
    kiln.reset()
    compiled = kiln.compile(lambda x: x * 2 + 1, dynamic=True, options={"strict": True, **TRITON})
    with recording(CompiledProgramRecord) as records:
        for n in [5, 6]:
            for x in (_randn(n, 9), _randn(9, n).t()):
                torch.testing.assert_close(compiled(x), x * 2 + 1)
                assert compiled(x).stride() == (x * 2 + 1).stride()
    assert len(records) == 2, [r.sizes for r in records]


def test_a_program_that_cannot_be_sized_is_compiled_per_size(monkeypatch: Any) -> None:
    """When the kernels cannot be written in symbolic sizes, the program is compiled for
    the call's sizes alone, says so, and later sizes compile again: never a wrong result."""
    import kiln.backends.kernels as kernels

    original = kernels.generate_triton

    def refuse(kernel: Any, interpret: bool, **options: Any) -> Any:
        if kernels.kernel_symbols(kernel):
            raise NotImplementedError("no sized kernels here")
        return original(kernel, interpret, **options)

    monkeypatch.setattr(kernels, "generate_triton", refuse)
    torch.manual_seed(0)
    records = _run(lambda x: x.softmax(-1), lambda n: (_randn(n, 10),), [5, 6, 5])
    expected = ["sizes s0=5, s1=10 only", "sizes s0=6, s1=10 only"]
    assert [r.sizes.split(" (")[0] for r in records] == expected
    assert "no sized kernels here" in records[0].sizes


@pytest.mark.skipif(DEVICE.type != "cpu", reason="C++ kernels run on CPU tensors")
def test_cpp_kernels_serve_many_sizes() -> None:
    """C++ kernels take their sizes as arguments too (loop bounds, rows, parallel chunks)."""
    torch.manual_seed(0)
    block = Block().eval()
    kiln.reset()
    compiled = kiln.compile(block, dynamic=True, options={"strict": True})
    with recording(CompiledProgramRecord) as records, torch.no_grad():
        for n in [17, 20, 33, 100, 17]:  # (under 16 rows, reductions take another form)
            x = torch.randn(n, 32)
            torch.testing.assert_close(compiled(x), block(x))
    assert [r.codegen for r in records] == ["cpp"], [r.sizes for r in records]
    assert _sized(records[0]), records[0].sizes
    assert records[0].program is not None
    assert any(kernel_symbols(k) for k in records[0].program.kernels())


def test_explain_says_which_sizes_a_program_serves() -> None:
    kiln.reset()
    compiled = kiln.compile(lambda x: x.relu(), dynamic=True, options=TRITON)
    text = str(kiln.explain(compiled, _randn(5, 3)))
    assert "compiled for any sizes" in text, text


def test_sizes_served_often_get_their_own_programs(monkeypatch: Any) -> None:
    """A size a program in symbolic sizes serves ``HOT_CALLS`` times is compiled on its own
    (constant sizes run faster), for at most ``HOT_SIZES`` sizes: a training loop's batch
    after its last smaller one, not every length of text generation."""
    import kiln.backends.kiln as backend

    monkeypatch.setattr(backend, "HOT_CALLS", 3)
    monkeypatch.setattr(backend, "HOT_SIZES", 2)
    torch.manual_seed(0)
    kiln.reset()
    compiled = kiln.compile(lambda x: x.softmax(-1), dynamic=True, options=TRITON)
    with recording(CompiledProgramRecord) as records:
        for n in [5, 6, 7]:
            for _ in range(5):
                x = _randn(n, 10)
                torch.testing.assert_close(compiled(x), x.softmax(-1))
    notes = [r.sizes.split(" (")[0] for r in records]
    assert notes[0].startswith("any sizes"), notes
    assert notes[1:] == ["sizes s0=5, s1=10 only", "sizes s0=6, s1=10 only"], notes


def test_memos_by_size_stay_bounded(monkeypatch: Any) -> None:
    """Memos keyed by sizes start over past ``SIZE_MEMO`` entries: results stay right and
    nothing compiles again (the programs are found again by their relations)."""
    import kiln.ir.symbolic as symbolic

    monkeypatch.setattr(symbolic, "SIZE_MEMO", 2)
    torch.manual_seed(0)
    block = Block().to(DEVICE).eval()
    sizes = [300, 301, 302, 303, 304, 300, 305, 301]
    with torch.no_grad():
        records = _run(block, lambda n: (_randn(n, 32),), sizes)
    assert len(records) == 1 and _sized(records[0]), [r.sizes for r in records]


def test_a_broadcast_gradient_keeps_the_backward_sized() -> None:
    """``compiled(x).sum().backward()`` hands the backward its gradient as one value
    expanded (all strides 0): that input's layout is a pattern too (its broadcast dims), not
    a reason to compile the backward per size. Every gradient matches eager's."""
    torch.manual_seed(0)
    weight = _randn(16, 16).requires_grad_(True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight) * x

    kiln.reset()
    compiled = kiln.compile(fn, dynamic=True, options={"strict": True, **TRITON})
    with recording(CompiledProgramRecord) as records:
        for n in (9, 12, 15):  # (one power-of-two bucket of Triton's blocks: 129..256)
            x = _randn(n, 16).requires_grad_(True)
            compiled(x).sum().backward()
            got = (x.grad, weight.grad)
            x.grad = weight.grad = None
            fn(x).sum().backward()
            for a, b in zip(got, (x.grad, weight.grad), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            x.grad = weight.grad = None
    backwards = [r for r in records if r.graph.endswith("_backward")]
    assert len(backwards) == 1 and _sized(backwards[0]), [r.sizes for r in backwards]
