"""Grouped and depthwise convolutions on cuDNN: channels-last against NCHW, per pass.

Kiln lays every convolution's operands out channels-last on CUDA. ResNeXt-50's training
profile (H200) showed three grouped weight gradients in channels-last taking 2.44 ms, where
torch.compile, which runs that model in NCHW, took 0.90 ms for them. This script measures,
for every convolution with ``groups > 1`` of a suite model (its shapes found by running the
model once at the suite's batch), the forward, the input gradient and the weight gradient in
both layouts, and what converting the two operands to NCHW and the result back costs, so a
rule (or a measured choice) can be set from data:

    python benchmarks/grouped_conv_layouts.py [--models resnext50,efficientnet_b0]

One row per distinct convolution (how many the model has), microseconds, median of CUDA-event
timings; a last table per model: the sums, and the best of "as is" and "converted".
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

from kiln.bench.models import MODELS

DEVICE = torch.device("cuda")


def grouped_convolutions(name: str) -> list[tuple[Any, ...]]:
    """(input shape, weight shape, stride, padding, dilation, groups) of each grouped
    convolution of a suite model, at its suite batch, in call order."""
    spec = MODELS[name]
    workload = spec.build(spec.batch)
    model = workload.model.to(DEVICE).eval()
    found: list[tuple[Any, ...]] = []

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], _: Any) -> None:
        assert isinstance(module, nn.Conv2d)
        found.append(
            (
                tuple(args[0].shape),
                tuple(module.weight.shape),
                module.stride,
                module.padding,
                module.dilation,
                module.groups,
            )
        )

    handles = [
        m.register_forward_hook(hook)
        for m in model.modules()
        if isinstance(m, nn.Conv2d) and m.groups > 1
    ]
    inputs = [t.to(DEVICE) for t in workload.make_input(torch.Generator().manual_seed(0))]
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        model(*inputs)
    for handle in handles:
        handle.remove()
    return found


def timed(fn: Any, reps: int = 25) -> float:
    for _ in range(3):
        fn()
    if DEVICE.type == "cpu":  # (a smoke run of the script)
        return statistics.median(_wall(fn) for _ in range(3))
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _wall(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def measure(conv: tuple[Any, ...]) -> dict[str, float]:
    shape, weight_shape, stride, padding, dilation, groups = conv
    dtype = torch.bfloat16
    results: dict[str, float] = {}
    for layout in ("nhwc", "nchw"):
        fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
        x = torch.randn(shape, device=DEVICE, dtype=dtype).to(memory_format=fmt)
        w = torch.randn(weight_shape, device=DEVICE, dtype=dtype).to(memory_format=fmt)
        out = torch.ops.aten.convolution(
            x, w, None, stride, padding, dilation, False, [0, 0], groups
        )
        grad = torch.randn_like(out).to(memory_format=fmt)

        def forward(x: Any = x, w: Any = w) -> Any:
            return torch.ops.aten.convolution(
                x, w, None, stride, padding, dilation, False, [0, 0], groups
            )

        def backward(mask: list[bool], x: Any = x, w: Any = w, grad: Any = grad) -> Any:
            return torch.ops.aten.convolution_backward(
                grad, x, w, None, stride, padding, dilation, False, [0, 0], groups, mask
            )

        results[f"{layout} fwd"] = timed(forward)
        results[f"{layout} dgrad"] = timed(lambda: backward([True, False, False]))
        results[f"{layout} wgrad"] = timed(lambda: backward([False, True, False]))
        if layout == "nhwc":  # converting an input-sized and an output-sized tensor
            results["copy x"] = timed(x.contiguous)
            results["copy grad"] = timed(grad.contiguous)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="resnext50,efficientnet_b0,mobilenet_v3,regnet_y")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    card = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    print(f"== {card}, torch {torch.__version__}, bf16, us")
    summary = []
    for name in args.models.split(","):
        convs = grouped_convolutions(name)
        counts: dict[tuple[Any, ...], int] = {}
        for conv in convs:
            counts[conv] = counts.get(conv, 0) + 1
        print(f"\n{name}: {len(convs)} grouped convolutions, {len(counts)} distinct")
        print(
            "| input | weight | stride | groups | n | fwd nhwc / nchw | dgrad nhwc / nchw "
            "| wgrad nhwc / nchw | copy x / grad |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        totals = {"as is": 0.0, "nchw": 0.0, "best": 0.0}
        for conv, n in counts.items():
            r = measure(conv)
            print(
                f"| {list(conv[0])} | {list(conv[1])} | {conv[2][0]} | {conv[5]} | {n} "
                f"| {r['nhwc fwd']:.0f} / {r['nchw fwd']:.0f} "
                f"| {r['nhwc dgrad']:.0f} / {r['nchw dgrad']:.0f} "
                f"| {r['nhwc wgrad']:.0f} / {r['nchw wgrad']:.0f} "
                f"| {r['copy x']:.0f} / {r['copy grad']:.0f} |"
            )
            copies = r["copy x"] + r["copy grad"]
            as_is = r["nhwc fwd"] + r["nhwc dgrad"] + r["nhwc wgrad"]
            # all in NCHW: x and the output in and back, the gradient in, its result back
            nchw = r["nchw fwd"] + r["nchw dgrad"] + r["nchw wgrad"] + 2 * copies
            # only the weight gradient in NCHW: x and the incoming gradient converted
            wgrad_only = as_is - r["nhwc wgrad"] + r["nchw wgrad"] + copies
            totals["as is"] += n * as_is
            totals["nchw"] += n * nchw
            totals["best"] += n * min(as_is, nchw, wgrad_only)
        summary.append((name, totals))
    print("\n| model | channels-last, us a step | NCHW with conversions | best per convolution |")
    print("| --- | --- | --- | --- |")
    for name, t in summary:
        print(f"| {name} | {t['as is']:.0f} | {t['nchw']:.0f} | {t['best']:.0f} |")


if __name__ == "__main__":
    main()
