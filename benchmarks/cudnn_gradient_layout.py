"""PyTorch's cuDNN attention backward with the incoming gradient laid out differently between
two calls of one shape: q's, k's and v's gradients of each call against float64 attention
written out (eager PyTorch only, no Kiln).

On an H100 with torch 2.11.0+cu130 (cuDNN 9.19) the first call is right and a second call
whose gradient has other strides than the first's is wrong (relative error about 1.4): the
backward's cached cuDNN graph is keyed without the gradient's strides. Kiln therefore hands
cuDNN's backward a gradient laid out as the output (``kiln.ops.attention.laid_out_as``).

The second table asks the same of a float mask (cuDNN's additive bias, which Kiln passes it):
two calls of one shape whose masks have other strides or broadcast shapes ([B,H,L,S],
[B,1,L,S] and [1,1,L,S], materialized or expanded), forward and gradients against float64.

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


def exact(q: Any, k: Any, v: Any, grad: Any, mask: Any = None) -> tuple[torch.Tensor, ...]:
    """The output and q's, k's and v's gradients in float64 (causal without a mask)."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    scores = leaves[0] @ leaves[1].transpose(-1, -2) / E**0.5
    if mask is None:
        above = torch.ones(scores.shape[-2:], device="cuda", dtype=torch.bool).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    else:
        scores = scores + mask.double()
    out = scores.softmax(-1) @ leaves[2]
    return (out.detach(), *torch.autograd.grad(out, leaves, grad.double()))


MASKS = ("bhls", "b1ls", "b1ls expanded", "11ls expanded")


def make_mask(kind: str, length: int) -> torch.Tensor:
    shape = {"bh": (B, H), "b1": (B, 1), "11": (1, 1)}[kind[:2]] + (length, length)
    mask = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    return mask.expand(B, H, length, length) if kind.endswith("expanded") else mask


def masks(length: int) -> int:
    """Pairs of calls of one shape with differently laid out masks; the wrong second calls."""
    wrong = 0
    for first in MASKS:
        for second in MASKS:
            length += 16
            q, k, v = (make("bhld", length) for _ in range(3))
            said = []
            for call, kind in enumerate((first, second)):
                mask = make_mask(kind, length)
                leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
                    grad = torch.randn_like(out)
                    got = (out.detach(), *torch.autograd.grad(out, leaves, grad))
                error = max(
                    ((a.double() - b).norm() / b.norm()).item()
                    for a, b in zip(got, exact(q, k, v, grad, mask), strict=True)
                )
                said.append(f"{kind} {error:.1e}")
                wrong += call == 1 and error > 1e-2
            print(f"  mask first {said[0]}; then {said[1]}")
    return wrong


def outputs(length: int) -> int:
    """Pairs of direct backward calls of one shape (the same q, k and v layouts) whose output,
    and gradient with it, are laid out differently: the wrong second calls."""
    wrong = 0
    aten = torch.ops.aten
    for first in ("natural", "contiguous", "blhd"):
        for second in ("natural", "contiguous", "blhd"):
            length += 16
            q, k, v = (make("blhd", length) for _ in range(3))
            said = []
            for call, layout in enumerate((first, second)):
                out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)[
                    :2
                ]
                if layout == "contiguous":
                    out = out.contiguous()
                elif layout == "blhd":
                    out = out.transpose(1, 2).contiguous().transpose(1, 2)
                grad = torch.empty_like(out).copy_(torch.randn(out.shape, device="cuda"))
                none = torch.zeros(2, dtype=torch.int64, device="cuda")
                got = aten._scaled_dot_product_cudnn_attention_backward(
                    grad, q, k, v, out, lse, none, none[0], None, None, None, length, length,
                    0.0, True,
                )  # fmt: skip
                error = max(
                    ((a.double() - b).norm() / b.norm()).item()
                    for a, b in zip(got, exact(q, k, v, grad)[1:], strict=True)
                )
                said.append(f"{layout} {tuple(out.stride())} {error:.1e}")
                wrong += call == 1 and error > 1e-2
            print(f"  output first {said[0]}; then {said[1]}")
    return wrong


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
                        for a, b in zip(got, exact(q, k, v, grad)[1:], strict=True)
                    )
                    same = grad.stride() == out.stride()
                    said.append(f"{layout}{' (= out)' if same else ''} {error:.1e}")
                    wrong += call == 1 and error > 1e-2
                print(f"  q {q_layout}: first {said[0]}; then {said[1]}")
    print(f"== second calls off by more than 1e-2: {wrong} of 18")
    try:
        wrong = masks(length)
    except RuntimeError as error:  # (a cuDNN without masks: nothing to ask)
        print(f"== masks: {error}")
        return
    print(f"== masked second calls off by more than 1e-2: {wrong} of {len(MASKS) ** 2}")
    wrong = outputs(length + 1024)
    print(f"== second calls with the output laid out otherwise off by more than 1e-2: {wrong} of 9")


if __name__ == "__main__":
    main()
