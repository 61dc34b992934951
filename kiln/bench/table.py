"""Printing results: the environment header and the rows as an aligned Markdown table.

The printed text is what ``benchmarks/RESULTS.md`` records, so it carries everything a reader
needs to trust a number: date, card or CPU, versions and the exact command. A row whose
correctness check failed, or whose compiler crashed, says so in the ``check`` column, and
its error is listed under the table.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.bench.runner import Row
from kiln.bench.worker import Measurement

HEADERS = (
    "model",
    "mode",
    "batch",
    "eager ms",
    "torch.compile ms",
    "kiln ms",
    "kiln vs eager",
    "kiln vs torch.compile",
    "first call s (eager / torch / kiln)",
    "warm start s (torch / kiln)",
    "peak MiB (eager / torch / kiln)",
    "reserved MiB (eager / torch / kiln)",
    "max rel err (torch / kiln)",
    "check",
)


def format_header(info: dict[str, str], command: str) -> str:
    versions = ", ".join(f"{name} {info[name]}" for name in ("python", "torch", "triton"))
    extras = ", ".join(f"{name} {info[name]}" for name in ("transformers", "torchvision"))
    return (
        f"- date: {info['date']}\n- device: {info['device']}\n- versions: {versions} "
        f"({extras})\n- command: `{command}`"
    )


def format_table(rows: Sequence[Row]) -> str:
    """The Markdown table of ``rows`` followed by the notes and errors of each row."""
    cells = [list(HEADERS)] + [_cells(row) for row in rows]
    widths = [max(len(line[column]) for line in cells) for column in range(len(HEADERS))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"
        for line in cells
    ]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    notes = [note for row in rows for note in _notes(row)]
    return "\n".join(lines + (["", *notes] if notes else []))


def _cells(row: Row) -> list[str]:
    if row.skipped is not None:
        return [
            row.model,
            row.mode,
            str(row.batch),
            *[""] * (len(HEADERS) - 4),
            f"skipped: {row.skipped}",
        ]
    get = row.measurements.get
    eager, torch_run, kiln_run = get("eager"), get("torch"), get("kiln")
    return [
        row.model,
        row.mode,
        str(row.batch),
        _ms(eager),
        _ms(torch_run),
        _ms(kiln_run),
        _ratio(eager, kiln_run),
        _ratio(torch_run, kiln_run),
        " / ".join(_first_call(m) for m in (eager, torch_run, kiln_run)),
        " / ".join(_first_call(get(f"{name} warm")) for name in ("torch", "kiln")),
        " / ".join(_mib(m) for m in (eager, torch_run, kiln_run)),
        " / ".join(_mib(m, reserved=True) for m in (eager, torch_run, kiln_run)),
        " / ".join(_error(m) for m in (torch_run, kiln_run)),
        _check(row),
    ]


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _ms(measurement: Measurement | None) -> str:
    if measurement is None:
        return "—"
    if measurement.error is not None:
        return "error"
    return _number(measurement.median_ms) if measurement.median_ms is not None else "—"


def _ratio(baseline: Measurement | None, measurement: Measurement | None) -> str:
    if baseline is None or measurement is None:
        return "—"
    if baseline.median_ms is None or measurement.median_ms is None:
        return "—"
    return f"{baseline.median_ms / measurement.median_ms:.2f}x"


def _first_call(measurement: Measurement | None) -> str:
    if measurement is None:
        return "—"
    if measurement.error is not None or measurement.first_call_s is None:
        return "error"
    return _number(measurement.first_call_s)


def _mib(measurement: Measurement | None, reserved: bool = False) -> str:
    if measurement is None:
        return "—"
    value = measurement.reserved_mib if reserved else measurement.peak_mib
    return "—" if value is None else f"{value:.0f}"


def _error(measurement: Measurement | None) -> str:
    if measurement is None:
        return "—"
    if measurement.max_rel_error is None:
        return "error"
    mark = "" if measurement.ok else " ✗"
    return f"{measurement.max_rel_error:.1e}{mark}"


def _check(row: Row) -> str:
    failures = []
    for name, measurement in row.measurements.items():
        if measurement.error is not None:
            failures.append(f"{name} error")
        elif not measurement.ok:
            failures.append(f"{name} wrong")
    return "FAIL: " + ", ".join(failures) if failures else "ok"


def _notes(row: Row) -> list[str]:
    notes = []
    for name, measurement in row.measurements.items():
        if measurement.error is not None:
            notes.append(f"- {row.model} {row.mode}, {name}: {measurement.error}")
        if name == "eager repeat" and measurement.max_rel_error is not None:
            notes.append(
                f"- {row.model} {row.mode}: eager against a second eager process: max rel err "
                f"{measurement.max_rel_error:.1e} (run-to-run variation)"
            )
        elif not name.endswith("warm"):
            notes += [f"- {row.model} {row.mode}: {note}" for note in measurement.notes]
    dynamic, static = row.measurements.get("kiln-dynamic"), row.measurements.get("kiln")
    if dynamic is not None and dynamic.error is None:
        notes.append(
            f"- {row.model} {row.mode}: kiln.compile(dynamic=True) {_ms(dynamic)} ms, "
            f"{_ratio(static, dynamic)} of static Kiln's speed, first call "
            f"{_first_call(dynamic)} s, max rel err {_error(dynamic)}"
        )
    return notes
