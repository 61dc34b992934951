"""Which GPU kernels one fused case of ``benchmarks/kernels.py`` runs as, and for how long:
``torch.profiler`` over 20 calls of Kiln's compiled case and of a clone of its input (the
copy the shares are taken against), average GPU time per kernel.

    python benchmarks/kernel_split.py --case cross_entropy [--shape 16384x4096]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import kiln
from kiln.bench.kernels import make_cases

CALLS = 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="cross_entropy", help="a prefix of a case's name")
    parser.add_argument("--shape", default="16384x4096")
    args = parser.parse_args()
    rows, cols = (int(n) for n in args.shape.split("x"))
    device = torch.device("cuda")
    cases = make_cases(rows, cols, torch.bfloat16, device)
    case = next(c for c in cases if c.name.startswith(args.case))
    compiled = kiln.compile(case.fn)
    source = case.args[0]
    for _ in range(5):
        compiled(*case.args)
        source.clone()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(CALLS):
            compiled(*case.args)
            source.clone()
        torch.cuda.synchronize()
    print(f"== {case.name}, {args.shape} bf16: GPU time per call")
    for event in profiler.key_averages():
        if event.device_time_total > 0:
            average = event.device_time_total / max(event.count, 1)
            print(f"   {event.key[:60]:60s} x{event.count // CALLS} {average:8.1f} us")


if __name__ == "__main__":
    main()
