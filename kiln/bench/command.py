"""``kiln bench`` (and ``python -m kiln.bench``): options, their checks, the run, the output.

Bad input -- an unknown model, a model whose package is missing, a CUDA device on a machine
without one -- is a :class:`UsageError`: one line on stderr and exit status 2, never a
traceback. A row that fails its check makes the exit status 1 (after the whole table).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence

from kiln.bench.arguments import OneLineParser, UsageError
from kiln.bench.machine import environment, resolve_device
from kiln.bench.models import MODELS, SUITES
from kiln.bench.progress import Progress
from kiln.bench.runner import Options, Row, run_suite
from kiln.bench.table import format_header, format_table
from kiln.bench.worker import COMPILERS, DTYPES

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench options (shared by ``kiln bench`` and ``python -m kiln.bench``)."""
    parser.add_argument(
        "--suite", choices=sorted(SUITES), help="default: reference on a GPU, else cpu"
    )
    parser.add_argument(
        "--models", help=f"comma-separated, overrides --suite (known: {', '.join(MODELS)})"
    )
    parser.add_argument("--mode", choices=("infer", "train", "both"), default="infer")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="autocast dtype; default bfloat16 on a GPU, else float32",
    )
    parser.add_argument("--device", help="cpu, cuda or cuda:N; default cuda when there is a GPU")
    parser.add_argument(
        "--batch", type=int, help="batch size for every model (default: the suite's)"
    )
    parser.add_argument(
        "--compile-mode", choices=COMPILE_MODES, help="mode= for torch.compile and kiln.compile"
    )
    parser.add_argument(
        "--compilers", default="torch,kiln", help="compared with eager; default torch,kiln"
    )
    parser.add_argument("--no-warm-start", action="store_true", help="skip the second-process runs")
    parser.add_argument("--in-process", action="store_true", help="no worker processes (debugging)")
    parser.add_argument(
        "--budget", type=float, default=2.0, help="seconds of timed calls per measurement"
    )
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads per worker (default: torch's own choice)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="a per-kernel roofline of Kiln's rows (CUDA)"
    )
    parser.add_argument(
        "--json", nargs="?", const="-", metavar="PATH", help="write JSON (- for stdout)"
    )


def resolve(args: argparse.Namespace) -> tuple[Options, list[str]]:
    """Checked options and the modes to run; raises :class:`UsageError`."""
    device = resolve_device(args.device)
    models = _models(args.models, args.suite, device)
    compilers = tuple(name.strip() for name in args.compilers.split(",") if name.strip())
    unknown = [name for name in compilers if name not in COMPILERS or name == "eager"]
    if unknown:
        raise UsageError(f"unknown compiler {unknown[0]!r} (choose from torch, kiln)")
    for flag, value in (("--batch", args.batch), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be positive, got {value}")
    options = Options(
        models=models,
        device=device,
        dtype=args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"),
        batch=args.batch,
        compile_mode=args.compile_mode,
        compilers=compilers,
        warm_start=not args.no_warm_start,
        isolate=not args.in_process,
        budget_s=args.budget,
        threads=args.threads,
        profile=args.profile,
    )
    modes = ["infer", "train"] if args.mode == "both" else [args.mode]
    return options, modes


def _models(requested: str | None, suite: str | None, device: str) -> list[str]:
    """Named models must exist and have their packages; a suite's missing ones are skipped later."""
    if requested is None:
        return list(SUITES[suite or ("reference" if device.startswith("cuda") else "cpu")])
    names = [name.strip() for name in requested.split(",") if name.strip()]
    if not names:
        raise UsageError("--models is empty")
    for name in names:
        if name not in MODELS:
            raise UsageError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
        missing = MODELS[name].missing()
        if missing:
            raise UsageError(f"model {name!r} needs {', '.join(missing)}, which is not installed")
    return names


def run(args: argparse.Namespace, argv: Sequence[str], program: str = "kiln bench") -> int:
    """Run the bench; print the header and table (or JSON); 1 when a row failed its check."""
    options, modes = resolve(args)
    to_stdout_json = args.json == "-"
    progress = Progress(sys.stderr)
    info = environment(options.device, options.threads)  # dated when the run starts
    rows: list[Row] = []
    command = " ".join([program, *map(shlex.quote, argv)])

    def write_json(complete: bool) -> None:
        document = {
            "environment": info,
            "command": command,
            "complete": complete,
            "rows": [row.as_dict() for row in rows],
        }
        text = json.dumps(document, indent=1)
        if to_stdout_json:
            print(text)
            return
        partial = f"{args.json}.partial"  # (renamed over: a reader never sees half a file)
        with open(partial, "w") as out:
            out.write(text + "\n")
        os.replace(partial, args.json)

    def finished(row: Row) -> None:
        rows.append(row)
        if args.json and not to_stdout_json:
            write_json(complete=False)  # (a run cut off by a time limit keeps its rows)

    for mode in modes:
        options.mode = mode
        run_suite(options, progress, on_row=finished)
    if args.json:
        write_json(complete=True)
    if not to_stdout_json:
        print(format_header(info, command) + "\n\n" + format_table(rows))
    failed = [row for row in rows if row.failed]
    if failed:
        print(f"\n{len(failed)} row(s) failed: see the check column", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None, program: str = "python -m kiln.bench") -> int:
    """Entry point of ``python -m kiln.bench``."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineParser(prog=program, description="Kiln's benchmark harness")
    add_arguments(parser)
    args = parser.parse_args(arguments)
    try:
        return run(args, arguments, program)
    except UsageError as error:
        print(f"{program}: error: {error}", file=sys.stderr)
        return 2
