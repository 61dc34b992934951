"""Where a first call's time goes (capture, passes, scheduling, kernel builds, first
launches, library start-up): ``cProfile`` of ``compiled(*inputs)``'s first call, by cumulative
time. Run it with empty caches to see a cold start::

    TRITON_CACHE_DIR=$(mktemp -d) KILN_CACHE_DIR=$(mktemp -d) \\
        python benchmarks/first_call_profile.py --model resnet50 [--top 60]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.bench.models import MODELS
from kiln.recording import listen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument("--sort", default="cumulative")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = MODELS[args.model]
    workload = spec.build(spec.batch)
    model = workload.model.to(device).eval()
    inputs = [t.to(device) for t in workload.make_input(torch.Generator().manual_seed(0))]
    records: list = []
    listen(records, CompiledProgramRecord)
    compiled = kiln.compile(model)
    profiler = cProfile.Profile()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        start = time.perf_counter()
        profiler.enable()
        compiled(*inputs)
        if device == "cuda":
            torch.cuda.synchronize()
        profiler.disable()
    print(f"== {args.model}: first call {time.perf_counter() - start:.2f} s")
    for record in records:
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in record.phases.items())
        print(f"   {record.graph}: {record.unique_kernels} distinct kernels, {phases}")
    pstats.Stats(profiler).sort_stats(args.sort).print_stats(args.top)


if __name__ == "__main__":
    main()
