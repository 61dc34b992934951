"""The broad suite (issue 21) spread over every GPU of the machine, one ``kiln bench`` process
per card, then one table with the ratios and their geomeans.

Each card runs its models' eager, torch.compile and Kiln workers one after another, so every
ratio compares runs on the same card; cards only change which models run at once. The
machine's CPU cores are shared by the cards' processes (compile workers included): first-call
times are those of a loaded host, for both compilers alike.

    python benchmarks/broad.py --gpus 8 --mode both            # the broad suite, 8 cards
    python benchmarks/broad.py --gpus 1 --suite broad-tiny --device cpu --mode infer
    python benchmarks/broad.py --gpus 4 --mode train --deadline 540   # inside a 600 s limit

``--deadline`` stops the cards' benches after that many seconds and tables the rows they
finished (each bench rewrites its JSON after every row).

Prints the ``kiln bench`` table of every row, then a summary: per mode, the geomean of
Kiln/torch.compile time, the rows above 1.0, the first-call and peak-memory ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kiln.bench.models import SUITES
from kiln.bench.runner import Row
from kiln.bench.table import format_header, format_table
from kiln.bench.worker import Measurement

# Rough cost of a model's three workers (relative), so the cards finish together.
COST = {"llama": 3, "mistral": 3, "deberta_v3": 2, "whisper_base": 2, "maxvit_t": 2}


def assign(models: list[str], cards: int) -> list[list[str]]:
    """Longest first onto the least-loaded card."""
    groups: list[list[str]] = [[] for _ in range(cards)]
    loads = [0.0] * cards
    for name in sorted(models, key=lambda m: -COST.get(m.removesuffix("_tiny"), 1)):
        card = loads.index(min(loads))
        groups[card].append(name)
        loads[card] += COST.get(name.removesuffix("_tiny"), 1)
    return [group for group in groups if group]


def launch(
    group: list[str], card: int, args: argparse.Namespace, scratch: Path
) -> subprocess.Popen:
    command = [sys.executable, "-m", "kiln.bench", "--models", ",".join(group)]
    command += ["--mode", args.mode, "--no-warm-start", "--budget", str(args.budget)]
    command += ["--json", str(scratch / f"card{card}.json"), "--compilers", args.compilers]
    if args.compile_mode:
        command += ["--compile-mode", args.compile_mode]
    if args.profile:
        command.append("--profile")
    if args.device:
        command += ["--device", args.device]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    if args.device in (None, "cuda"):
        env["CUDA_VISIBLE_DEVICES"] = str(card)
    (scratch / f"card{card}.json").unlink(missing_ok=True)  # (an earlier run's, in --keep)
    log = open(scratch / f"card{card}.log", "w")  # noqa: SIM115  (closed with the process)
    print(f"card {card}: {', '.join(group)}", flush=True)
    return subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(process: subprocess.Popen) -> None:
    """End a card's bench and its worker: the bench writes its JSON after every row."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def rows_of(path: Path) -> tuple[dict, str, list[Row]]:
    document = json.loads(path.read_text())
    rows = []
    for data in document["rows"]:
        data = dict(data)
        data.pop("failed", None)
        measurements = {k: Measurement.from_dict(v) for k, v in data.pop("measurements").items()}
        rows.append(Row(**data, measurements=measurements))
    return document["environment"], document["command"], rows


def summary(rows: list[Row]) -> list[str]:
    lines = [
        "| mode | rows | geomean kiln/torch | rows > 1.0 | first call kiln/torch (max) "
        "| peak memory kiln/torch (max) | reserved kiln/torch (max) | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode in sorted({row.mode for row in rows}):
        ratios, slower, first, memory, failed = [], [], [], [], []
        reserved: list[float] = []  # (CUDA: under CUDA graphs the one that compares compilers)
        for row in (r for r in rows if r.mode == mode and r.skipped is None):
            kiln, torch_ = row.measurements.get("kiln"), row.measurements.get("torch")
            if row.failed:
                failed.append(row.model)
            if row.failed or not kiln or not torch_ or not kiln.median_ms or not torch_.median_ms:
                continue
            ratios.append(kiln.median_ms / torch_.median_ms)
            if ratios[-1] > 1.0:
                slower.append(f"{row.model} {ratios[-1]:.2f}")
            if kiln.first_call_s and torch_.first_call_s:
                first.append(kiln.first_call_s / torch_.first_call_s)
            if kiln.peak_mib and torch_.peak_mib:
                memory.append(kiln.peak_mib / torch_.peak_mib)
            if kiln.reserved_mib and torch_.reserved_mib:
                reserved.append(kiln.reserved_mib / torch_.reserved_mib)
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
        lines.append(
            f"| {mode} | {len(ratios)} | {geomean:.3f} | {len(slower)}: {', '.join(slower)} "
            f"| {max(first, default=float('nan')):.3f} | {max(memory, default=float('nan')):.2f} "
            f"| {max(reserved, default=float('nan')):.2f} | {', '.join(failed) or 'none'} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=None, help="cards to spread over")
    parser.add_argument("--suite", default="broad", choices=sorted(SUITES))
    parser.add_argument("--models", help="comma-separated, overrides --suite")
    parser.add_argument("--mode", default="both", choices=("infer", "train", "both"))
    parser.add_argument("--compile-mode")
    parser.add_argument("--compilers", default="torch,kiln")
    parser.add_argument("--device", help="default cuda (cpu runs the groups on the CPU)")
    parser.add_argument("--budget", type=float, default=1.0)
    parser.add_argument("--profile", action="store_true", help="Kiln rows: per-kernel roofline")
    parser.add_argument("--keep", help="folder for the per-card JSON and logs")
    parser.add_argument(
        "--deadline", type=float, help="seconds: then stop the cards and table what finished"
    )
    args = parser.parse_args()
    models = args.models.split(",") if args.models else list(SUITES[args.suite])
    if args.gpus is None:
        import torch

        args.gpus = max(torch.cuda.device_count(), 1)
    scratch = Path(args.keep or tempfile.mkdtemp(prefix="kiln-broad-"))
    scratch.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    groups = assign(models, args.gpus)
    processes = [launch(group, card, args, scratch) for card, group in enumerate(groups)]
    cut: list[int] = []
    for card, process in enumerate(processes):
        left = None if args.deadline is None else args.deadline - (time.perf_counter() - start)
        try:
            process.wait(timeout=None if left is None else max(left, 0.0))
        except subprocess.TimeoutExpired:
            stop(process)
            cut.append(card)
        print(f"card {card} {'cut off' if card in cut else 'done'} (status {process.returncode})"
              f" at {time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
    rows: list[Row] = []
    info, command = {}, ""
    for card in range(len(groups)):
        path = scratch / f"card{card}.json"
        if not path.exists():
            print(f"card {card} wrote no results: see {scratch / f'card{card}.log'}")
            print((scratch / f"card{card}.log").read_text()[-3000:])
            continue
        info, command, card_rows = rows_of(path)
        rows += card_rows
        if card in cut:
            done, planned = len(card_rows), ", ".join(groups[card])
            print(f"card {card} was cut off at the deadline: {done} row(s) finished ({planned})")
    order = {name: index for index, name in enumerate(models)}
    rows.sort(key=lambda row: (row.mode, order.get(row.model, 0)))
    if info:
        launched = " ".join(["python benchmarks/broad.py", *sys.argv[1:]])
        print(format_header(info, f"{launched}` (per card: `{command}"))
    print("\n" + format_table(rows) + "\n\n" + "\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
