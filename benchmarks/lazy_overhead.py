"""Per-step host overhead of ``kiln.lazy`` against ``kiln.compile`` on the same SGD training
loop of an MLP (CPU), with eager PyTorch as the reference. Sizes are small, so a step's time
is mostly host work: for lazy, recording every op into the step graph (``record``) and the
step itself (``mark_step``: closing the graph, structural hash, cache lookup, running the
compiled program); for ``kiln.compile``, guards, the compiled forward and backward, and the
optimizer's eager update.

    python benchmarks/lazy_overhead.py [--steps 50] [--width 16]

Seen on the shared 2-core CPU dev box (torch 2.13 CPU, one thread, load ~2.7, 2026-11-27),
median us a step, 16-16-2 / 256-256-2 (batch 32 / 64): eager 88 / 315, kiln.compile(model)
114 / 297, kiln.lazy 1,491 / 1,715 (recording 1,204 / 1,252, mark_step 286 / 463); one
compile, every other step a cache hit. Recording (the frontend's dispatch, ~50 us a torch
call, and the backward's VJPs) dominates; under load (~5) the same runs measured 2-4x more.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import kiln
from kiln import lazy


def _mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)
    )


def _loop(
    model: torch.nn.Module, forward: Callable[..., torch.Tensor], move: Callable[..., torch.Tensor]
) -> Callable[[torch.Tensor, torch.Tensor], tuple[float, float]]:
    """One training step; returns (seconds until mark_step, seconds of mark_step)."""
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        start = time.perf_counter()
        loss = F.mse_loss(forward(move(x)), move(y))
        loss.backward()
        sgd.step()
        sgd.zero_grad()
        recorded = time.perf_counter()
        if move is lazy.to_lazy:
            lazy.mark_step()
        return recorded - start, time.perf_counter() - recorded

    return step


def _measure(step: Callable[..., tuple[float, float]], batches: list[torch.Tensor]) -> list[float]:
    for x in batches[:3]:  # (first calls compile)
        step(x, x[:, :2])
    times = [step(x, x[:, :2]) for x in batches[3:]]
    return [statistics.median(part) * 1e6 for part in zip(*times, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    options = parser.parse_args()
    torch.set_num_threads(1)
    batches = [torch.randn(options.batch, options.width) for _ in range(options.steps + 3)]
    identity: Callable[..., torch.Tensor] = lambda t: t
    eager = _mlp(options.width)
    compiled = _mlp(options.width)
    lazy_model = lazy.to_lazy(_mlp(options.width))
    rows = {
        "eager": _measure(_loop(eager, eager, identity), batches),
        "kiln.lazy": _measure(_loop(lazy_model, lazy_model, lazy.to_lazy), batches),
        "kiln.compile(model)": _measure(_loop(compiled, kiln.compile(compiled), identity), batches),
    }
    print(f"MLP {options.width}-{options.width}-2, batch {options.batch}, one thread, median us")
    print(f"{'loop':<22}{'step':>10}{'record':>10}{'mark_step':>11}")
    for name, (record, mark) in rows.items():
        marked = f"{mark:>11.0f}" if name == "kiln.lazy" else f"{'':>11}"
        print(f"{name:<22}{record + mark:>10.0f}{record:>10.0f}{marked}")
    print(f"lazy: {lazy.counters}")


if __name__ == "__main__":
    main()
