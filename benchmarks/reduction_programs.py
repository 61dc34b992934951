"""How many programs a GPU reduction over channels-last activations should run: a sweep of
``kiln.passes.reduction_split.TARGET_PROGRAMS`` (the program count that chunking of column
reductions aims at) over the reductions of convolutional networks, each against eager and
torch.compile in one process.

Cases, channels-last bf16, batch ``--batch``:
- ``se``: BatchNorm (eval) + SiLU, stored, and its mean over H and W (a squeeze-excitation's
  squeeze, EfficientNet's MBConv), at EfficientNet-B0's shapes;
- ``bn``: BatchNorm in training (statistics over N, H, W) + ReLU, at ResNet-50's shapes;
- ``bnb``: the same, forward and backward (the gradients of the input, weight and bias).

    python benchmarks/reduction_programs.py [--targets 264,1056] [--batch 128] [--cases se,bn,bnb]
        [--shapes 64x112,256x56] [--compile-mode reduce-overhead]

Prints a table of milliseconds (median of 20 calls, CUDA events) per shape; every compiled
result is checked against eager's first.
"""

from __future__ import annotations

import argparse
import functools
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
    _check(fn(x), want)  # (nothing of it kept: under reduce-overhead a replay reuses it)
    return _median_ms(lambda: fn(x))


def _check(got: object, want: object) -> None:
    leaves = torch.utils._pytree.tree_leaves
    for g, w in zip(leaves(got), leaves(want), strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=0.05, rtol=0.02)


def _case(name: str, channels: int, device: torch.device) -> Callable[..., object]:
    weight = torch.rand(channels, device=device) + 0.5
    bias = torch.randn(channels, device=device)
    if name == "bnb":
        weight.requires_grad_(True)
        bias.requires_grad_(True)
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


def _same(fn: Callable[..., object]) -> Callable[..., object]:
    return fn


_GRADS: dict[tuple[object, ...], torch.Tensor] = {}


def _with_backward(fn: Callable[..., object], like: Callable[..., object]) -> Callable[..., object]:
    """``fn``'s forward and backward: the gradients of ``x`` and of the parameters that
    ``like`` (the uncompiled ``fn``) closes over, for a fixed random output gradient."""
    cells = like.__closure__ or ()  # type: ignore[attr-defined]
    params = [c.cell_contents for c in cells if isinstance(c.cell_contents, torch.Tensor)]
    params = [p for p in params if p.requires_grad]

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = x.detach().requires_grad_(True)
        out = fn(x)
        key = (tuple(x.shape), x.dtype, x.device)
        if key not in _GRADS:  # (made once, laid out as x, as a network's gradient: not timed)
            seeded = torch.Generator(device=x.device).manual_seed(0)
            grad = torch.randn(x.shape, generator=seeded, device=x.device, dtype=x.dtype)
            _GRADS[key] = grad.to(memory_format=torch.channels_last)
        return torch.autograd.grad(out, (x, *params), _GRADS[key])

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="264,528,1056,2112")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--cases", default="se,bn")
    parser.add_argument("--shapes", default="", help="CxS,... (default: all of the case's)")
    parser.add_argument("--compile-mode", default="default", help="both compilers' mode=")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch._dynamo.config.recompile_limit = 1000  # one compile per shape, never eager
    torch.manual_seed(0)
    device = torch.device("cuda")
    targets = [int(t) for t in args.targets.split(",")]
    mode = args.compile_mode
    header = ["case", "C x H x W", "eager", "torch.compile"] + [f"kiln@{t}" for t in targets]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for case in args.cases.split(","):
        shapes = SE_SHAPES if case == "se" else BN_SHAPES
        batch = args.batch if case == "se" else args.batch // 2
        chosen = {
            tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",") if shape
        }
        for channels, size in shapes:
            if chosen and (channels, size) not in chosen:
                continue
            fn = _case(case, channels, device)
            x = torch.randn(batch, channels, size, size, device=device, dtype=torch.bfloat16)
            x = x.to(memory_format=torch.channels_last)
            backward = case == "bnb"
            wrap = functools.partial(_with_backward, like=fn) if backward else _same
            with torch.set_grad_enabled(backward):
                want = wrap(fn)(x)
                row = [_timed(wrap(fn), x, want)]
                row.append(_timed(wrap(torch.compile(fn, dynamic=False, mode=mode)), x, want))
                for target in targets:
                    reduction_split.TARGET_PROGRAMS = target
                    kiln.reset()  # compiled entries are kept per code object: start afresh
                    row.append(_timed(wrap(kiln.compile(fn, mode=mode)), x, want))
                    assert not kiln.counters.fallbacks, kiln.counters.fallbacks
                    assert kiln.counters.graphs == 1, kiln.counters.graphs
            cells = [case, f"{channels}x{size}x{size}"] + [f"{ms:.3f}" for ms in row]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
