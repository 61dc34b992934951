"""Host cost of one generated-kernel launch on the GPU, and a check that repeated launches
(the direct path after the first) stay correct.

    python benchmarks/launch_overhead.py [--launches 5000]

Times, per launch of one small pointwise kernel (``relu(x + 1) * 2 + y`` on 4096 floats):
Triton's ``kernel[grid](...)``, and Kiln's launcher (``kiln.runtime.triton_build``). The GPU
work is a few microseconds, so host time dominates; the table is per launch, in microseconds.
Then a compiled function runs 5 times on fresh inputs, on aligned and on misaligned views,
against eager.
"""

from __future__ import annotations

import argparse
import time

import torch

import kiln
from kiln.codegen.triton import generate_triton
from kiln.runtime.triton_build import build_triton


def _fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.relu(x + 1) * 2 + y


def _kernel_and_tensors() -> tuple[object, list[torch.Tensor]]:
    from kiln.backends.kiln import CompiledProgramRecord
    from kiln.recording import listen, unlisten
    from kiln.schedule.loops import Kernel

    records: list = []
    listen(records, CompiledProgramRecord)
    x, y = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
    kiln.compile(_fn)(x, y)
    unlisten(records)
    kernel = next(s for r in records for s in r.program.steps if isinstance(s, Kernel))
    tensors = [torch.empty(4096, device="cuda") for _ in range(3)]
    return kernel, tensors


def _per_launch_us(launch, count: int) -> float:
    for _ in range(100):
        launch()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        launch()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launches", type=int, default=5000)
    args = parser.parse_args()
    kernel, tensors = _kernel_and_tensors()
    source = generate_triton(kernel, interpret=False)
    launcher = build_triton(source)
    function = launcher.function
    options = dict(source.constexprs, num_warps=source.num_warps)
    rows = [
        ("triton kernel[grid](...)", lambda: function[source.grid](*tensors, **options)),
        ("kiln launcher", lambda: launcher(*tensors)),
    ]
    print("| launch path | us per launch |\n| --- | --- |")
    for name, launch in rows:
        print(f"| {name} | {_per_launch_us(launch, args.launches):.1f} |")
    compiled = kiln.compile(_fn)
    worst = 0.0
    for offset in (0, 0, 1, 0, 3):
        base_x = torch.randn(5000, device="cuda")
        base_y = torch.randn(5000, device="cuda")
        x, y = base_x[offset : offset + 4096], base_y[offset : offset + 4096]
        got, want = compiled(x, y), _fn(x, y)
        worst = max(worst, float((got - want).abs().max()))
    print(f"repeated launches on fresh and misaligned inputs: max abs error {worst:.2e}")
    assert worst < 1e-5


if __name__ == "__main__":
    main()
