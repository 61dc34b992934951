"""CUDA attention's own backward kernels (``passes.attention_statistics``): gradients against
eager for each kernel PyTorch can pick, then a training step with and without the pass.

1. For the flash, memory-efficient and cuDNN kernels (each forced with ``sdpa_kernel``, for
   Kiln and eager alike), several shapes, causal or not, masks for the memory-efficient one:
   q, k and v's gradients against eager's, and that the compiled training graph called the
   kernel directly (``sdpa_cuda_forward`` / ``sdpa_cuda_backward``, no ``sdpa_backward``).
2. Suite models' training steps (default ViT-B/16 and BERT-base, bf16 autocast), Kiln with
   the pass and without it (the general rule: the forward re-run under autograd), eager
   beside them, interleaved medians in one process; every parameter's gradient checked
   between the two Kiln variants.

    KILN_ARTIFACT_CACHE=0 python benchmarks/attention_backward.py [--models vit_b_16,bert_base]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kiln
import kiln.passes.attention_statistics as attention_statistics
from kiln.ops.attention import sdpa_backward, sdpa_cuda_backward, sdpa_cuda_forward

KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
# (B, H, L, S, E, causal, mask, kv heads): mask None, "float" [B, 1, 1, S] additive or "bool"
# [1, 1, L, S]; fewer kv heads than H is grouped-query attention (enable_gqa)
CASES = [
    (2, 4, 128, 128, 64, False, None, 4),
    (2, 4, 128, 128, 64, True, None, 4),
    (3, 2, 100, 77, 64, False, None, 2),
    (2, 8, 256, 256, 128, True, None, 8),
    (2, 4, 96, 96, 64, False, "float", 4),
    (2, 4, 50, 70, 64, False, "bool", 4),
    (2, 8, 128, 128, 64, False, "rows", 8),
    (2, 8, 128, 128, 64, True, None, 2),
    (2, 8, 100, 77, 128, False, None, 4),
]


def check_kernels(dtype: torch.dtype) -> list[str]:
    failures = []
    for name, backend in KERNELS.items():
        for b, h, length, keys, e, causal, mask_kind, kv in CASES:
            if mask_kind is not None and name != "efficient":  # (the pass: no mask elsewhere)
                continue
            generator = torch.Generator(device="cuda").manual_seed(length * e + keys)

            def make(*shape: int, generator: Any = generator) -> torch.Tensor:
                data = torch.randn(*shape, device="cuda", dtype=dtype, generator=generator)
                return data.requires_grad_(True)

            q, k, v = make(b, h, length, e), make(b, kv, keys, e), make(b, kv, keys, e)
            mask = None
            if mask_kind == "float":
                mask = torch.randn(b, 1, 1, keys, device="cuda", dtype=dtype, generator=generator)
            elif mask_kind == "rows":  # (a decoder's materialized causal mask: [B, 1, L, S])
                mask = torch.randn(
                    b, 1, length, keys, device="cuda", dtype=dtype, generator=generator
                )
            elif mask_kind == "bool":
                mask = torch.rand(1, 1, length, keys, device="cuda", generator=generator) > 0.3
                mask[..., 0] = True
            grad = torch.randn(b, h, length, e, device="cuda", dtype=dtype, generator=generator)

            def attend(q: Any, k: Any, v: Any, mask: Any, causal: bool = causal) -> Any:
                gqa = q.shape[1] != k.shape[1]
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
                )

            label = f"{name} {tuple(q.shape)} S={keys} kv={kv} causal={causal} mask={mask_kind}"
            label += f" {dtype}"
            before = _training_graphs()
            try:
                with sdpa_kernel([backend]):
                    expected = torch.autograd.grad(attend(q, k, v, mask), (q, k, v), grad)
            except RuntimeError as error:  # eager cannot run this kernel here: nothing to check
                print(f"  skip {label}: {str(error)[:100]}")
                continue
            try:
                with sdpa_kernel([backend]):
                    kiln.reset()
                    compiled = kiln.compile(attend, options={"strict": True})
                    for _ in range(2):  # (the second call: the cached entry)
                        got = torch.autograd.grad(compiled(q, k, v, mask), (q, k, v), grad)
            except Exception as error:
                print(f"  FAIL {label}: Kiln raised {type(error).__name__}: {str(error)[:300]}")
                failures.append(label)
                continue
            functions = called_externs(before)
            direct = sdpa_cuda_forward in functions and sdpa_cuda_backward in functions
            worst = max(
                ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
                for a, b in zip(got, expected, strict=True)
            )
            ok = worst < 2e-2 and direct and sdpa_backward not in functions
            print(f"  {'ok  ' if ok else 'FAIL'} {label}: rel err {worst:.2e}, direct {direct}")
            if not ok:
                failures.append(label)
    return failures


def called_externs(before: set[int]) -> set[Any]:
    """The extern functions of the training graphs compiled since ``before`` was taken."""
    found: set[Any] = set()
    for owner in (g for g in _all_training_graphs() if id(g) not in before):
        for graph in (owner.plan.forward, owner.plan.backward):
            for node in graph.nodes:
                if node.op.name == "EXTERN":
                    found.add(node.attrs.fn)
    return found


def _all_training_graphs() -> list[Any]:
    import gc

    from kiln.autodiff.runtime import TrainingGraph

    gc.collect()
    return [obj for obj in gc.get_objects() if isinstance(obj, TrainingGraph)]


def _training_graphs() -> set[int]:
    return {id(graph) for graph in _all_training_graphs()}


def time_models(names: list[str], rounds: int) -> None:
    from kiln.bench.worker import prepare

    original = attention_statistics._kernel

    said: set[str] = set()

    def explained(node: Any) -> Any:
        choice = original(node)
        operands = [
            (tuple(v.type.shape), v.type.dtype, v.type.requires_grad) if v is not None else None
            for v in node.inputs
        ]
        line = f"    sdpa {node.attrs}: {operands} -> kernel {choice}"
        if line not in said:
            said.add(line)
            print(line)
        return choice

    attention_statistics._kernel = explained
    for name in names:
        model, inputs, step = prepare(name, "train", torch.device("cuda"))
        runners: dict[str, Any] = {"eager": model}
        grads: dict[str, list[torch.Tensor]] = {}
        for variant in ("kiln", "kiln (forward re-run)"):
            kiln.reset()
            before = _training_graphs()
            if variant != "kiln":
                attention_statistics._kernel = lambda node: None
            try:
                runner = kiln.compile(model)
                step(runner, inputs)
                step(runner, inputs)
            finally:
                attention_statistics._kernel = explained
            runners[variant] = runner
            grads[variant] = [
                p.grad.detach().clone() for p in model.parameters() if p.grad is not None
            ]
            print(f"  {name} {variant}: attention externs {sorted(_names(called_externs(before)))}")
        worst = max(
            ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
            for a, b in zip(grads["kiln"], grads["kiln (forward re-run)"], strict=True)
        )
        samples: dict[str, list[float]] = {key: [] for key in runners}
        for _ in range(rounds):
            for key, runner in runners.items():
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(5):
                    step(runner, inputs)
                torch.cuda.synchronize()
                samples[key].append((time.perf_counter() - start) / 5 * 1e3)
        medians = {key: statistics.median(values) for key, values in samples.items()}
        print(f"  {name}: {len(grads['kiln'])} parameter gradients, worst rel diff {worst:.2e}")
        print("  | model | eager ms | kiln ms | kiln, forward re-run ms | re-run / kiln |")
        print(
            f"  | {name} | {medians['eager']:.2f} | {medians['kiln']:.2f} | "
            f"{medians['kiln (forward re-run)']:.2f} | "
            f"{medians['kiln (forward re-run)'] / medians['kiln']:.3f} |"
        )


def _names(functions: set[Any]) -> set[str]:
    return {getattr(f, "__name__", str(f)) for f in functions if "sdpa" in str(f)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="vit_b_16,bert_base")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtypes", default="bfloat16,float16")
    args = parser.parse_args()
    print(f"== {torch.cuda.get_device_name()}, torch {torch.__version__}")
    failures = []
    for dtype in args.dtypes.split(","):
        failures += check_kernels(getattr(torch, dtype))
    print(f"== kernel checks: {len(failures)} failed {failures}")
    if args.models:
        time_models(args.models.split(","), args.rounds)
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
