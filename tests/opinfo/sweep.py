"""PyTorch's OpInfo database (``op_db``) through ``kiln.compile``, compared with eager PyTorch.

Every sample of an OpInfo becomes a fresh function of the sample's tensors, generated as source
so capture sees an ordinary call (``return op(t0, [t1, t2], dim=c0)``), and runs eagerly and
compiled on identical copies of those tensors. Outputs are compared as pytrees (structure,
dtype, shape, device, ``requires_grad``, values), so are the inputs after the call (in-place
ops) and which outputs are, or share memory with, which inputs. For float32 samples of
differentiable ops the backward phase draws one random cotangent per differentiable output and
compares every input's gradient. A float32 difference beyond torch.testing's tolerance is
judged against a float64 eager run: compiled passes if it is no further from float64 than a
few times eager's own error. Dtypes: float32 forward and backward; int64 and bool forward.
``--full`` also runs each op's in-place variant (forward).

Each (op, form, dtype, sample, phase) gets one category::

    mismatch  a value, dtype, shape, requires_grad, gradient, mutation or aliasing differs, or
              eager raised and compiled did not: a silent wrong result, the worst
    error     compiled raised where eager did not, or another exception type
    random    the op draws random numbers (OpInfo wraps it in ``wrapper_set_seed``) or returns
              uninitialized memory: everything but the values matched
    fallback  matched, but a frame ran uncompiled (kiln.counters.fallbacks) or a graph ran on
              the reference interpreter
    break     matched, with graph breaks
    pass      matched with no break and no fallback (also: both raised the same type)
    skip      nothing to run: dtype unsupported on CPU, no autograd, no differentiable output
    crash     the worker process died in that sample (the pool resumes after it)
    timeout   the sample ran past its alarm, or the worker made no progress for --timeout s

Layout: ``opinfo_samples.py`` runs one sample (the generated function, the runs, the
category), ``opinfo_compare.py`` compares pytrees and judges rounding; this module is the
command line, the worker pool and the reports.

Usage::

    python tests/opinfo/sweep.py --ops add,cat            # float32, first two samples each
    python tests/opinfo/sweep.py --samples 1 --tables     # test_opinfo.py's tables, regenerated
    python tests/opinfo/sweep.py --full --jobs 2 --json /tmp/opinfo.json --markdown /tmp/o.md
    python tests/opinfo/sweep.py --load /tmp/opinfo.json  # the report of an earlier run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from opinfo_samples import (
    CATEGORIES,
    DTYPES,
    FAILING,
    PHASES,
    Record,
    Task,
    ops,
    run_task,
    tasks_for,
)

# ---------------------------------------------------------------------------------------------
# The process pool: crashes and hangs lose one sample, never the sweep


def _worker_main() -> None:
    """Load the database, say "ready", then run tasks read as JSON lines on stdin, streaming
    progress (before each unit), records and "done" on stdout."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not corrupt the protocol
    faulthandler.enable()
    ops()
    protocol.write('{"ready": true}\n')
    for line in sys.stdin:
        task = Task(**json.loads(line))

        def progress(unit: int, args: str) -> None:
            protocol.write(json.dumps({"progress": unit, "args": args}) + "\n")

        for record in run_task(task, progress):
            protocol.write(json.dumps({"record": dataclasses.asdict(record)}) + "\n")
        protocol.write('{"done": true}\n')


