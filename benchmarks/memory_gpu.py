"""Why a compiled model's peak memory is what it is: the peak of one inference or training step
for eager and Kiln (the caching allocator's, as `kiln bench` measures it), and the tensors live
at Kiln's peak with the line that allocated each (a host-program line, or the model's source).

    python benchmarks/memory_gpu.py --models resnet50,gpt2 [--mode infer|train] [--top 12]
        [--compile-mode reduce-overhead] [--compiler kiln|torch]

The allocator's history is recorded for one step after warm-up; its events are replayed to find
the peak and what was live then. The segments reserved after the step are summed by pool (the
default pool, and each CUDA-graph pool), since under CUDA graphs most memory is a pool's.
"""

from __future__ import annotations

import argparse
import linecache
from collections.abc import Callable
from typing import Any

import torch

import kiln
from kiln.bench.worker import prepare

MIB = 1 << 20


def _where(frames: list[dict[str, Any]]) -> str:
    """The most telling frame: Kiln's host program, else the first one outside torch."""
    for frame in frames:
        if frame["filename"].startswith("<kiln wrapper"):
            line = linecache.getline(frame["filename"], frame["line"]).strip()
            return f"wrapper:{frame['line']}: {line[:150]}"
    for frame in frames:
        name = frame["filename"]
        if "/torch/" not in name and "kiln/" not in name and not name.startswith("<"):
            line = linecache.getline(name, frame["line"]).strip()
            return f"{name.rsplit('/', 1)[-1]}:{frame['line']}: {line[:120]}"
    return " < ".join(f"{f['name']}" for f in frames[:4])


def _live_at_peak(trace: list[dict[str, Any]]) -> tuple[int, list[tuple[int, str]]]:
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: list[tuple[int, str]] = []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return peak, sorted(at_peak, key=lambda item: -item[0])


def _peak(step: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def _compiled(model: Any, compiler: str, compile_mode: str) -> Any:
    if compiler == "kiln":
        return kiln.compile(model, mode=compile_mode)
    compiled = torch.compile(model, mode=compile_mode)

    def marked(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return marked


def _pools() -> str:
    """Reserved MiB by pool: ``default`` and each CUDA-graph pool."""
    sizes: dict[str, int] = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        name = "default" if pool == (0, 0) else f"graph pool {pool}"
        sizes[name] = sizes.get(name, 0) + segment["total_size"]
    return ", ".join(f"{name} {size / MIB:.0f}" for name, size in sorted(sizes.items()))


def report(name: str, mode: str, top: int, compiler: str, compile_mode: str) -> None:
    model, inputs, step = prepare(name, mode, torch.device("cuda"))
    compiled = _compiled(model, compiler, compile_mode)
    for _ in range(3):
        step(model, inputs)
        step(compiled, inputs)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    eager = _peak(lambda: step(model, inputs))
    ours = _peak(lambda: step(compiled, inputs))
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    step(compiled, inputs)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, live = _live_at_peak(trace)
    print(
        f"== {name} {mode} {compiler} {compile_mode}: peak MiB eager {eager / MIB:.0f}, "
        f"{compiler} {ours / MIB:.0f}, reserved after it {torch.cuda.memory_reserved() / MIB:.0f} "
        f"({_pools()})"
        f" (allocated before the step {base / MIB:.0f}); step allocations live at the peak: "
        f"{peak / MIB:.0f} MiB in {len(live)} blocks",
        flush=True,
    )
    for size, where in live[:top]:
        print(f"   {size / MIB:8.1f} MiB  {where}")
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2")
    parser.add_argument("--mode", choices=["infer", "train"], default="infer")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--compiler", choices=["kiln", "torch"], default="kiln")
    parser.add_argument("--compile-mode", default="default")
    args = parser.parse_args()
    for name in args.models.split(","):
        report(name, args.mode, args.top, args.compiler, args.compile_mode)


if __name__ == "__main__":
    main()
