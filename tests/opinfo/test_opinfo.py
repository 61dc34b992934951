"""PyTorch's OpInfo database through ``kiln.compile``: every op's first sample in CI, all of
them in the slow sweep.

The CI test runs each OpInfo's first float32 sample forward (inputs not requiring grad) and
backward (OpInfo's differentiable inputs requiring grad, one random cotangent per output), one
test per op so a failure is named. A mismatch or an error fails it. Two tables say what is
known today, and both are exact:

- ``KNOWN_FAILURES``: ops whose sample hits a Kiln bug, as strict xfails. Fixing the bug makes
  the test XPASS, which fails until the entry is removed.
- ``EXPECTED_DETOURS``: ops that match eager only through a graph break or a frame run
  uncompiled (or a graph on the reference interpreter). Not failures, but pinned: a new break
  or fallback, or one that went away, fails until the table is updated.

``python tests/opinfo/sweep.py`` runs the same samples from the command line (``--full`` for
every sample, dtype and in-place variant; see its docstring); ``--samples 1 --tables`` prints
both tables as they are today (the causes in KNOWN_FAILURES are then worth rewording by hand).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import sweep
from opinfo_samples import FAILING, Record, ops, run_task, tasks_for

# One sample per op keeps the suite at ~35 s (warm kernel cache) to ~110 s (cold) under
# ``pytest -n auto`` on two cores; the slow sweep runs all of them.
CI_SAMPLES = 1

# op key -> "<category>: <short cause>". Each is a Kiln bug; the sweep's report has details.
KNOWN_FAILURES: dict[str, str] = {}

# op key -> (category, reasons): the break or fallback each op's CI samples take today.
# reasons: the sorted BreakReason / SkipReason names (INTERPRETER: a graph ran on the
# reference interpreter), joined by ", ".
EXPECTED_DETOURS: dict[str, tuple[str, str]] = {
    "item": ("break", "DATA_DEPENDENT"),
    "cauchy": ("break", "UNSUPPORTED_CALL"),
    "exponential": ("break", "UNSUPPORTED_CALL"),
    "geometric": ("break", "UNSUPPORTED_CALL"),
    "log_normal": ("break", "UNSUPPORTED_CALL"),
    "normal.in_place": ("break", "UNSUPPORTED_CALL"),
    "uniform": ("break", "UNSUPPORTED_CALL"),
    "allclose": ("break", "DATA_DEPENDENT"),
    "combinations": ("break", "DATA_DEPENDENT"),
    "corrcoef": ("break", "DATA_DEPENDENT"),
    "cov": ("break", "DATA_DEPENDENT"),
    "equal": ("break", "DATA_DEPENDENT"),
    "sparse.sampled_addmm": ("break", "UNSUPPORTED_CALL"),
    "sparse.mm.reduce": ("break", "UNSUPPORTED_CALL"),
    "masked_select": ("break", "DATA_DEPENDENT"),
    "tensor_split": ("break", "UNSUPPORTED_CALL"),
    "unique": ("break", "DATA_DEPENDENT"),
    "unique_consecutive": ("break", "DATA_DEPENDENT"),
    "resize_": ("break", "UNSUPPORTED_CALL"),
    "resize_as_": ("break", "UNSUPPORTED_CALL"),
    "to_sparse": ("break", "UNSUPPORTED_CALL"),
    "nonzero": ("break", "DATA_DEPENDENT"),
    "argwhere": ("break", "DATA_DEPENDENT"),
    "nn.functional.ctc_loss": ("break", "DATA_DEPENDENT"),
    "nn.functional.gaussian_nll_loss": ("break", "DATA_DEPENDENT"),
    "linalg.lstsq": ("break", "DATA_DEPENDENT"),
    "linalg.lstsq.grad_oriented": ("break", "DATA_DEPENDENT"),
}


def _params() -> list[Any]:
    """One parameter per op, named by its key, strict-xfail where KNOWN_FAILURES says so."""
    params = []
    for key in ops():
        marks = []
        if key in KNOWN_FAILURES:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[key]))
        params.append(pytest.param(key, marks=marks, id=key))
    return params


def detour(records: list[Record]) -> tuple[str, str] | None:
    """The op's worst detour (fallback before break) and its reason names, or None."""
    for category in ("fallback", "break"):
        mine = [r for r in records if r.category == category]
        if mine:
            names = sorted({reason.split(":")[0] for r in mine for reason in r.reasons})
            return category, ", ".join(names)
    return None


def _summary(record: Record) -> str:
    return (
        f"{record.dtype} {record.phase} sample {record.sample} ({record.args}): "
        f"{record.category}: {record.detail}"
    )


@pytest.mark.parametrize("key", _params())
def test_opinfo_sample(key: str) -> None:
    records = [r for task in tasks_for(key, False, CI_SAMPLES) for r in run_task(task)]
    failures = [r for r in records if r.category in FAILING]
    assert not failures, "\n".join(_summary(r) for r in failures)
    expected = EXPECTED_DETOURS.get(key)
    observed = detour(records)
    assert observed == expected, (
        f"{key}: detour {observed}, EXPECTED_DETOURS says {expected}\n"
        + "\n".join(f"{_summary(r)} {r.reasons}" for r in records if r.reasons)
    )


@pytest.mark.slow
def test_full_sweep(tmp_path: pathlib.Path) -> None:
    """Every sample of every op, dtype and in-place variant (25-75 minutes on two cores): no
    mismatch. The report is written next to the test's temporary files."""
    records: list[Record] = []
    tasks = [task for key in ops() for task in tasks_for(key, True, None)]
    sweep.run_pool(tasks, jobs=2, timeout=300, on_record=records.append)
    report = tmp_path / "opinfo.md"
    report.write_text(sweep.markdown(records))
    mismatches = [r for r in records if r.category == "mismatch"]
    assert not mismatches, f"{len(mismatches)} mismatches (report: {report}):\n" + "\n".join(
        f"{r.key} {r.form} {_summary(r)}" for r in mismatches[:200]
    )
