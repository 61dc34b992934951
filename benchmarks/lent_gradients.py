"""reduce-overhead training with a backward's gradients lent (handed out in the CUDA-graph pool)
against copied out of it (``kiln/runtime/cudagraphs.py``, ``Lending``), in one process,
interleaved: the step time, the memory one step allocates, and a check that both give the same
gradients (the largest difference relative to a gradient's largest magnitude; the lent ones
are read after the copied model's step ran, so a replay that overwrote them would show).

    python benchmarks/lent_gradients.py [--models bert_base_128,gpt2_32,resnet50] [--rounds 5]

Copying is forced by raising ``LEND_AFTER`` while the copying model runs (its runners watch
but never lend); the lending model runs with the default.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

import kiln
from kiln.bench.worker import prepare
from kiln.runtime import cudagraphs

MIB = 1 << 20
DEFAULT_LEND_AFTER = cudagraphs.LEND_AFTER


def _timed(run: Callable[[], Any], steps: int) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / steps


def _step_bytes(run: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def compare(name: str, rounds: int, steps: int) -> str:
    variants: dict[str, tuple[Callable[[], Any], torch.nn.Module]] = {}
    for variant in ("lent", "copied"):
        model, inputs, step = prepare(name, "train", torch.device("cuda"))
        compiled = kiln.compile(model, mode="reduce-overhead")
        lend_after = DEFAULT_LEND_AFTER if variant == "lent" else 10**9

        def run(
            step: Any = step, compiled: Any = compiled, inputs: Any = inputs, n: int = lend_after
        ) -> Any:
            cudagraphs.LEND_AFTER = n
            return step(compiled, inputs)

        variants[variant] = (run, model)
    for _ in range(8):  # warm-up, recording, the checked replays before lending
        for run, _model in variants.values():
            run()
    lent_run, lent_model = variants["lent"]
    copied_run, copied_model = variants["copied"]
    lent_run()
    copied_run()  # (its replays must not touch the lent gradients)
    pairs = zip(lent_model.parameters(), copied_model.parameters(), strict=True)
    # (bit for bit where the kernels are deterministic; cuDNN's weight gradients may not be)
    differ = max(
        float((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-30))
        for a, b in pairs
        if a.grad is not None and b.grad is not None
    )
    lines = [s.line() for s in cudagraphs.statuses() if "backward" in s.graph]
    times: dict[str, list[float]] = {"lent": [], "copied": []}
    for _ in range(rounds):
        for variant, (run, _model) in variants.items():
            times[variant].append(_timed(run, steps))
    memory = {variant: _step_bytes(run) / MIB for variant, (run, _model) in variants.items()}
    cudagraphs.LEND_AFTER = DEFAULT_LEND_AFTER
    lent_ms, copied_ms = (statistics.median(times[v]) for v in ("lent", "copied"))
    return (
        f"| {name} | {lent_ms:.3f} | {copied_ms:.3f} | {copied_ms / lent_ms:.3f} | "
        f"{memory['lent']:.0f} / {memory['copied']:.0f} | {differ:.1e} |\n"
        + "\n".join(f"  {line}" for line in lines)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="bert_base_128,gpt2_32,resnet50")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        rows.append(compare(name, args.rounds, args.steps))
        kiln.reset()
        torch.cuda.empty_cache()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| model | lent ms | copied ms | copied/lent | step MiB lent / copied | grads differ |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
