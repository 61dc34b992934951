"""PyTorch's cuDNN attention backward with the incoming gradient laid out differently between
two calls of one shape: q's, k's and v's gradients of each call against float64 attention
written out (eager PyTorch only, no Kiln).

On an H100 with torch 2.11.0+cu130 (cuDNN 9.19) the first call is right and a second call
whose gradient has other strides than the first's is wrong (relative error about 1.4): the
backward's cached cuDNN graph is keyed without the gradient's strides. Kiln therefore hands
cuDNN's backward a gradient laid out as the output (``kiln.ops.attention.laid_out_as``).

    python benchmarks/cudnn_gradient_layout.py
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, E = 2, 8, 64
LAYOUTS = ("bhld", "blhd", "as out")


def make(layout: str, length: int) -> torch.Tensor:
    data = torch.randn(B, length, H, E, device="cuda", dtype=torch.bfloat16)
    return data.transpose(1, 2) if layout == "blhd" else data.transpose(1, 2).contiguous()


def exact(q: Any, k: Any, v: Any, grad: Any) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    scores = leaves[0] @ leaves[1].transpose(-1, -2) / E**0.5
    above = torch.ones(scores.shape[-2:], device="cuda", dtype=torch.bool).triu(1)
    out = scores.masked_fill(above, float("-inf")).softmax(-1) @ leaves[2]
    return torch.autograd.grad(out, leaves, grad.double())


def main() -> None:
    print(f"== {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")  # fmt: skip
    length = 64
    wrong = 0
    for q_layout in ("bhld", "blhd"):
        for first in LAYOUTS:
            for second in LAYOUTS:
                length += 16  # (a new shape: nothing cached for it yet)
                q, k, v = (make(q_layout, length) for _ in range(3))
                said = []
                for call, layout in enumerate((first, second)):
                    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
                        grad = torch.randn_like(out) if layout == "as out" else make(layout, length)
                        got = torch.autograd.grad(out, leaves, grad)
                    error = max(
                        ((a.double() - b).norm() / b.norm()).item()
                        for a, b in zip(got, exact(q, k, v, grad), strict=True)
                    )
                    same = grad.stride() == out.stride()
                    said.append(f"{layout}{' (= out)' if same else ''} {error:.1e}")
                    wrong += call == 1 and error > 1e-2
                print(f"  q {q_layout}: first {said[0]}; then {said[1]}")
    print(f"== second calls off by more than 1e-2: {wrong} of 18")


if __name__ == "__main__":
    main()
