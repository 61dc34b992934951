"""Running a suite: one row per model x mode, each compiler of a row in its own process.

A row runs, in order: eager (which saves the reference results), then for each compiler a
cold process and, when asked, a warm-start process that shares the cold one's disk caches
(``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` point into a scratch folder of the row,
so the cold process is truly cold and the warm one finds what it left). Kiln has no disk
cache yet, so its warm start measures a second cold start; the table says so.

``isolate=False`` runs every measurement in this process instead (tests, debugging); warm
starts are then not measured, since nothing would be warm for the right reasons.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kiln.bench.models import MODELS, ModelSpec
from kiln.bench.progress import Progress
from kiln.bench.worker import COMPILER_TITLES, PHASE, RESULT, Job, Measurement, measure


@dataclass
class Options:
    """A bench run's settings (the command line's options, resolved)."""

    models: list[str]
    mode: str = "infer"
    device: str = "cpu"
    dtype: str = "float32"
    batch: int | None = None
    compile_mode: str | None = None
    compilers: tuple[str, ...] = ("torch", "kiln")
    warm_start: bool = True
    isolate: bool = True
    budget_s: float = 2.0
    threads: int | None = None
    profile: bool = False  # Kiln's rows: a per-kernel roofline in the notes (CUDA)


@dataclass
class Row:
    """One model x mode: the measurement of each compiler, keyed ``eager``, ``torch``,
    ``kiln``, ``torch warm``, ``kiln warm``; ``skipped`` says why a row did not run."""

    model: str
    mode: str
    batch: int
    summary: str
    measurements: dict[str, Measurement] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def failed(self) -> bool:
        """A compiler crashed or disagreed with eager (a skipped row has not failed)."""
        return any(not measurement.ok for measurement in self.measurements.values())

    def as_dict(self) -> dict[str, object]:
        data = dataclasses.asdict(self)
        data["failed"] = self.failed
        return data


def run_suite(
    options: Options, progress: Progress, on_row: Callable[[Row], None] | None = None
) -> list[Row]:
    """Every requested row, in order; models with missing packages become skipped rows.
    ``on_row`` sees each row as it is finished (the JSON file is rewritten then)."""
    rows: list[Row] = []
    total = len(options.models)
    for index, name in enumerate(options.models, 1):
        spec = MODELS[name]
        batch = options.batch or spec.batch
        missing = spec.missing()
        if missing:
            reason = f"needs {', '.join(missing)} (not installed)"
            progress.note(f"[{index}/{total}] {name}: skipped, {reason}")
            rows.append(Row(name, options.mode, batch, spec.summary, skipped=reason))
        else:
            rows.append(run_row(spec, options, progress, f"[{index}/{total}]"))
        if on_row is not None:
            on_row(rows[-1])
    return rows


def run_row(spec: ModelSpec, options: Options, progress: Progress, counter: str = "") -> Row:
    """Measure one model in ``options.mode`` with eager and every compiler."""
    batch = options.batch or spec.batch
    row = Row(spec.name, options.mode, batch, spec.summary)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as scratch:
        base = Job(
            model=spec.name,
            mode=options.mode,
            compiler="eager",
            device=options.device,
            dtype=options.dtype,
            batch=batch,
            reference=str(Path(scratch) / "reference.pt"),
            compile_mode=options.compile_mode,
            budget_s=options.budget_s,
            threads=options.threads,
            profile=options.profile,
        )
        label = f"{counter} {spec.name} {options.mode}".strip()
        row.measurements["eager"] = _run(base, options, progress, label, scratch)
        if row.measurements["eager"].error is not None:
            return row
        noise = None
        if options.isolate:
            repeat = dataclasses.replace(base, repeat=True)
            noise = row.measurements["eager repeat"] = _run(
                repeat, options, progress, label, scratch
            )
            noise.ok = noise.error is None
        for compiler in options.compilers:
            job = dataclasses.replace(base, compiler=compiler)
            cold = row.measurements[compiler] = _run(job, options, progress, label, scratch)
            _judge(cold, noise)
            if options.warm_start and options.isolate and cold.error is None:
                warm = dataclasses.replace(job, warm_start=True)
                measured = _run(warm, options, progress, label, scratch)
                _judge(measured, noise)
                row.measurements[f"{compiler} warm"] = measured
    return row


def _judge(measurement: Measurement, noise: Measurement | None) -> None:
    """A result outside the dtype's tolerance still agrees with eager when eager disagrees with
    itself as much: twice the error of a second eager process is accepted (and said)."""
    if noise is None or noise.max_rel_error is None or measurement.max_rel_error is None:
        return
    floor = noise.max_rel_error
    if not measurement.ok and measurement.error is None and measurement.max_rel_error <= 2 * floor:
        measurement.ok = True
        measurement.notes.append(
            f"error {measurement.max_rel_error:.2g} is within eager's own run-to-run "
            f"variation ({floor:.2g}: eager against a second eager process)"
        )


def _run(job: Job, options: Options, progress: Progress, label: str, scratch: str) -> Measurement:
    suffix = " (warm start)" if job.warm_start else " (second process)" if job.repeat else ""
    title = COMPILER_TITLES[job.compiler] + suffix
    progress.start(f"{label} · {title}")
    if options.isolate:
        result = _run_in_subprocess(job, progress, scratch)
    else:
        result = measure(job, progress.phase)
    progress.done(_summary(result))
    return result


def _summary(result: Measurement) -> str:
    if result.error is not None:
        return f"FAILED: {result.error}"
    parts = [f"first call {result.first_call_s:.2f} s"]
    if result.median_ms is not None:
        parts.append(f"median {result.median_ms:.2f} ms")
    if not result.ok:
        parts.append(f"WRONG (max rel error {result.max_rel_error:.2g})")
    return ", ".join(parts)


MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824"


def _run_in_subprocess(job: Job, progress: Progress, scratch: str) -> Measurement:
    """``python -m kiln.bench.worker``; its phases feed ``progress``, its stderr goes to a log
    whose last line explains a crash (a segfault or an out-of-memory kill has no result)."""
    environment = dict(os.environ)
    # Every compiler's process with malloc's thresholds pinned: with glibc's defaults an eager
    # step could return the heap's top to the OS and fault it back in on the next step (small
    # CPU models: 1.7-2.5 ms against 1.0), which flattered every ratio against eager.
    tunables = [os.environ.get("GLIBC_TUNABLES"), MALLOC_TUNABLES]
    environment["GLIBC_TUNABLES"] = ":".join(filter(None, tunables))
    environment["TORCHINDUCTOR_CACHE_DIR"] = str(Path(scratch) / "inductor")
    environment["TRITON_CACHE_DIR"] = str(Path(scratch) / "triton")
    suffix = "-warm" if job.warm_start else "-repeat" if job.repeat else ""
    log_path = Path(scratch) / f"{job.compiler}{suffix}.log"
    command = [sys.executable, "-m", "kiln.bench.worker", json.dumps(dataclasses.asdict(job))]
    result: Measurement | None = None
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=log, text=True, env=environment
        )
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith(PHASE):
                progress.phase(line[len(PHASE) :].strip())
            elif line.startswith(RESULT):
                result = Measurement.from_dict(json.loads(line[len(RESULT) :]))
        code = process.wait()
    if result is None:
        lines = log_path.read_text().strip().splitlines() or ["(no output)"]
        return Measurement(
            job.compiler, job.warm_start, ok=False, error=f"worker exited {code}: {lines[-1]}"
        )
    return result
