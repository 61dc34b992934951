"""Warm start: a model's first compiled step in a fresh process, with empty caches, with the
kernel caches only (``KILN_ARTIFACT_CACHE=0``: capture and the pipeline run again), and with
the artifact cache too (no capture); torch.compile cold and warm (its Inductor, FX-graph and
Triton caches in the same temporary folder) beside it.

    python benchmarks/warm_start.py [--models tiny_gpt,small_cnn] [--mode train] [--device cpu]
        [--compilers kiln,torch] [--profile]

Each row runs its child processes on one temporary cache directory. A child reports:

- ``first``: ``compile`` plus the first step (model construction and imports left out), the
  figure issue 22's target is about (the bench tables' warm-start column);
- ``process``: from the parent starting the child to the first result, minus the model's
  construction (interpreter start and imports included);
- Kiln's captures and artifact hits.

``--profile`` prints, for Kiln's warm (artifact) child, the functions with the most
cumulative time in its first step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(name: str, mode: str, device: str, compiler: str, profile: bool) -> None:
    imported = time.perf_counter()
    import torch

    import kiln
    from kiln.bench.worker import prepare

    imported = time.perf_counter() - imported
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # (bf16 autocast, as kiln bench)
    built = time.perf_counter()
    model, inputs, step = prepare(name, mode, torch.device(device), dtype)
    if device == "cuda":
        torch.cuda.synchronize()
    built = time.perf_counter() - built
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    step(kiln.compile(model) if compiler == "kiln" else torch.compile(model), inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if profiler is not None:
        import pstats

        profiler.disable()
        stats = pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative")
        stats.print_stats(45)
        stats.sort_stats("tottime").print_stats(25)
        stats.print_callers("update' of '_hashlib|method 'read' of '_io.Buff|subprocess.py.*run")
    counters = kiln.counters
    kiln_counts = [counters.captures, counters.artifact_hits, counters.programs_reused]
    print(json.dumps([seconds, built, imported, *kiln_counts]))


def run_child(args: argparse.Namespace, name: str, compiler: str, env: dict, profile: bool) -> str:
    command = [sys.executable, __file__, "--child", name, "--mode", args.mode]
    command += ["--device", args.device, "--compilers", compiler] + ["--profile"] * profile
    start = time.perf_counter()
    output = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if output.returncode:
        sys.exit(output.stderr)
    if profile:
        print(output.stderr[-12000:])
    else:  # what KILN_LOG asked for
        print("".join(line for line in output.stderr.splitlines(True) if line.startswith("[kiln")))
    seconds, built, imported, captures, hits, programs = json.loads(output.stdout.splitlines()[-1])
    text = f"{seconds:6.3f} s (process {wall - built:5.2f} s, imports {imported:4.2f} s"
    kiln_counts = f", {captures} captures, {hits} hits, {programs} programs reused)"
    return text + (kiln_counts if compiler == "kiln" else ")")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="tiny_gpt,small_cnn,gpt2_tiny,bert_tiny")
    parser.add_argument("--mode", choices=["infer", "train"], default="infer")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compilers", default="kiln")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.mode, args.device, args.compilers, args.profile)
    print(f"first step ({args.mode}, {args.device}): seconds (process start to result), counters")
    for name in args.models.split(","):
        for compiler in args.compilers.split(","):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, KILN_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=cache)
                env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
                if compiler == "torch":
                    cold, warm = (run_child(args, name, "torch", env, False) for _ in range(2))
                    print(f"{name:<12} torch  cold {cold} | warm {warm}")
                    continue
                row = []
                for artifacts in ("1", "0", "1"):  # cold, kernels only, kernels and artifacts
                    env["KILN_ARTIFACT_CACHE"] = artifacts
                    profile = args.profile and len(row) == 2
                    row.append(run_child(args, name, "kiln", env, profile))
                print(f"{name:<12} kiln   cold {row[0]} | kernels cached {row[1]}")
                print(f"{'':<12}        artifacts {row[2]}")


if __name__ == "__main__":
    main()
