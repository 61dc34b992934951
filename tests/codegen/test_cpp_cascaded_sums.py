"""Long float sums in C++ kernels add chunks of ``SUM_CHUNK`` elements into partials, then
the partials (``kiln/codegen/cpp_reductions.py``): the rounding error grows with the chunk,
not with the row. A BatchNorm over a symbolic batch (whose reductions ``reduction_split``
leaves whole) ran ten times farther from float64 than eager with one running sum per row.

Each case compares Kiln's float32 result and eager's with float64 on the same inputs, with
values offset from zero (where a running sum loses most); row and column kernels, static and
symbolic sizes, and a kernel that hoists a row's values out of its chunked loop."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.config import config
from kiln.recording import recording


@pytest.fixture(autouse=True)
def debug_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(config, "debug_dir", str(tmp_path))  # (the kernels' sources land here)
    return tmp_path


def _errors(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dynamic: bool) -> tuple:
    reference = fn(x.double())
    eager = (fn(x).double() - reference).abs().max().item()
    kiln.reset()
    compiled = kiln.compile(fn, dynamic=dynamic, options={"codegen": "cpp", "strict": True})
    with recording(CompiledProgramRecord) as records:
        got = compiled(x)
    assert records and all(r.codegen == "cpp" for r in records)
    source = "".join(path.read_text() for path in Path(config.debug_dir).glob("*.cpp"))
    error = (got.double() - reference).abs().max().item()
    return error, eager, reference.abs().max().item(), source


CASES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], tuple[int, ...]]] = {
    "row": (lambda x: x.sum(-1), (4, 60001)),
    "column": (lambda x: x.sum(0), (60001, 24)),
    "mean_and_variance": (lambda x: torch.var_mean(x, dim=-1)[0], (3, 40000)),
    "batch_norm": (
        lambda x: torch.nn.functional.batch_norm(x, None, None, training=True),
        (16, 8, 40, 40),
    ),
}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_long_sums_are_as_accurate_as_eager(name: str, dynamic: bool) -> None:
    fn, shape = CASES[name]
    torch.manual_seed(0)
    x = torch.rand(shape) * 4 + 3  # (all positive: a running sum grows, and rounds, most)
    error, eager, scale, source = _errors(fn, x, dynamic)
    assert "part_acc" in source  # (the chunked form, not a reduction the pass split)
    # eager sums pairwise; one running sum of 60001 such values was off by about 3e-3
    assert error <= 4 * eager + 4e-7 * scale, (error, eager)


def test_short_rows_keep_one_loop() -> None:
    torch.manual_seed(0)
    x = torch.rand(8, 300)
    error, eager, scale, source = _errors(lambda x: x.sum(-1), x, False)
    assert "part_acc" not in source
    assert error <= 4 * eager + 4e-7 * scale
