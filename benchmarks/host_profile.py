"""Where a compiled model's host (Python) time goes: ``cProfile`` over a few steps of a
model from the bench suites, after warm-up, sorted by own time. For launch-bound models
(ResNet-50 training, ViT) this says what a kernel launch or an extern call costs.

    python benchmarks/host_profile.py --model resnet50 --mode train [--steps 5] [--top 30]
        [--compile-mode reduce-overhead]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import kiln
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
    start = time.perf_counter()
    for _ in range(args.steps):
        step(run, inputs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    plain = (time.perf_counter() - start) / args.steps * 1e3
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        step(run, inputs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    print(f"== {args.model} {args.mode}: {plain:.2f} ms per step without the profiler")
    print(text.getvalue()[-12000:])


if __name__ == "__main__":
    main()
