"""Where a host-bound training step's host time goes, phase by phase, without a profiler:
Kiln against torch.compile, each in its own process, the same step as the bench's.

    python benchmarks/host_phases.py --model bert_base_128 --compiler kiln|torch
        [--compile-mode reduce-overhead] [--steps 200]

Each step is timed on the host (no synchronization inside the timed steps): the compiled
call, the eager loss, ``loss.backward()``. For Kiln it also splits the call into the guard
and head (everything before the autograd Function), the Function's forward and its CUDA-graph
runner, and the backward into the Function's backward and its runner; the backward runs on
autograd's device thread, so its phases are summed over that thread's calls. Printed: the
wall time per step of back-to-back steps (before any timer), then medians over ``--steps``
steps, in microseconds, with each step synchronized and back to back, then the calls that
wait for the GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kiln
from kiln.autodiff import runtime
from kiln.bench.models import MODELS, training_loss
from kiln.bench.worker import _input_set, prepare
from kiln.capture.guards import native_guards
from kiln.runtime import cudagraphs

_spans: dict[str, float] = defaultdict(float)


def _timed(owner: Any, name: str, label: str, static: bool = False) -> None:
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _spans[label] += time.perf_counter() - start

    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def _instrument_kiln() -> None:
    _timed(runtime._Function, "forward", "Function.forward", static=True)
    _timed(runtime._Function, "backward", "Function.backward", static=True)
    _timed(runtime.TrainingGraph, "__call__", "TrainingGraph call")
    _timed(cudagraphs.CudaGraphRunner, "__call__", "runners (fwd+bwd)")
    _timed(cudagraphs.CudaGraphRunner, "_replay", "replays (fwd+bwd)")
    for name in ("copy_into", "copy_batches", "copy_out"):
        _timed(cudagraphs, name, name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bert_base_128")
    parser.add_argument("--compiler", choices=["kiln", "torch"], default="kiln")
    parser.add_argument("--compile-mode", default="reduce-overhead")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--input-sets", type=int, default=1, help="cycled, as the bench's 3")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (CPU: a smoke run)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    # (before compiling: a recording keeps its graph's bound replay method)
    if device.type == "cuda":
        _timed(torch.cuda.CUDAGraph, "replay", "CUDAGraph.replay (both)")
    model, first, _ = prepare(args.model, "train", device)
    sets = [first]
    if args.input_sets > 1:
        spec = MODELS[args.model]
        make = spec.build(spec.batch).make_input
        sets += [_input_set(make, index, device) for index in range(1, args.input_sets)]
    turn = [0]
    params = list(model.parameters())
    if args.compiler == "kiln":
        runner: Callable[..., Any] = kiln.compile(model, mode=args.compile_mode)
    else:
        runner = torch.compile(model, mode=args.compile_mode)
    marks = args.compiler == "torch" and args.compile_mode in ("reduce-overhead", "max-autotune")

    def step(times: list[float] | None) -> None:
        inputs = sets[turn[0] % len(sets)]
        turn[0] += 1
        start = time.perf_counter()
        if marks:
            torch.compiler.cudagraph_mark_step_begin()
        for param in params:
            param.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            output = runner(*inputs)
            called = time.perf_counter()
            loss = training_loss(output)
        lossed = time.perf_counter()
        loss.backward()
        done = time.perf_counter()
        if times is not None:
            times.extend([called - start, lossed - called, done - lossed, done - start])

    for _ in range(6):
        step(None)
    native_guards.wait(timeout=120)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(None)
    sync()
    wall = (time.perf_counter() - start) / args.steps * 1e6
    if args.compiler == "kiln":
        _instrument_kiln()
    print(
        f"== {args.model} train {args.compiler} {args.compile_mode}, "
        f"{len(sets)} input set(s): host us per step"
    )
    print(f"   {'back-to-back wall per step':28s} {wall:8.0f}  (before the timers)")
    for synced in (True, False):
        rows: list[list[float]] = []
        for _ in range(3):
            step(None)
        sync()
        _spans.clear()
        for _ in range(args.steps):
            times: list[float] = []
            step(times)
            rows.append(times)
            if synced:  # (each step's host time alone: the queue starts empty)
                sync()
        sync()
        print(f"   -- {'synchronized after each step' if synced else 'back to back'}: medians")
        for column, label in enumerate(["compiled call", "eager loss", "backward()", "whole step"]):
            print(f"   {label:28s} {statistics.median(r[column] for r in rows) * 1e6:8.0f}")
        for label, total in _spans.items():
            print(f"   {label:28s} {total / args.steps * 1e6:8.0f}  (mean)")
    if device.type == "cuda":
        _synchronizing_calls(lambda: step(None))


def _synchronizing_calls(step: Callable[[], None]) -> None:
    """The calls that wait for the GPU in three back-to-back steps (PyTorch's sync debug
    mode), each with the innermost frames of its Python stack."""
    seen: dict[str, int] = {}

    def show(message: Any, *args: Any, **kwargs: Any) -> None:
        if str(message).startswith("Synchronization debug mode is a prototype"):
            return  # (the mode's own notice, not a call that waits)
        frames = traceback.extract_stack()[-9:-2]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[::-1])
        key = f"{str(message)[:60]} at {where}"
        seen[key] = seen.get(key, 0) + 1

    with warnings.catch_warnings():  # (restores showwarning too)
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"   synchronizing calls in 3 steps: {sum(seen.values())}")
    for key, count in seen.items():
        print(f"     x{count} {key}")


if __name__ == "__main__":
    main()
