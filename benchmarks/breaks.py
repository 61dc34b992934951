"""Why a suite model's step breaks its graph or falls back: every graph break and fallback
Kiln records in one step of each model, with its reason and the user's source line.

    python benchmarks/breaks.py --models t5_small,bart_base [--mode train] [--device cuda]
"""

from __future__ import annotations

import argparse

import torch

import kiln
from kiln.bench.worker import prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="t5_small")
    parser.add_argument("--mode", choices=["infer", "train"], default="train")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    for name in args.models.split(","):
        kiln.reset()
        kiln.counters.reset()
        model, inputs, step = prepare(name, args.mode, torch.device(args.device))
        compiled = kiln.compile(model)
        for _ in range(2):
            step(compiled, inputs)
        counters = kiln.counters
        breaks, fallbacks = len(counters.graph_breaks), len(counters.fallbacks)
        print(f"== {name} {args.mode}: {counters.graphs} graph(s), {breaks} break(s), "
              f"{fallbacks} fallback(s)")  # fmt: skip
        for record in [*counters.graph_breaks, *counters.fallbacks]:
            print(f"  {record}")


if __name__ == "__main__":
    main()
