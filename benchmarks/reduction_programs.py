"""How many programs a GPU reduction over channels-last activations should run: a sweep of
``kiln.passes.reduction_split.TARGET_PROGRAMS`` (the program count that chunking of column
reductions aims at) over the reductions of convolutional networks, each against eager and
torch.compile in one process.

Cases, channels-last bf16, batch ``--batch``:
- ``se``: BatchNorm (eval) + SiLU, stored, and its mean over H and W (a squeeze-excitation's
  squeeze, EfficientNet's MBConv), at EfficientNet-B0's shapes;
- ``bn``: BatchNorm in training (statistics over N, H, W) + ReLU, at ResNet-50's shapes.

    python benchmarks/reduction_programs.py [--targets 264,1056] [--batch 128] [--cases se,bn]

Prints a table of milliseconds (median of 20 calls, CUDA events) per shape; every compiled
result is checked against eager's first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

os.environ["KILN_ARTIFACT_CACHE"] = "0"  # a capture kept on disk would bring back its kernels
import kiln
from kiln.passes import reduction_split

SE_SHAPES = [(32, 112), (96, 56), (144, 56), (144, 28), (240, 28), (240, 14), (480, 14),
             (672, 14), (672, 7), (1152, 7)]  # fmt: skip
BN_SHAPES = [(64, 112), (64, 56), (256, 56), (128, 28), (512, 28), (256, 14), (1024, 14),
             (512, 7), (2048, 7)]  # fmt: skip


def _median_ms(fn: Callable[[], object]) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _timed(fn: Callable[..., object], x: torch.Tensor, want: object) -> float:
    """``fn(x)``'s milliseconds, once its result was checked against ``want``."""
    got = torch.utils._pytree.tree_leaves(fn(x))
    for g, w in zip(got, torch.utils._pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=0.05, rtol=0.02)
    return _median_ms(lambda: fn(x))


def _case(name: str, channels: int, device: torch.device) -> Callable[..., object]:
    weight = torch.rand(channels, device=device) + 0.5
    bias = torch.randn(channels, device=device)
    mean = torch.randn(channels, device=device)
    var = torch.rand(channels, device=device) + 0.5
    if name == "se":

        def se(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = F.silu(F.batch_norm(x, mean, var, weight, bias, training=False))
            return y, y.mean((2, 3), keepdim=True)

        return se

    def bn(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.batch_norm(x, None, None, weight, bias, training=True))

    return bn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="264,528,1056,2112")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--cases", default="se,bn")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch._dynamo.config.recompile_limit = 1000  # one compile per shape, never eager
    torch.manual_seed(0)
    device = torch.device("cuda")
    targets = [int(t) for t in args.targets.split(",")]
    header = ["case", "C x H x W", "eager", "torch.compile"] + [f"kiln@{t}" for t in targets]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for case in args.cases.split(","):
        shapes = SE_SHAPES if case == "se" else BN_SHAPES
        batch = args.batch if case == "se" else args.batch // 2
        for channels, size in shapes:
            fn = _case(case, channels, device)
            x = torch.randn(batch, channels, size, size, device=device, dtype=torch.bfloat16)
            x = x.to(memory_format=torch.channels_last)
            with torch.no_grad():
                want = fn(x)
                row = [_timed(fn, x, want), _timed(torch.compile(fn, dynamic=False), x, want)]
                for target in targets:
                    reduction_split.TARGET_PROGRAMS = target
                    kiln.reset()  # compiled entries are kept per code object: start afresh
                    row.append(_timed(kiln.compile(fn), x, want))
                    assert not kiln.counters.fallbacks, kiln.counters.fallbacks
                    assert kiln.counters.graphs == 1, kiln.counters.graphs
            cells = [case, f"{channels}x{size}x{size}"] + [f"{ms:.3f}" for ms in row]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
