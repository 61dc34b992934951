"""DenseNet's block on the CPU: a channel ``cat`` of channels-last features, BatchNorm in
training and ReLU, forward and backward, Kiln (C++) against eager. For A/B runs of two Kiln
trees in alternating processes (``PYTHONPATH=<tree>``); one thread; microseconds a step, the
best and the median of 7 rounds of 50 steps:

    python benchmarks/cat_batchnorm.py [--compiler kiln|eager] [--size 16] [--inputs 8]
"""

from __future__ import annotations

import argparse
import time

import torch

import kiln


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compiler", default="kiln", choices=["kiln", "eager"])
    parser.add_argument("--size", type=int, default=16, help="image height and width")
    parser.add_argument("--inputs", type=int, default=8, help="a 128-channel one, then 32s")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    widths = [128] + [32] * (args.inputs - 1)
    shape = (2, args.size, args.size)
    pieces = [
        torch.randn(shape[0], w, *shape[1:]).to(memory_format=torch.channels_last).requires_grad_()
        for w in widths
    ]
    channels = sum(widths)
    weight = torch.rand(channels, requires_grad=True)
    bias = torch.randn(channels, requires_grad=True)

    def block(*xs: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.batch_norm(torch.cat(xs, 1), None, None, weight, bias, True)
        return torch.relu(out)

    run = kiln.compile(block, options={"codegen": "cpp"}) if args.compiler == "kiln" else block
    grad = torch.randn(shape[0], channels, *shape[1:]).to(memory_format=torch.channels_last)
    leaves = [*pieces, weight, bias]
    expected = torch.autograd.grad(block(*pieces), leaves, grad)
    got = torch.autograd.grad(run(*pieces), leaves, grad)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for _ in range(20):
        torch.autograd.grad(run(*pieces), leaves, grad)
    rounds = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(50):
            torch.autograd.grad(run(*pieces), leaves, grad)
        rounds.append((time.perf_counter() - start) / 50 * 1e6)
    rounds.sort()
    print(
        f"{args.tag} {args.compiler} {channels} channels {args.size}x{args.size}: "
        f"best {rounds[0]:.0f} us, median {rounds[3]:.0f} us"
    )


if __name__ == "__main__":
    main()
