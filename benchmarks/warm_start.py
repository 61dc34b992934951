"""Warm start: a model's first compiled step in a fresh process, with empty caches, with the
kernel caches only (``KILN_ARTIFACT_CACHE=0``: capture and the pipeline run again), and with
the artifact cache too (no capture).

    python benchmarks/warm_start.py [--models tiny_gpt,small_cnn] [--mode train] [--device cpu]

Each row runs three child processes on one temporary cache directory; a child times
``kiln.compile`` plus its first step (model construction and imports left out) and reports
its captures and artifact hits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(name: str, mode: str, device: str) -> None:
    import torch

    import kiln
    from kiln.bench.worker import prepare

    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # (bf16 autocast, as kiln bench)
    model, inputs, step = prepare(name, mode, torch.device(device), dtype)
    start = time.perf_counter()
    step(kiln.compile(model), inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    counters = kiln.counters
    print(json.dumps([seconds, counters.captures, counters.artifact_hits]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="tiny_gpt,small_cnn,gpt2_tiny,bert_tiny")
    parser.add_argument("--mode", choices=["infer", "train"], default="infer")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.mode, args.device)
    print(f"first step ({args.mode}, {args.device}): seconds, captures, artifact hits")
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as cache:
            row = []
            for artifacts in ("1", "0", "1"):  # cold, kernels only, kernels and artifacts
                env = dict(os.environ, KILN_CACHE_DIR=cache, KILN_ARTIFACT_CACHE=artifacts)
                command = [sys.executable, __file__, "--child", name, "--mode", args.mode]
                output = subprocess.run(
                    [*command, "--device", args.device], env=env, capture_output=True, text=True
                )
                if output.returncode:
                    sys.exit(output.stderr)
                seconds, captures, hits = json.loads(output.stdout.splitlines()[-1])
                row.append(f"{seconds:6.3f} s ({captures} captures, {hits} hits)")
            print(f"{name:<16} cold {row[0]} | kernels cached {row[1]} | artifacts {row[2]}")


if __name__ == "__main__":
    main()
