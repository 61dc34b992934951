"""A/B of the C++ kernels' compiler flags: each suite model compiled twice by Kiln in one
process, once with the current flags and once with extra ones, timed interleaved (the same
weights, inputs and step), with a check that both give the same results.

    python benchmarks/cpp_flags.py --extra=-fno-tree-pre [--models small_cnn,gpt2_tiny]
        [--mode infer|train] [--threads 1] [--rounds 7]

Prints, per model, the median step time of each build and their ratio (below 1: the extra
flags are faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import kiln
from kiln.bench.models import SUITES
from kiln.bench.worker import prepare
from kiln.runtime import cpp_build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", required=True, help="space-separated flags to add")
    parser.add_argument("--models", default=",".join(SUITES["cpu"]))
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10, help="steps timed per round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    builds = {"current": cpp_build.COMMON_FLAGS}
    builds["extra"] = (*cpp_build.COMMON_FLAGS, *args.extra.split())
    rows = []
    for name in args.models.split(","):
        model, inputs, step = prepare(name, args.mode, torch.device("cpu"), torch.float32)
        runners = {}
        results = {}
        for label, flags in builds.items():
            saved = cpp_build.COMMON_FLAGS
            cpp_build.COMMON_FLAGS = flags  # the first step builds the kernels
            try:
                runners[label] = kiln.compile(model)
                torch.manual_seed(0)  # (dropout draws alike)
                results[label] = step(runners[label], inputs)
            finally:
                cpp_build.COMMON_FLAGS = saved
        torch.testing.assert_close(results["current"], results["extra"], rtol=1e-5, atol=1e-5)
        times: dict[str, list[float]] = {label: [] for label in builds}
        for _ in range(args.rounds):
            for label, runner in runners.items():
                step(runner, inputs)
                start = time.perf_counter()
                for _ in range(args.calls):
                    step(runner, inputs)
                times[label].append((time.perf_counter() - start) / args.calls * 1e3)
        current, extra = (statistics.median(times[label]) for label in builds)
        rows.append((name, current, extra))
        print(f"{name}: current {current:.3f} ms, extra {extra:.3f} ms", flush=True)
    print(f"\n| model ({args.mode}) | current ms | with {args.extra} ms | ratio |")
    print("| --- | --- | --- | --- |")
    for name, current, extra in rows:
        print(f"| {name} | {current:.3f} | {extra:.3f} | {extra / current:.3f} |")
    ratios = [extra / current for _, current, extra in rows]
    print(f"| geomean | | | {statistics.geometric_mean(ratios):.3f} |")


if __name__ == "__main__":
    main()
