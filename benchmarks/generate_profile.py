"""Where a ``generate`` token's time goes: GPT-2 (``dynamic_shapes.py``'s model) decoding with the
static or dynamic key-value cache, per compiler: wall time per token, GPU busy time per token
(the rest is host time), launches per token and the top CUDA kernels, from one profiled
``generate`` after a warm-up one.

    python benchmarks/generate_profile.py --batch 8 --cache static [--compilers eager,kiln,torch]
        [--tokens 32] [--top 12] [--size small] [--host 25]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dynamic_shapes as ds
from profile_gpu import kind_of

import kiln


def profile(compiler: str, arguments: argparse.Namespace) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings = ds.Settings(device, True, 1, arguments.size, [arguments.batch], "")
    model = ds.gpt2(settings)
    kiln.reset()
    torch._dynamo.reset()
    if compiler == "kiln":
        model.forward = kiln.compile(model.forward)
    elif compiler == "torch":
        model.forward = torch.compile(model.forward)
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (arguments.batch, 16), device=device)
    options: dict[str, Any] = ds.generate_options(arguments.cache, arguments.tokens)
    options["attention_mask"] = torch.ones_like(ids)
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, **options)  # warm-up: compiles
        first = time.perf_counter() - start
        model.generate(ids, **options)
        torch.cuda.synchronize() if device.type == "cuda" else None
        start = time.perf_counter()
        model.generate(ids, **options)
        torch.cuda.synchronize() if device.type == "cuda" else None
        wall = (time.perf_counter() - start) / arguments.tokens * 1e3
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            model.generate(ids, **options)
            torch.cuda.synchronize() if device.type == "cuda" else None
        if arguments.host:  # where the host's time goes, by function
            import cProfile
            import io
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            model.generate(ids, **options)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(arguments.host)
            host = text.getvalue()
    events = [
        e
        for e in prof.key_averages()
        if e.self_device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA
    ]
    per_token = arguments.tokens
    by_kind: dict[str, float] = defaultdict(float)
    launches = 0
    for event in events:
        by_kind[kind_of(event.key)] += event.self_device_time_total / per_token / 1e3
        launches += event.count
    busy = sum(by_kind.values())
    kinds = ", ".join(f"{k} {ms:.3f}" for k, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]))
    lines = [
        f"== {compiler} bs{arguments.batch} {arguments.cache} cache: first generate {first:.1f} s, "
        f"{wall:.2f} ms/token wall, GPU busy {busy:.2f} ms/token ({kinds}), "
        f"{launches / per_token:.0f} launches/token"
    ]
    if compiler == "kiln":
        lines.append(
            f"   captures {kiln.counters.captures}, graphs {kiln.counters.graphs}, "
            f"recompiles {len(kiln.counters.recompiles)}, fallbacks {len(kiln.counters.fallbacks)}"
        )
    for event in sorted(events, key=lambda e: -e.self_device_time_total)[: arguments.top]:
        lines.append(
            f"   {event.self_device_time_total / per_token / 1e3:7.3f} ms/token "
            f"x{event.count / per_token:<5.1f} [{kind_of(event.key)}] {event.key[:100]}"
        )
    if arguments.host:
        lines.append(host.strip())
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cache", choices=("static", "dynamic"), default="static")
    parser.add_argument("--compilers", default="eager,kiln,torch")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    parser.add_argument("--host", type=int, default=0, help="cProfile: print this many rows")
    arguments = parser.parse_args()
    for compiler in arguments.compilers.split(","):
        print(profile(compiler, arguments), flush=True)


if __name__ == "__main__":
    main()
