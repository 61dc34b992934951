"""The results table: one aligned Markdown row per model x mode; failures are marked, not hidden."""

from __future__ import annotations

from kiln.bench.runner import Row
from kiln.bench.table import HEADERS, format_header, format_table
from kiln.bench.worker import Measurement


def _measured(compiler: str, ms: float, **fields: object) -> Measurement:
    base: dict[str, object] = dict(
        first_call_s=1.5, median_ms=ms, peak_mib=12.4, max_rel_error=1e-6
    )
    base.update(fields)
    return Measurement(compiler, **base)  # type: ignore[arg-type]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_row_cells_speedups_and_alignment() -> None:
    row = Row("tiny", "infer", 4, "a tiny model")
    row.measurements = {
        "eager": _measured("eager", 10.0, max_rel_error=0.0),
        "torch": _measured("torch", 5.0, first_call_s=20.25, reserved_mib=40.0),
        "torch warm": _measured("torch", None, warm_start=True, first_call_s=4.0),
        "kiln": _measured("kiln", 4.0, notes=["kiln: 1 graph(s), 0 break(s)"]),
        "kiln warm": _measured("kiln", None, warm_start=True, first_call_s=0.5),
    }
    text = format_table([row])
    lines = text.splitlines()
    assert len({len(line) for line in lines[:3]}) == 1  # header, rule and row aligned
    cells = dict(zip(HEADERS, _cells(lines[2]), strict=True))
    assert cells["eager ms"] == "10.0"
    assert cells["kiln vs eager"] == "2.50x"
    assert cells["kiln vs torch.compile"] == "1.25x"
    assert cells["first call s (eager / torch / kiln)"] == "1.50 / 20.2 / 1.50"
    assert cells["warm start s (torch / kiln)"] == "4.00 / 0.50"
    assert cells["peak MiB (eager / torch / kiln)"] == "12 / 12 / 12"
    assert cells["reserved MiB (eager / torch / kiln)"] == "— / 40 / —"
    assert cells["max rel err (torch / kiln)"] == "1.0e-06 / 1.0e-06"
    assert cells["check"] == "ok"
    assert "- tiny infer: kiln: 1 graph(s), 0 break(s)" in text


def test_failed_check_and_crash_mark_the_row() -> None:
    row = Row("tiny", "train", 2, "a tiny model")
    row.measurements = {
        "eager": _measured("eager", 10.0),
        "torch": _measured("torch", 5.0, max_rel_error=0.3, ok=False),
        "kiln": Measurement("kiln", ok=False, error="RuntimeError: boom"),
    }
    assert row.failed
    text = format_table([row])
    cells = dict(zip(HEADERS, _cells(text.splitlines()[2]), strict=True))
    assert cells["torch.compile ms"] == "5.00"  # a wrong result still shows its time
    assert cells["kiln ms"] == "error"
    assert cells["kiln vs eager"] == "—"
    assert cells["max rel err (torch / kiln)"] == "3.0e-01 ✗ / error"
    assert cells["check"] == "FAIL: torch wrong, kiln error"
    assert "- tiny train, kiln: RuntimeError: boom" in text


def test_skipped_row_and_header() -> None:
    row = Row("resnet50", "infer", 64, "ResNet-50", skipped="needs torchvision (not installed)")
    assert not row.failed
    cells = _cells(format_table([row]).splitlines()[2])
    assert cells[:3] == ["resnet50", "infer", "64"]
    assert cells[-1] == "skipped: needs torchvision (not installed)"
    info = dict(date="D", device="CPU", python="3", torch="2", triton="3", transformers="5")
    info["torchvision"] = "not installed"
    header = format_header(info, "kiln bench --suite cpu")
    assert "- device: CPU" in header and "`kiln bench --suite cpu`" in header