class _Worker:
    """One worker subprocess, the task it runs and the unit it last started."""

    def __init__(self, log_path: str) -> None:
        self.log_path = log_path
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log_path, "ab"),  # noqa: SIM115  (the child owns it)
            start_new_session=True,  # its compiler subprocesses die with it
        )
        self.buffer = b""
        self.ready = False
        self.task: Task | None = None
        self.unit: int | None = None  # None until the task's first unit starts
        self.unit_done = False  # its record came: a death now is between units
        self.args = ""  # the unit's sample, described
        self.last = time.monotonic()
        self.tasks_run = 0

    def send(self, task: Task) -> None:
        self.task, self.unit, self.unit_done, self.last = task, None, False, time.monotonic()
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(dataclasses.asdict(task)) + "\n").encode())
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def log_tail(self) -> str:
        """The last error line the worker wrote (faulthandler's, for a segfault)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, os.path.getsize(self.log_path) - (1 << 16)))
                lines = log.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        fatal = [line for line in lines if "Fatal Python error" in line]
        return (fatal or lines or [""])[-1][:300]


class _Pool:
    """Workers running tasks. A worker that dies, or makes no progress for ``timeout``
    seconds, costs the unit it was in (a ``crash``/``timeout`` record); a fresh worker resumes
    the task after that unit."""

    def __init__(
        self, jobs: int, timeout: float, on_record: Callable[[Record], None], recycle: int
    ) -> None:
        self.jobs, self.timeout, self.on_record, self.recycle = jobs, timeout, on_record, recycle
        self.queue: list[Task] = []
        self.workers: list[_Worker] = []
        self.selector = selectors.DefaultSelector()
        self.log_dir = tempfile.mkdtemp(prefix="opinfo-workers-")
        self.started = self.finished = 0

    def run(self, tasks: list[Task]) -> None:
        self.queue = list(reversed(tasks))
        last_report = time.monotonic()
        while self.queue or any(w.task for w in self.workers):
            if time.monotonic() - last_report > 60:
                last_report = time.monotonic()
                print(f"[opinfo] {self.finished}/{len(tasks)} tasks", file=sys.stderr, flush=True)
            while len(self.workers) < self.jobs and self.queue:
                self._start()
            for worker in self.workers:
                if worker.ready and worker.task is None and self.queue:
                    worker.send(self.queue.pop())
            for handle, _ in self.selector.select(timeout=5):
                self._read(handle.data, os.read(handle.fd, 1 << 16))
            for worker in list(self.workers):
                if worker.task is not None and time.monotonic() - worker.last > self.timeout:
                    self._retire(worker, "timeout", f"no progress for {self.timeout:.0f} s")
        for worker in list(self.workers):
            self._retire(worker, "", "")

    def _start(self) -> None:
        self.started += 1
        worker = _Worker(os.path.join(self.log_dir, f"worker-{self.started}.log"))
        self.selector.register(worker.process.stdout, selectors.EVENT_READ, worker)  # type: ignore[arg-type]
        self.workers.append(worker)

    def _read(self, worker: _Worker, chunk: bytes) -> None:
        if not chunk:
            code = worker.process.wait()
            self._retire(worker, "crash", f"worker exited with {code}: {worker.log_tail()}")
            return
        worker.buffer += chunk
        *lines, worker.buffer = worker.buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            worker.last = time.monotonic()
            if "progress" in message:
                worker.unit, worker.unit_done = message["progress"], False
                worker.args = message["args"]
            elif "record" in message:
                record = Record(**message["record"])
                if record.sample is not None:
                    done = 2 * record.sample + PHASES.index(record.phase)
                    worker.unit_done = worker.unit_done or done == worker.unit
                self.on_record(record)
            elif message.get("ready"):
                worker.ready = True
            elif message.get("done"):
                worker.task, worker.tasks_run = None, worker.tasks_run + 1
                self.finished += 1
        if worker.task is None and worker.tasks_run >= self.recycle:
            self._retire(worker, "", "")  # a fresh process bounds memory growth

    def _retire(self, worker: _Worker, category: str, detail: str) -> None:
        self.selector.unregister(worker.process.stdout)  # type: ignore[arg-type]
        worker.stop()
        self.workers.remove(worker)
        task = worker.task
        if task is None:
            return
        op = ops()[task.op]
        if worker.unit is None:  # it died generating the samples: nothing to resume
            index, phase, detail = None, 0, f"{detail} (generating samples)"
            self.finished += 1
        elif worker.unit_done:
            index, phase, detail = None, 0, f"{detail} (between samples)"
            self.queue.append(dataclasses.replace(task, start=worker.unit + 1))
        else:
            index, phase = divmod(worker.unit, 2)
            self.queue.append(dataclasses.replace(task, start=worker.unit + 1))
        args = worker.args if index is not None else ""
        where = (op.name, op.variant_test_name, task.form, task.dtype, PHASES[phase], index)
        self.on_record(Record(*where, category, detail, args))


def run_pool(
    tasks: list[Task],
    jobs: int,
    timeout: float,
    on_record: Callable[[Record], None],
    recycle_after: int = 40,
) -> None:
    """Run ``tasks`` on ``jobs`` worker processes (see :class:`_Pool`)."""
    _Pool(jobs, timeout, on_record, recycle_after).run(tasks)


# ---------------------------------------------------------------------------------------------
# Reports


_NUMBERS = re.compile(r"\b0x[0-9a-f]+\b|(?<![A-Za-z_])\d+(\.\d+)?(e[-+]?\d+)?")
_SHORT_PHASES = {"forward": "fwd", "backward": "bwd"}
_SHORT_DTYPES = {"float32": "f32", "int64": "i64", "bool": "b8"}


def reason_of(record: Record) -> str:
    """What groups records: the break/fallback reasons, else the detail with numbers erased."""
    if record.category in ("break", "fallback"):
        return "; ".join(sorted({r.split(":")[0] for r in record.reasons}))
    if record.category == "mismatch" and record.error:
        return f"{record.error.get('kind')} at {_NUMBERS.sub('#', str(record.error['where']))}"
    return _NUMBERS.sub("#", record.detail)[:160]


_CAUSES = (
    (r"is input \[\d+\] in eager, input \[\] compiled", "a new tensor, eager returns the input"),
    (r"is input \[\] in eager, input \[\d+\] compiled", "returns the input, eager a new tensor"),
    (r"shares memory with inputs \[[\d, ]+\] in eager, \[\]", "a copy, eager returns a view"),
    (r"requires_grad False != eager's True", "output does not require grad, eager's does"),
    (r"requires_grad True != eager's False", "output requires grad, eager's does not"),
)


def short_cause(record: Record) -> str:
    """``<category>: <short cause>`` of a failing record, for test_opinfo's tables."""
    for pattern, cause in _CAUSES:
        if re.search(pattern, record.detail):
            return f"{record.category}: {cause}"
    if record.category == "mismatch" and record.error:
        where = _NUMBERS.sub("#", str(record.error.get("where")))
        return f"mismatch: {record.error.get('kind')} of {where} ({record.phase})"
    return f"{record.category}: {record.detail.split(chr(10))[0][:70]}"


