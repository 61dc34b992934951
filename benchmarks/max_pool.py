"""ReLU then a 3x3/2 max pool (a ResNet stem's), eager against Kiln and torch.compile in one
process: inference, the forward under autograd, and forward plus backward, each the median of
10 calls after two warm-up calls, checked against eager first.

    python benchmarks/max_pool.py [--device cpu|cuda] [--shape 8,64,112,112] [--nchw]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch

import kiln


def _median_ms(fn: Callable[[], object], device: str) -> float:
    fn()
    fn()
    times = []
    for _ in range(10):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="8,64,112,112")
    parser.add_argument("--nchw", action="store_true", help="contiguous input (default: NHWC)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = tuple(int(s) for s in args.shape.split(","))
    layout = torch.contiguous_format if args.nchw else torch.channels_last
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1))
    x = torch.randn(shape, device=args.device).to(memory_format=layout)
    xg = x.detach().requires_grad_()
    out_shape = model(x).shape
    grad = torch.randn(out_shape, device=args.device).to(memory_format=layout)
    want = model(xg)
    (want_grad,) = torch.autograd.grad(want, xg, grad)
    rows = []
    for name, runner in (
        ("eager", model),
        ("kiln", kiln.compile(model)),
        ("torch.compile", torch.compile(model)),
    ):
        got = runner(xg)
        (got_grad,) = torch.autograd.grad(got, xg, grad)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)
        with torch.no_grad():
            infer = _median_ms(lambda runner=runner: runner(x), args.device)
        forward = _median_ms(lambda runner=runner: runner(xg), args.device)
        both = _median_ms(lambda runner=runner: runner(xg).backward(grad), args.device)
        rows.append((name, infer, forward, both))
    print(f"\n{shape} {'NCHW' if args.nchw else 'NHWC'}, {args.device}, {args.threads} thread(s)")
    print("| compiler | inference ms | forward (grad) ms | forward + backward ms |")
    print("| --- | --- | --- | --- |")
    for name, infer, forward, both in rows:
        print(f"| {name} | {infer:.2f} | {forward:.2f} | {both:.2f} |")


if __name__ == "__main__":
    main()
