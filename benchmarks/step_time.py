"""One compiled model's training or inference step time, for A/B runs of two Kiln trees in
alternating processes (``PYTHONPATH=<tree>``): the first call, the median of several timed
rounds, peak memory and Kiln's launch count, on one line. ``--compiler torch`` times
torch.compile the same way; ``--compile-mode`` is either's ``mode=``.

    for tree in base new base new; do
        PYTHONPATH=$tree python benchmarks/step_time.py --model vit_b_16 --mode train --tag $tree
    done
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.bench.worker import prepare
from kiln.recording import listen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--mode", default="train", choices=["infer", "train"])
    parser.add_argument("--tag", default="")
    parser.add_argument("--compiler", default="kiln", choices=["kiln", "torch"])
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    model, inputs, step = prepare(args.model, args.mode, torch.device("cuda"))
    records: list = []
    listen(records, CompiledProgramRecord)
    start = time.perf_counter()
    compile_fn = kiln.compile if args.compiler == "kiln" else torch.compile
    compiled = compile_fn(model, mode=args.compile_mode)
    step(compiled, inputs)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    for _ in range(3):
        step(compiled, inputs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    collections: list[float] = []  # full (generation 2) collections in the timed rounds, ms
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2 and phase == "start":
            started[0] = time.perf_counter()
        elif info["generation"] == 2:
            collections.append((time.perf_counter() - started[0]) * 1e3)

    gc.callbacks.append(on_gc)
    rounds = []
    for _ in range(args.rounds):
        begin = time.perf_counter()
        for _ in range(args.steps):
            step(compiled, inputs)
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - begin) / args.steps * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**20
    kernels = sum(len(r.program.kernels()) for r in records if r.program)
    print(
        f"{args.tag:8s} {args.model:16s} {args.mode} {args.compile_mode} "
        f"step {statistics.median(rounds):7.2f} ms "
        f"(min {min(rounds):.2f}, max {max(rounds):.2f}) first {first:6.2f} s "
        f"peak {peak:7.0f} MiB kernels {kernels} full gcs {len(collections)} "
        f"({sum(collections):.0f} ms) in {args.rounds * args.steps} steps",
        flush=True,
    )


if __name__ == "__main__":
    main()