def ci_tables(records: list[Record]) -> str:
    """test_opinfo.py's KNOWN_FAILURES and EXPECTED_DETOURS for these records."""
    by_op: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        by_op[record.key].append(record)
    failures, detours = [], []
    for key, mine in by_op.items():
        failing = [r for r in mine if r.category in FAILING]
        if failing:
            failures.append(f"    {key!r}: {short_cause(failing[0])!r},")
        for category in ("fallback", "break"):
            found = {r.split(":")[0] for x in mine if x.category == category for r in x.reasons}
            if found:
                detours.append(f"    {key!r}: ({category!r}, {', '.join(sorted(found))!r}),")
                break
    lines = ["KNOWN_FAILURES: dict[str, str] = {", *failures, "}", ""]
    lines += ["EXPECTED_DETOURS: dict[str, tuple[str, str]] = {", *detours, "}"]
    return "\n".join(lines)


def counts_table(records: list[Record]) -> str:
    """Samples per category: forward by dtype, then backward."""
    columns = [("forward", d) for d in DTYPES] + [("forward", None), ("backward", "float32")]
    counts = Counter((r.phase, r.dtype, r.category) for r in records)
    header = ["category", *(f"{p} {d or 'all'}" for p, d in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for category in CATEGORIES:
        cells = [
            sum(counts[(p, dt, category)] for dt in DTYPES if d is None or dt == d)
            for p, d in columns
        ]
        lines.append(f"| {category} | " + " | ".join(map(str, cells)) + " |")
    total = [sum(counts[(p, dt, c)] for c in CATEGORIES for dt in DTYPES if d in (None, dt))
             for p, d in columns]  # fmt: skip
    lines.append("| total | " + " | ".join(map(str, total)) + " |")
    return "\n".join(lines)


def markdown(records: list[Record]) -> str:
    """The counts table, then every op's non-pass samples grouped by category and reason."""
    out = ["# OpInfo sweep through kiln.compile", "", counts_table(records), ""]
    random_ops = sorted({(r.key, r.detail) for r in records if r.category == "random"})
    if random_ops:
        out += ["## Random ops (values not compared)", ""]
        out += [f"- `{key}`: {why}" for key, why in random_ops] + [""]
    by_op: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        if record.category not in ("pass", "random"):
            by_op[record.key].append(record)
    out += ["## Non-pass samples by op", ""]
    for key, mine in by_op.items():
        out.append(f"### {key}")
        groups: dict[tuple[str, str], list[Record]] = defaultdict(list)
        for record in mine:
            groups[(record.category, reason_of(record))].append(record)
        for (category, reason), group in sorted(groups.items(), key=_group_order):
            where = ", ".join(_where(r) for r in group[:12]) + (", ..." if len(group) > 12 else "")
            out.append(f"- **{category}** ({len(group)}) {reason} [{where}]")
            example = group[0]
            if category in FAILING and example.args:
                out.append(f"  - e.g. `{example.args}`: {example.detail[:300]}")
        out.append("")
    return "\n".join(out)


def _where(record: Record) -> str:
    """``f32 fwd #3``, ``inplace i64 fwd #0``, ``f32 bwd`` (a whole-op skip)."""
    form = "inplace " if record.form == "inplace" else ""
    sample = "" if record.sample is None else f" #{record.sample}"
    return f"{form}{_SHORT_DTYPES[record.dtype]} {_SHORT_PHASES[record.phase]}{sample}"


def _group_order(item: tuple[tuple[str, str], list[Record]]) -> tuple[int, str]:
    (category, reason), _ = item
    return (-CATEGORIES.index(category), reason)


def write_json(path: str, records: list[Record], meta: dict[str, Any]) -> None:
    payload = {"meta": meta, "records": [dataclasses.asdict(r) for r in records]}
    with open(path, "w") as file:
        json.dump(payload, file, indent=0)


def _select(names: str | None) -> list[str]:
    if not names:
        return list(ops())
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    keys = [k for k in ops() if k in wanted or ops()[k].name in wanted]
    missing = [n for n in wanted if n not in keys and all(ops()[k].name != n for k in keys)]
    if missing:
        raise SystemExit(f"unknown ops: {missing}")
    return keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", help="comma-separated op names or name.variant keys")
    parser.add_argument("--full", action="store_true", help="every sample, dtype and form")
    parser.add_argument("--samples", type=int, default=2, help="samples per op without --full")
    parser.add_argument("--json", help="write every record to this file (and PATH + 'l')")
    parser.add_argument("--markdown", nargs="?", const="-", help="report (to a file or stdout)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (0: in-process)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds without progress")
    parser.add_argument("--load", help="report on a JSON file written by --json; run nothing")
    parser.add_argument("--tables", action="store_true", help="print test_opinfo.py's tables")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker_main()
        return 0
    if args.load:
        with open(args.load) as file:
            rows = (
                [json.loads(line) for line in file]
                if args.load.endswith(".jsonl")
                else json.load(file)["records"]
            )
        records = [Record(**row) for row in rows]
        print(ci_tables(records) if args.tables else markdown(records))
        return 0
    limit = None if args.full else args.samples
    tasks = [t for key in _select(args.ops) for t in tasks_for(key, args.full, limit)]
    records = []
    started = time.time()

    stream = open(args.json + "l", "w", buffering=1) if args.json else None  # noqa: SIM115

    def report(record: Record) -> None:
        """Keep the record; stream it to PATH + "l" (JSON lines) so a killed run is not lost."""
        records.append(record)
        if stream is not None:
            stream.write(json.dumps(dataclasses.asdict(record)) + "\n")
        if record.category in FAILING:
            print(f"{record.key} {record.form} {record.dtype} {record.phase} #{record.sample}: "
                  f"{record.category}: {record.detail[:200]}", file=sys.stderr)  # fmt: skip

    if args.jobs > 0:
        run_pool(tasks, args.jobs, args.timeout, report)
    else:
        for task in tasks:
            for record in run_task(task):
                report(record)
    if stream is not None:
        stream.close()
    order = {key: i for i, key in enumerate(ops())}
    phase_order = {phase: i for i, phase in enumerate(PHASES)}
    records.sort(key=lambda r: (order[r.key], r.form, r.dtype, r.sample or 0, phase_order[r.phase]))
    meta = {
        "torch": torch.__version__,
        "argv": sys.argv[1:] if argv is None else argv,
        "seconds": round(time.time() - started),
        "tasks": len(tasks),
    }
    if args.json:
        write_json(args.json, records, meta)
    if args.tables:
        print(ci_tables(records))
    text = markdown(records) if args.markdown else counts_table(records)
    if args.markdown and args.markdown != "-":
        with open(args.markdown, "w") as file:
            file.write(text + "\n")
        text = counts_table(records)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
