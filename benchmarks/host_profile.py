"""Where a compiled model's host (Python) time goes: ``cProfile`` over a few steps of a
model from the bench suites, after warm-up, sorted by own time. For launch-bound models
(ResNet-50 training, ViT) this says what a kernel launch or an extern call costs.

    python benchmarks/host_profile.py --model resnet50 --mode train [--steps 5] [--top 30]
        [--compile-mode reduce-overhead]

In training, CUDA's autograd engine runs the backward on its own thread. Python 3.12's
``cProfile`` (on ``sys.monitoring``) sees every thread; before 3.12 a profiler enabled on the
main thread never sees that one, so the compiled backward gets a second profiler, enabled
inside each call on its thread, reported after the first.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time

import torch

import kiln
from kiln.autodiff import runtime
from kiln.bench.worker import prepare
from kiln.capture.guards import native_guards


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--mode", choices=["infer", "train"], default="train")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--compile-mode", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, inputs, step = prepare(args.model, args.mode, device)
    run = kiln.compile(model, mode=args.compile_mode)
    for _ in range(4):
        step(run, inputs)
    # The steady state checks guards in C++ once that extension is built (5-20 s on a fresh
    # machine); until then they run as Python, 0.45 ms a call for a MobileNet-V3.
    native_guards.wait(timeout=120)
    step(run, inputs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    # A full collection after compiling (about 0.3 s over a transformers model and Kiln's
    # graphs, seen once in 105 T5-small steps by step_time.py) would otherwise land in the
    # few steps timed here: T5-small read 101 ms a step here against 30 ms in the bench.
    gc.collect()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(run, inputs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    plain = (time.perf_counter() - start) / args.steps * 1e3
    profiler, backward_profiler = cProfile.Profile(), cProfile.Profile()
    original = runtime._Function.backward

    def backward(ctx: object, *grads: torch.Tensor) -> object:
        backward_profiler.enable()
        try:
            return original(ctx, *grads)
        finally:
            backward_profiler.disable()

    # (on the CPU the backward runs on the main thread; 3.12 allows one profiler at a time)
    if device.type == "cuda" and sys.version_info < (3, 12):
        runtime._Function.backward = staticmethod(backward)  # type: ignore[assignment]
    try:
        profiler.enable()
        for _ in range(args.steps):
            step(run, inputs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        profiler.disable()
    finally:
        runtime._Function.backward = staticmethod(original)  # type: ignore[assignment]
    print(f"== {args.model} {args.mode}: {plain:.2f} ms per step without the profiler")
    for title, which in (("main thread", profiler), ("compiled backward", backward_profiler)):
        text = io.StringIO()
        try:
            stats = pstats.Stats(which, stream=text)
        except TypeError:  # nothing recorded (inference)
            continue
        stats.sort_stats("tottime").print_stats(args.top)
        print(f"-- {title} ({args.steps} steps)")
        print(text.getvalue()[-8000:])


if __name__ == "__main__":
    main()
