"""A quick GPU smoke check of the kiln backend: a few fused functions and their timings
(first call, steady state) against eager, printed as they go."""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import kiln
from kiln.config import config

config.strict = True


def timed(fn, *args):  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def steady(fn, *args, repeat: int = 50) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    cases = {
        "add_relu": (lambda x, y: torch.relu(x + y) * 2, (x, y)),
        "softmax": (lambda x: torch.softmax(x, -1), (x,)),
        "layer_norm": (lambda x: F.layer_norm(x, (1024,), b, b), (x,)),
        "gelu_bias": (lambda x, y: F.gelu(x + b) + y, (x, y)),
        "mixed_device": (lambda x: (x.cpu() + 1).sum(), (x[:4, :4],)),
    }
    for name, (fn, args) in cases.items():
        compiled = kiln.compile(fn)
        out, first = timed(compiled, *args)
        want = fn(*args)
        error = (out.float() - want.float()).abs().max().item()
        t_kiln, t_eager = steady(compiled, *args), steady(fn, *args)
        print(
            f"{name:12s} err {error:.2e} first {first:.2f}s "
            f"kiln {t_kiln * 1e6:.0f}us eager {t_eager * 1e6:.0f}us",
            flush=True,
        )
    print(kiln.explain(cases["softmax"][0], x).kernels, flush=True)


if __name__ == "__main__":
    sys.exit(main())
