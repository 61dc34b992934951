"""Where a CPU step's time goes in Kiln's C++ kernels: each kernel's wall time per step (its
launch wrapped in a timer), beside the step's total and eager's, for one model of ``kiln
bench`` (the ATen externs, convolutions and matmuls, are the rest: profile those with
``torch.profiler``).

    PYTHONPATH=. python benchmarks/cpu_kernel_times.py resnet18_small train [--steps 5] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Any

import torch

import kiln.runtime.cpp_build as cpp_build

_TIMES: dict[str, float] = collections.defaultdict(float)
_COUNTS: collections.Counter[str] = collections.Counter()
_LAUNCHER = cpp_build._launcher


def _timed_launcher(function: Any, name: str, count: int, integers: int) -> Any:
    inner = _LAUNCHER(function, name, count, integers)

    def launch(*arguments: Any) -> None:
        start = time.perf_counter()
        inner(*arguments)
        _TIMES[name] += time.perf_counter() - start
        _COUNTS[name] += 1

    launch.__name__ = name
    return launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("mode", choices=("infer", "train"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    cpp_build._launcher = _timed_launcher  # (before any kernel is built)
    import kiln
    from kiln.backends.kiln import CompiledProgramRecord
    from kiln.bench.models import MODELS, primary_output, training_loss
    from kiln.recording import recording

    spec = MODELS[arguments.model]
    torch.manual_seed(0)
    workload = spec.build(spec.batch)
    model = workload.model.train(arguments.mode == "train")
    inputs = tuple(workload.make_input(torch.Generator().manual_seed(0)))
    params = list(model.parameters())

    def step(runner: Any) -> None:
        if arguments.mode == "infer":
            with torch.no_grad():
                primary_output(runner(*inputs))
            return
        for param in params:
            param.grad = None
        training_loss(runner(*inputs)).backward()

    compiled = kiln.compile(model)
    with recording(CompiledProgramRecord) as records:
        for _ in range(3):
            step(compiled)
            step(model)
    _TIMES.clear()
    _COUNTS.clear()
    walls: dict[str, list[float]] = {"eager": [], "kiln": []}
    for _ in range(arguments.steps):
        for name, runner in (("eager", model), ("kiln", compiled)):
            start = time.perf_counter()
            step(runner)
            walls[name].append(time.perf_counter() - start)
    lines = {}
    for record in records:
        for line in record.kernel_lines():
            parts = line.split(": ", 2)
            if len(parts) == 3:
                lines[parts[1].split(" ")[0]] = line
    steps = arguments.steps
    print(
        f"# {arguments.model} {arguments.mode}: eager "
        f"{statistics.median(walls['eager']) * 1e3:.1f} ms, kiln "
        f"{statistics.median(walls['kiln']) * 1e3:.1f} ms a step, of which C++ kernels "
        f"{sum(_TIMES.values()) / steps * 1e3:.1f} ms"
    )
    for name, seconds in sorted(_TIMES.items(), key=lambda item: -item[1])[: arguments.top]:
        line = lines.get(name, name)
        print(f"{seconds / steps * 1e3:7.2f} ms x{_COUNTS[name] // steps:<3} {line[:150]}")


if __name__ == "__main__":
    main()
