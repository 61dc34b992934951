"""Where a cold first call's kernel-build time goes, per Triton stage: Triton's compilation
listener reports each kernel's stage durations (ir = the Python frontend, ttir, ttgir, llir
(with libdevice linking), ptx, cubin = ptxas); C-launcher builds (Triton before 3.7 compiles
one with gcc per signature) and Kiln's stride probes of externs are timed by wrapping them.
Run it with empty caches::

    TRITON_CACHE_DIR=$(mktemp -d) KILN_CACHE_DIR=$(mktemp -d) \\
        python benchmarks/compile_stages.py --model resnet50 [--mode infer|train]

Sums are CPU time summed over kernels (threads overlap them); "span" is the wall time from
the first kernel's start to the last one's end.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict
from typing import Any

import torch

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.bench.worker import prepare
from kiln.recording import listen
from kiln.schedule import layouts

_lock = threading.Lock()
_kernels: list[tuple[str, float, dict[str, float]]] = []  # name, end time, stage -> s
_timed: dict[str, list[tuple[float, float]]] = defaultdict(list)  # what -> (start, s)


def _listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
    if cache_hit:
        return
    stages = {"ir": times.ir_initialization / 1e6}
    stages.update({name: us / 1e6 for name, us in times.lowering_stages})
    stages["store"] = times.store_results / 1e6
    name = getattr(getattr(src, "fn", None), "__name__", "?")
    with _lock:
        _kernels.append((name, time.perf_counter(), stages))


def _timing(what: str, function: Any) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            with _lock:
                _timed[what].append((start, time.perf_counter() - start))

    return timed


def _install() -> None:
    import triton

    triton.knobs.compilation.listener = _listener
    try:
        from triton.backends.nvidia import driver

        driver.CudaLauncher.__init__ = _timing("launcher", driver.CudaLauncher.__init__)
        if hasattr(driver, "compile_module_from_src"):
            driver.compile_module_from_src = _timing("gcc", driver.compile_module_from_src)
    except ImportError:
        pass
    layouts.probe_strides = _timing("stride probes", layouts.probe_strides)
    # The first call's stages, for the timeline (each patched where its caller looks it up).
    from kiln import pipeline
    from kiln.backends import kiln as backend
    from kiln.runtime import triton_build

    pipeline.optimize = _timing("passes", pipeline.optimize)
    backend.schedule = _timing("schedule", backend.schedule)
    backend.build_kernels = _timing("build kernels", backend.build_kernels)
    triton_build._specialize = _timing("specialize", triton_build._specialize)
    triton_build._loaded = _timing("load", triton_build._loaded)
    triton_build._join_parent_warm_up = _timing("join warm-up", triton_build._join_parent_warm_up)
    if hasattr(triton_build, "_WarmUp"):
        warm_up = triton_build._WarmUp
        warm_up._run = _timing("Triton warm-up thread", warm_up._run)  # type: ignore[method-assign]
    else:  # before its steps got their own events
        warm = triton_build._warm_parent  # type: ignore[attr-defined]
        triton_build._warm_parent = _timing("Triton warm-up thread", warm)  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--mode", default="infer", choices=["infer", "train"])
    args = parser.parse_args()
    device = torch.device("cuda")
    _install()
    model, inputs, step = prepare(args.model, args.mode, device)
    records: list[Any] = []
    listen(records, CompiledProgramRecord)
    start = time.perf_counter()  # kiln.compile included, as in kiln.bench's first call
    compiled = kiln.compile(model)
    step(compiled, inputs)
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    print(f"== {args.model} {args.mode}: first call {total:.2f} s")
    for record in records:
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in record.phases.items())
        print(f"   {record.graph}: {record.unique_kernels} distinct kernels, {phases}")
    sums: dict[str, float] = defaultdict(float)
    for _, _, stages in _kernels:
        for stage, seconds in stages.items():
            sums[stage] += seconds
    if _kernels:
        starts = [end - sum(stages.values()) for _, end, stages in _kernels]
        span = max(end for _, end, _ in _kernels) - min(starts)
        print(
            f"   {len(_kernels)} kernels compiled: {sum(sums.values()):.2f} s summed, span "
            f"{span:.2f} s, from {min(starts) - start:.2f} s into the call"
        )
        print("   by stage (s, summed): " + ", ".join(f"{k} {v:.2f}" for k, v in sums.items()))
        slowest = sorted(_kernels, key=lambda k: -sum(k[2].values()))[:8]
        for name, _, stages in slowest:
            detail = " ".join(f"{k}={v:.2f}" for k, v in stages.items())
            print(f"     {sum(stages.values()):.2f} s {name}: {detail}")
    for what, calls in _timed.items():
        first = min(s for s, _ in calls) - start
        print(
            f"   {what}: {len(calls)} calls, {sum(d for _, d in calls):.2f} s summed, "
            f"first at {first:.2f} s"
        )
    print("   timeline (s from kiln.compile; start-end, first five calls of each):")
    events = [(s, d, what) for what, calls in _timed.items() for s, d in calls[:5]]
    for begin, seconds, what in sorted(events):
        print(f"     {begin - start:6.2f}-{begin - start + seconds:6.2f}  {what}")


if __name__ == "__main__":
    main()
