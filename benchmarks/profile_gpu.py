"""Where a compiled model's GPU time goes: the top CUDA kernels of Kiln (and eager, and
torch.compile when asked) under torch.profiler, and what Kiln compiled.

    python benchmarks/profile_gpu.py --models gpt2,resnet50 [--compilers kiln,eager,torch]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import kiln
from kiln.backends.kiln import RECORDERS
from kiln.bench.models import MODELS, primary_output


def profile(name: str, compiler: str, top: int) -> None:
    spec = MODELS[name]
    workload = spec.build(spec.batch)
    model = workload.model.cuda().eval()
    inputs = [t.cuda() for t in workload.make_input(torch.Generator().manual_seed(0))]
    if compiler == "kiln":
        run = kiln.compile(model)
    elif compiler == "torch":
        run = torch.compile(model)
    else:
        run = model
    records: list = []
    RECORDERS.append(records)
    with (
        torch.no_grad(),
        torch.autocast("cuda", dtype=torch.bfloat16),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        start = time.perf_counter()
        primary_output(run(*inputs))
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        for _ in range(3):
            run(*inputs)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run(*inputs)
            torch.cuda.synchronize()
    RECORDERS.remove(records)
    print(f"== {name} {compiler}: first call {first:.2f} s", flush=True)
    for warning in caught:
        print(f"   warning: {str(warning.message)[:300]}")
    for record in records:
        kernels = record.program.kernels() if record.program else []
        print(
            f"   graph {record.graph}: {record.codegen}, {len(kernels)} kernels, "
            f"{len(record.program.externs()) if record.program else 0} externs, "
            f"compile {record.seconds:.2f} s {record.fallback}"
        )
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in record.phases.items())
        print(f"   {record.unique_kernels} distinct kernels; {phases}")
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=top, max_name_column_width=60
    )
    print(table, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2")
    parser.add_argument("--compilers", default="kiln")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    for name in args.models.split(","):
        for compiler in args.compilers.split(","):
            profile(name, compiler, args.top)


if __name__ == "__main__":
    main()
