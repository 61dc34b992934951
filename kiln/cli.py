"""The ``kiln`` command: ``kiln demo``, ``kiln bench``, ``kiln explain SCRIPT.py [args]`` and
``kiln cache info|clear``.

Every bad input (an unknown option value, a missing file, a CUDA request without a GPU) is
one line on stderr and exit status 2: the command is meant to be run by people reading its
output, and a traceback would bury the one sentence that matters.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

from kiln.bench.arguments import OneLineParser, UsageError


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="kiln", description="Kiln, a PyTorch compiler")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="compile a small model, check it, time it")
    demo.add_argument("--backend", default="kiln", help="backend of kiln.compile (default kiln)")
    demo.add_argument("--device", help="cpu or cuda (default: cuda when there is a GPU)")
    from kiln.bench.command import add_arguments

    add_arguments(commands.add_parser("bench", help="benchmark models: eager, torch.compile, kiln"))
    explain = commands.add_parser("explain", help="run a script, then report what Kiln compiled")
    explain.add_argument("--verbose", action="store_true", help="print every graph and guard")
    explain.add_argument("script", help="the Python script to run")
    explain.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    cache = commands.add_parser("cache", help="the disk caches: their size, or remove them")
    cache.add_argument("action", choices=["info", "clear"])
    arguments = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(arguments)
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "bench":
            from kiln.bench.command import run

            return run(args, arguments[1:])
        if args.command == "cache":
            return _cache(args.action)
        return explain_script(args.script, args.args, args.verbose)
    except UsageError as error:
        print(f"kiln {args.command}: error: {error}", file=sys.stderr)
        return 2


def _demo(args: argparse.Namespace) -> int:
    import torch

    from kiln.backends import list_backends
    from kiln.demo import run_demo

    known = list_backends()
    if args.backend not in known:
        raise UsageError(f"unknown backend {args.backend!r} (have: {', '.join(known)})")
    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: no CUDA GPU is available on this machine")
    return 0 if run_demo(args.backend, args.device) else 1


def _cache(action: str) -> int:
    """``kiln cache info``: each cache's files and bytes (the artifacts' bound too);
    ``kiln cache clear``: remove them all (the next runs capture and build again)."""
    import shutil

    from kiln.config import config

    root = Path(config.cache_dir)
    kinds = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if action == "clear":
        for path in root.iterdir() if root.is_dir() else ():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        print(f"kiln cache: cleared {root}")
        return 0
    print(f"kiln cache: {root}")
    total = 0
    for kind in kinds:
        files = [p for p in kind.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        total += size
        print(f"  {kind.name:<10} {len(files):>6} files {size / 2**20:>10.2f} MiB")
    bound = config.artifact_cache_bytes / 2**20
    print(f"  total {total / 2**20:.2f} MiB (artifacts bounded at {bound:.0f} MiB)")
    return 0


def explain_script(script: str, script_args: list[str], verbose: bool = False) -> int:
    """Run ``script`` as ``__main__`` with ``sys.argv = [script, *script_args]``, then print
    (to stderr) what every ``kiln.compile``'d function that ran made of its calls. Returns the
    script's exit status (1 when it raised)."""
    path = Path(script)
    if not path.is_file():
        raise UsageError(f"no such script: {script}")
    import kiln
    from kiln.capture.driver.explain import recording

    recompiles_before = len(kiln.counters.recompiles)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(path.resolve().parent))  # as `python script.py` would
    status = 0
    with recording(fresh=False) as events:
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exit_:
            status = _exit_status(exit_.code)
        except Exception:
            traceback.print_exc()
            status = 1
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
    recompiles = kiln.counters.recompiles[recompiles_before:]
    print(format_explanation(script, events, recompiles, verbose), file=sys.stderr)
    return status


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def format_explanation(
    script: str, events: list[Any], recompiles: list[tuple[str, str]], verbose: bool
) -> str:
    """One section per compiled function, in the order they first compiled: its graphs, graph
    breaks (with source lines), frames run uncompiled, externs, recompiles; then the kernels
    of every compiled program (the ``kiln.recording`` events of a run)."""
    from kiln.capture.driver.cache import Captured
    from kiln.capture.driver.explain import report_of

    by_function: dict[str, list[Any]] = defaultdict(list)
    for event in events:
        if isinstance(event, Captured):
            by_function[event.function].append(event)
    reasons: dict[str, list[str]] = defaultdict(list)
    for name, reason in recompiles:
        reasons[name].append(reason)
    if not by_function:
        return f"kiln explain: no kiln.compile'd function compiled while {script} ran"
    lines = [f"kiln explain: {len(by_function)} compiled function(s) ran in {script}"]
    for name, entries in by_function.items():
        report = report_of(entries)
        lines.append(f"\n== {name} ==")
        lines.append(str(report) if verbose else _summary(report))
        if verbose:
            lines += [f"--- graph {i} ---\n{graph}" for i, graph in enumerate(report.graphs)]
        lines.append(f"recompiles ({len(reasons[name])}):")
        lines += [f"  guard failed: {reason}" for reason in reasons[name]]
    records = [event for event in events if hasattr(event, "kernel_lines")]
    lines.append(f"\nkernels ({len(records)} compiled program(s), forward and backward graphs):")
    for record in records:
        lines.append(
            f"  {record.graph} [{record.codegen or 'interpreter'}, {record.seconds:.2f} s]"
        )
        lines += [f"    {line.split(': ', 1)[1]}" for line in record.kernel_lines()]
    return "\n".join(lines)


def _summary(report: Any) -> str:
    """``str(report)`` without the guard list (a model has hundreds; ``--verbose`` prints them)."""
    lines = str(report).splitlines()
    cut = next((i for i, line in enumerate(lines) if line.startswith("guards (")), len(lines))
    return "\n".join([*lines[:cut], f"guards: {len(report.guards)} (--verbose lists them)"])


if __name__ == "__main__":
    sys.exit(main())
