"""Where a GPU model's first call goes: capture, schedule, kernel builds (with and without the
parallel precompile), first launches.

    python benchmarks/compile_time.py --model gpt2 [--mode infer|train] [--no-precompile]

``KILN_COMPILE_WORKERS=threads`` compiles on threads of this process instead of the worker
processes."""

from __future__ import annotations

import argparse
import time

import torch

import kiln
import kiln.runtime.triton_build as triton_build
from kiln.backends.kiln import CompiledProgramRecord
from kiln.bench.worker import prepare
from kiln.recording import listen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--no-precompile", action="store_true")
    parser.add_argument("--mode", choices=["infer", "train"], default="infer")
    args = parser.parse_args()
    if args.no_precompile:
        triton_build.precompile = lambda *a, **k: None  # type: ignore[assignment]
    model, inputs, step = prepare(args.model, args.mode, torch.device("cuda"))
    records: list = []
    listen(records, CompiledProgramRecord)
    compiled = kiln.compile(model)
    for call in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(compiled, inputs)
        torch.cuda.synchronize()
        print(f"call {call}: {time.perf_counter() - start:.2f} s", flush=True)
    for record in records:
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in record.phases.items())
        print(f"  {record.graph}: {record.unique_kernels} distinct kernels, {phases}")
    compiling = sum(record.seconds for record in records)
    print(f"  backend compile {compiling:.2f} s in all; the rest of call 0 is capture and passes")


if __name__ == "__main__":
    main()
