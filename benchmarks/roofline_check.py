"""``kiln.explain(fn, *args, profile=True)`` on the GPU: a conv + MLP block whose roofline must
list generated kernels against copy bandwidth and externs against matmul FLOP/s.

    python benchmarks/roofline_check.py
"""

from __future__ import annotations

import torch
from torch import nn

import kiln


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Flatten(),
        nn.Linear(32 * 32 * 32, 256), nn.GELU(), nn.Linear(256, 10),
    ).cuda().eval()  # fmt: skip
    x = torch.randn(64, 16, 32, 32, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        report = kiln.explain(model, x, profile=True)
    print("\n".join(report.profile))
    text = "\n".join(report.profile)
    assert "of copy" in text and "of matmul" in text, "the roofline misses kernels or externs"
    print("roofline check ok")


if __name__ == "__main__":
    main()
