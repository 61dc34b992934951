"""The op table through the ``kiln`` backend's C++ code generator (on CPU tensors), against
every row's reference implementation."""

from __future__ import annotations

import pytest
import torch

from kiln.ir import Op
from tests.backends.op_table import ROW_IDS, ROWS, check_row


@pytest.mark.parametrize(("op", "dtype"), ROWS, ids=ROW_IDS)
def test_row(op: Op, dtype: torch.dtype) -> None:
    check_row(op, dtype, "cpp")


def test_a_large_program_builds_as_several_translation_units(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    """A program with many C++ kernels compiles as one translation unit per core, at once;
    the kernels run as from one unit: a training step's output and every gradient against
    eager, over calls with new values."""
    import kiln
    import kiln.backends.kernels as kernels
    from kiln.config import config
    from kiln.recording import recording
    from kiln.runtime.kernel_files import KernelFiles
    from tests.tiny_models import SmallResNet

    monkeypatch.setattr(kernels, "UNIT_KERNELS", 2)
    monkeypatch.setattr(kernels.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(config, "cache_dir", tmp_path)  # (a cold cache: every unit is built)
    torch.manual_seed(0)
    model = SmallResNet()
    compiled = kiln.compile(model, options={"codegen": "cpp", "strict": True})
    with recording(KernelFiles) as files:
        for _ in range(2):
            x = torch.randn(2, 3, 16, 16)
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            expected = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            out = compiled(x)
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
            out.square().mean().backward()
            for got, want in zip([p.grad for p in model.parameters()], expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    built = [f for f in files if f.kind == "cpp" and f.built]
    assert len(built) >= 4, files  # (forward and backward: three units each, or fewer kernels)
    assert len({f.paths[1] for f in built}) == len(built)
