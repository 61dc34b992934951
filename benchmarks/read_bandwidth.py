"""How the L2 cache's state before a timed call moves the share of copy bandwidth a read-only
kernel can reach (the cross-entropy case of ``benchmarks/kernels.py`` reads 128 MiB and writes
almost nothing).

Triton's ``do_bench`` (which ``kernels.py`` and TARGETS.md use) clears the L2 before each call
by zeroing a 256 MiB buffer, so a timed kernel starts with the L2 (50 MiB on an H100) full of
dirty lines that its own reads must write back to memory first. This times each function after
three flushes: "dirty" (``do_bench``'s zeroing), "clean" (reading a 256 MiB buffer instead) and
"none" (back to back), CUDA-event medians:

    python benchmarks/read_bandwidth.py [--shape 16384x4096]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

import kiln
from kiln.bench.kernels import make_cases

REPEATS = 200


def median_us(fn: Callable[[], Any], flush: Callable[[], Any] | None) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(REPEATS):
        if flush is not None:
            flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="16384x4096")
    args = parser.parse_args()
    rows, cols = (int(n) for n in args.shape.split("x"))
    device = torch.device("cuda")
    cases = {c.name.split(" ")[0]: c for c in make_cases(rows, cols, torch.bfloat16, device)}
    ce = cases["cross_entropy"]
    x = ce.args[0]
    size = x.numel() * x.element_size()
    scratch = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
    big = torch.empty(2**30, dtype=torch.uint8, device=device)
    big_out = torch.empty_like(big)
    flushes: dict[str, Callable[[], Any] | None] = {
        "dirty (do_bench)": scratch.zero_,
        "clean (read 256 MiB)": lambda: scratch.sum(dtype=torch.int32),
        "none": None,
    }
    compiled = kiln.compile(ce.fn)
    compiled(x)
    functions: list[tuple[str, Callable[[], Any], int]] = [
        ("copy 128 MiB (clone)", x.clone, 2 * size),
        ("copy 1 GiB (copy_)", lambda: big_out.copy_(big), 2 * big.numel()),
        ("torch x.sum() (read only)", x.sum, size),
        ("torch x.amax(-1) (read only)", lambda: x.amax(-1), size),
        ("eager cross_entropy", lambda: ce.fn(x), size),
        ("kiln cross_entropy", lambda: compiled(x), size),
    ]
    header = " | ".join(flushes)
    lines = [f"| function | {header} |", "| --- |" + " --- |" * len(flushes)]
    for name, fn, nbytes in functions:
        cells = []
        for flush in flushes.values():
            us = median_us(fn, flush)
            cells.append(f"{us:.1f} us, {nbytes / us / 1e3:.0f} GB/s")
        lines.append(f"| {name} | {' | '.join(cells)} |")
        print(lines[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, {args.shape} bf16 (GB/s: bytes read + written)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
