"""Steady-state cost of programs in symbolic sizes: a model compiled static against the same
model under automatic dynamic (two sizes, so the dim becomes symbolic), timed at a third
size, and under ``dynamic=True`` (every dim symbolic), with eager for reference.

    PYTHONPATH=. python benchmarks/dynamic_steady.py [--device cpu] [--calls 60] [--threads 1]

Below ``HOT_CALLS`` calls at one size (kiln/backends/kiln.py), the symbolic program is what
runs; the timing stops short of it on purpose (``--calls`` plus 3 warm-up calls).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dynamic_shapes import Block, ConvNet

import kiln


def timed(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, calls: int) -> float:
    """Milliseconds a call, after 3 warm-up calls."""
    for _ in range(3):
        fn(x)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    sync()
    return (time.perf_counter() - start) / calls * 1e3


def main(arguments: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    options = parser.parse_args(arguments)
    torch.set_num_threads(options.threads)
    torch.manual_seed(0)
    device = torch.device(options.device)
    workloads: list[tuple[str, torch.nn.Module, Callable[[int], torch.Tensor]]] = [
        ("block (T)", Block(64, 4), lambda t: torch.randn(2, t, 64, device=device)),
        ("cnn (H=W)", ConvNet(), lambda t: torch.randn(2, 3, t, t, device=device)),
    ]
    columns = ["eager", "kiln static", "kiln automatic dynamic", "kiln dynamic=True"]
    print("| workload | " + " | ".join(f"{c} ms" for c in columns) + " |")
    print("| --- | --- | --- | --- | --- |")
    with torch.no_grad():
        for name, model, make in workloads:
            model = model.eval().to(device)
            static, automatic = kiln.compile(model, dynamic=False), kiln.compile(model)
            every = kiln.compile(model, dynamic=True)
            automatic(make(60))
            automatic(make(62))  # (a size change: the dim becomes symbolic)
            x = make(61)
            times = [timed(f, x, options.calls) for f in (model, static, automatic, every)]
            print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in times) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
