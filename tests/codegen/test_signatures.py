"""Kernel deduplication: kernels equal but for their names build once; any other difference
(a dtype, an index check, a shape) keeps them apart."""

from __future__ import annotations

from typing import Any

import torch

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.codegen.signatures import deduplicate, kernel_signature
from kiln.recording import recording


def _kernels(fn: Any, *args: torch.Tensor) -> list:
    """The kernels ``fn`` compiles to (its result checked against eager's)."""
    kiln.reset()
    with recording(CompiledProgramRecord) as records:
        result = kiln.compile(fn, options={"codegen": "cpp", "strict": True})(*args)
    kiln.reset()
    torch.testing.assert_close(result, fn(*args))
    return [k for record in records for k in record.program.kernels()]


def _block() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.LayerNorm(24), torch.nn.GELU())


def test_repeated_blocks_build_once() -> None:
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[_block() for _ in range(4)]).eval()
    with torch.no_grad():
        kernels = _kernels(blocks, torch.randn(5, 24))
    unique, same_as = deduplicate(kernels)
    assert len(kernels) == 4 and len(unique) == 1, [k.name for k in kernels]
    assert set(same_as.values()) == {unique[0].name}
    assert kernels[0].name not in kernel_signature(kernels[0])


def test_a_dtype_or_shape_keeps_kernels_apart() -> None:
    def program(a: torch.Tensor) -> torch.Tensor:
        return a.exp().sum(-1)

    inputs = [torch.randn(3, 8), torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 9)]
    signatures = [kernel_signature(k) for x in inputs for k in _kernels(program, x)]
    assert len(signatures) == 3 and len(set(signatures)) == 3
    again = [kernel_signature(k) for k in _kernels(program, torch.randn(3, 8))]
    assert again == signatures[:1]  # the same kernel, compiled again: the same signature
