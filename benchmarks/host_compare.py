"""Host time of one compiled call, Kiln against torch.compile, in one process: how long the
Python call takes to return (its kernels queued, not finished) and, for Kiln, how much of it
is the guard function. A model whose GPU work is shorter than its host time is host-bound,
and the bench's per-call timing (events around one call, then a sync) counts all of it.

    python benchmarks/host_compare.py [--models resnet50,bert_base] [--mode infer]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import kiln
from kiln.bench.worker import prepare

CALLS = 3  # back-to-back calls a sample: few enough that the launch queue never fills


def host_ms(step: Callable[[], Any], samples: int = 30) -> tuple[float, float]:
    """Median host milliseconds of one call, and median milliseconds of a synchronized call."""
    host, whole = [], []
    for _ in range(samples):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            step()
        host.append((time.perf_counter() - start) / CALLS * 1e3)
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        whole.append((time.perf_counter() - start) * 1e3)
    return statistics.median(host), statistics.median(whole)


def guard_ms(compiled: Any, model: Any, inputs: Any, step: Any) -> float | None:
    """Milliseconds of the compiled module's first cache entry's guard, evaluated inside the
    benchmark step (its autocast and grad mode are part of what the guard checks)."""
    call = getattr(compiled, "_kiln_call", None)
    cache = getattr(call, "_kiln_cache", None)
    if call is None or cache is None or not cache.entries:
        return None
    entry, fn = cache.entries[0], call.__wrapped__
    seconds: list[float] = []

    def runner(*args: Any) -> Any:
        if entry.guard(fn, model, args, {}):
            start = time.perf_counter()
            for _ in range(200):
                entry.guard(fn, model, args, {})
            seconds.append((time.perf_counter() - start) / 200)
        return compiled(*args)

    step(runner, inputs)
    return seconds[0] * 1e3 if seconds else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="resnet50")
    parser.add_argument("--mode", choices=["infer", "train"], default="infer")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = ["| model | compiler | host ms a call | synced call ms | guard ms |", "| --- |" * 5]
    rows[1] = "| --- | --- | --- | --- | --- |"
    for name in args.models.split(","):
        model, inputs, step = prepare(name, args.mode, device)
        for compiler in ("kiln", "torch"):
            compiled = kiln.compile(model) if compiler == "kiln" else torch.compile(model)
            for _ in range(5):
                step(compiled, inputs)
            host, whole = host_ms(functools.partial(step, compiled, inputs))
            guard = guard_ms(compiled, model, inputs, step) if compiler == "kiln" else None
            guard_text = f"{guard:.3f}" if guard is not None else ""
            rows.append(f"| {name} | {compiler} | {host:.2f} | {whole:.2f} | {guard_text} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
