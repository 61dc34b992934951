"""A/B of the C++ kernels: each suite model compiled twice by Kiln in one process, once as
it is and once with extra compiler flags or with a module constant of Kiln's set otherwise
while it compiles, timed interleaved (the same weights, inputs and step), with a check that
both give the same results.

    python benchmarks/cpp_flags.py --extra=-fno-tree-pre [--models small_cnn,gpt2_tiny]
        [--mode infer|train] [--threads 1] [--rounds 7]
    python benchmarks/cpp_flags.py --set kiln.codegen.cpp.LANE_FLAG_LIMIT=0

Prints, per model, the median step time of each build and their ratio (below 1: the variant
is faster).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import statistics
import time
import warnings
from typing import TYPE_CHECKING

import torch

import kiln
from kiln.bench.models import SUITES
from kiln.bench.worker import prepare
from kiln.runtime import cpp_build

if TYPE_CHECKING:
    from collections.abc import Iterator


@contextlib.contextmanager
def _variant(extra: str, setting: str) -> Iterator[None]:
    """Compiles inside run with ``extra`` flags and ``setting`` (``module.NAME=value``)."""
    saved_flags = cpp_build.COMMON_FLAGS
    cpp_build.COMMON_FLAGS = (*saved_flags, *extra.split())
    module = name = saved = None
    if setting:
        path, text = setting.split("=", 1)
        module_name, name = path.rsplit(".", 1)
        module = importlib.import_module(module_name)
        saved = getattr(module, name)
        setattr(module, name, ast.literal_eval(text))
    try:
        yield
    finally:
        cpp_build.COMMON_FLAGS = saved_flags
        if module is not None and name is not None:
            setattr(module, name, saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", default="", help="space-separated flags to add")
    parser.add_argument("--set", default="", help="module.NAME=value for the variant")
    parser.add_argument("--models", default=",".join(SUITES["cpu"]))
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10, help="steps timed per round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    builds = {"current": contextlib.nullcontext, "variant": lambda: _variant(args.extra, args.set)}
    rows = []
    for name in args.models.split(","):
        model, inputs, step = prepare(name, args.mode, torch.device("cpu"), torch.float32)
        runners = {}
        results = {}
        for label, build in builds.items():
            with build():  # the first step compiles and builds the kernels
                runners[label] = kiln.compile(model)
                torch.manual_seed(0)  # (dropout draws alike)
                results[label] = step(runners[label], inputs)
        torch.testing.assert_close(results["current"], results["variant"], rtol=1e-5, atol=1e-5)
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
        print(f"{name}: current {current:.3f} ms, variant {extra:.3f} ms", flush=True)
    variant = " ".join(part for part in (args.extra, args.set) if part)
    print(f"\n| model ({args.mode}) | current ms | with {variant} ms | ratio |")
    print("| --- | --- | --- | --- |")
    for name, current, extra in rows:
        print(f"| {name} | {current:.3f} | {extra:.3f} | {extra / current:.3f} |")
    ratios = [extra / current for _, current, extra in rows]
    print(f"| geomean | | | {statistics.geometric_mean(ratios):.3f} |")


if __name__ == "__main__":
    main()
