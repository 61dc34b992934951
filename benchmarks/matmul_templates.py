"""``mode="max-autotune"``'s matmul templates on a GPU: each product with its epilogue against
eager, the measured choice (library against every tile shape, from the tuning record), and the
time of a call in the default mode (cuBLAS, then the kernel) and with the chosen candidate.

    python benchmarks/matmul_templates.py [--cases gpt2_fc,...]

The cases are the shapes the reference models' linears and attention products take (bf16
autocast), forward and backward, plus ragged sizes.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable

import torch
import torch.nn.functional as F

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.config import config
from kiln.recording import recording


def _linear_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def _linear_residual(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, r: torch.Tensor
) -> torch.Tensor:
    return F.linear(x, w, b) + r


def _gelu_backward(g: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """A backward's ``g @ w`` times an activation's derivative at ``h`` (an input gradient)."""
    s = torch.sigmoid(1.702 * h)
    return (g @ w) * (s + 1.702 * h * s * (1 - s))


def _weight_gradient(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A weight gradient ``g^T @ x`` cast to the float32 parameter's dtype."""
    return (g.t() @ x).float()


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return (torch.bmm(q, k.transpose(1, 2)) * 0.125).to(torch.float32)


def _conv_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, stride: int) -> torch.Tensor:
    """A convolution with BatchNorm folded in (its bias) and ReLU: inference's ResNet block."""
    return F.relu(F.conv2d(x, w, b, stride=stride, padding=w.shape[-1] // 2))


def _depthwise_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.conv2d(x, w, b, padding=w.shape[-1] // 2, groups=x.shape[1]))


def _cases() -> dict[str, tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]]:
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    def image(*shape: int) -> torch.Tensor:
        return t(*shape).to(memory_format=torch.channels_last)

    return {
        "gpt2_fc 8192x768->3072 +gelu": (_linear_gelu, (t(8192, 768), t(3072, 768) / 30, t(3072))),
        "gpt2_proj 8192x3072->768 +res": (
            _linear_residual,
            (t(8192, 3072), t(768, 3072) / 50, t(768), t(8192, 768)),
        ),
        "bert_fc 8192x768->3072 +gelu": (_linear_gelu, (t(8192, 768), t(3072, 768) / 30, t(3072))),
        "vit_fc 12608x768->3072 +gelu": (
            _linear_gelu,
            (t(12608, 768), t(3072, 768) / 30, t(3072)),
        ),
        "gelu_backward 8192x768->3072": (
            _gelu_backward,
            (t(8192, 768), t(768, 3072) / 30, t(8192, 3072)),
        ),
        "weight_grad 3072x8192->768 fp32": (_weight_gradient, (t(8192, 3072), t(8192, 768))),
        "scores 96x1024x64 bmm": (_scores, (t(96, 1024, 64), t(96, 1024, 64))),
        "ragged 1000x700->900 +res": (
            _linear_residual,
            (t(1000, 700), t(900, 700) / 30, t(900), t(1000, 900)),
        ),
        "decode 8x768->3072 +gelu": (_linear_gelu, (t(8, 768), t(3072, 768) / 30, t(3072))),
        "conv3x3 64x64x56x56 +relu": (
            _conv_relu,
            (image(64, 64, 56, 56), image(64, 64, 3, 3) / 24, t(64), 1),
        ),
        "conv1x1 64x256->64x56x56 +relu": (
            _conv_relu,
            (image(64, 256, 56, 56), image(64, 256, 1, 1) / 16, t(64), 1),
        ),
        "conv7x7 stem 64x3x224 s2 +relu": (
            _conv_relu,
            (image(64, 3, 224, 224), image(64, 3, 7, 7) / 12, t(64), 2),
        ),
        "depthwise7x7 64x96x56x56 +gelu": (
            _depthwise_gelu,
            (image(64, 96, 56, 56), image(96, 1, 7, 7) / 7, t(96)),
        ),
        "depthwise3x3 64x144x56x56 +gelu": (
            _depthwise_gelu,
            (image(64, 144, 56, 56), image(144, 1, 3, 3) / 3, t(144)),
        ),
    }


def _time(fn: Callable[..., object], inputs: tuple[torch.Tensor, ...]) -> float:
    from triton.testing import do_bench

    return float(do_bench(lambda: fn(*inputs), warmup=25, rep=200, return_mode="median")) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="comma-separated name prefixes")
    arguments = parser.parse_args()
    config.cache_dir = tempfile.mkdtemp(prefix="kiln-templates-")
    rows = []
    for name, (fn, inputs) in _cases().items():
        if arguments.cases and not any(name.startswith(c) for c in arguments.cases.split(",")):
            continue
        expected = fn(*inputs)
        default = kiln.compile(fn)
        tuned = kiln.compile(fn, mode="max-autotune-no-cudagraphs")
        with recording(CompiledProgramRecord) as records:
            result = tuned(*inputs)
        error = (result.float() - expected.float()).abs().max().item()
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(default(*inputs), expected, atol=0.05 * scale, rtol=0.02)
        torch.testing.assert_close(result, expected, atol=0.05 * scale, rtol=0.02)
        choices = [t for r in records for t in r.tuned if " with " in t.kernel]
        for choice in choices:
            print(f"{name}: {choice.line()}")
        default_us, tuned_us = _time(default, inputs), _time(tuned, inputs)
        chosen = choices[0].chosen if choices else "(no pair)"
        rows.append((name, chosen, default_us, tuned_us, error / max(scale, 1e-30)))
        kiln.reset()
    print()
    print("| case | chosen | default us | max-autotune us | default / tuned | max error / max |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, chosen, default_us, tuned_us, error in rows:
        ratio = default_us / tuned_us
        print(
            f"| {name} | {chosen} | {default_us:.1f} | {tuned_us:.1f} | {ratio:.2f} | {error:.1e} |"
        )


if __name__ == "__main__":
    main()
