"""CUDA attention's own backward kernels (``passes.attention_statistics``): gradients against
float64 for each kernel PyTorch can pick, then a training step with and without the pass.

1. For the flash, memory-efficient and cuDNN kernels (each forced with ``sdpa_kernel``, for
   Kiln and eager alike), several shapes, causal or not, masks (called directly: only the
   memory-efficient kernel's), q, k and v as [B, H, L, E] tensors or transposed [B, L, H, E]
   ones: q, k and v's gradients
   against float64 ones (eager's error beside them), both when the compiled training graph
   calls the kernel directly (``sdpa_cuda_forward`` / ``sdpa_cuda_backward``, no
   ``sdpa_backward``) and under the general rule (the pass off: the forward re-run).
2. Suite models' training steps (default ViT-B/16 and BERT-base, bf16 autocast), Kiln with
   the pass and without it (the general rule: the forward re-run under autograd), eager
   beside them, interleaved medians in one process; every parameter's gradient of both Kiln
   variants checked against eager's (relative norm error: the worst and the median). Both
   variants in one process once made the second one's gradients wrong (PyTorch 2.11's cuDNN
   backward graph cache: ``kiln.ops.attention.laid_out_as``).

    KILN_ARTIFACT_CACHE=0 python benchmarks/attention_backward.py [--models vit_b_16,bert_base]
        [--masks learned,learned_b]
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
# (B, H, L, S, E, causal, mask, kv heads): mask None, "float" [B, 1, 1, S] additive, "bool"
# [1, 1, L, S], or [B, 1, L, S] "rows" (random) and "causal" (0 and the dtype's minimum),
# "learned" [1, H, L, S] and "learned_b" [B, H, L, S] that require grad (T5's position bias);
# fewer kv heads than H is grouped-query attention (enable_gqa)
CASES = [
    (2, 4, 128, 128, 64, False, None, 4),
    (2, 4, 128, 128, 64, True, None, 4),
    (3, 2, 100, 77, 64, False, None, 2),
    (2, 8, 256, 256, 128, True, None, 8),
    (2, 4, 96, 96, 64, False, "float", 4),
    (2, 4, 50, 70, 64, False, "bool", 4),
    (2, 8, 128, 128, 64, False, "rows", 8),
    (2, 8, 128, 128, 64, False, "causal", 8),
    (2, 8, 128, 128, 64, True, None, 2),
    (2, 8, 100, 77, 128, False, None, 4),
    (4, 32, 1024, 1024, 64, False, "causal", 32),  # (a Llama-style training step's)
    (2, 8, 128, 128, 64, False, "learned", 8),
    (2, 4, 100, 77, 64, False, "learned", 4),
    (2, 8, 96, 96, 64, True, "learned_b", 8),
    (16, 8, 512, 512, 64, False, "learned_b", 8),  # (a T5-small training step's)
]


def check_kernels(dtype: torch.dtype, masks: str = "") -> list[str]:
    failures = []
    for name, backend in KERNELS.items():
        for case in CASES:
            if masks and str(case[6]) not in masks.split(","):
                continue
            for layout in ("bhld", "blhd"):
                for rule in ("direct", "general"):
                    failures += check_case(name, backend, case, layout, rule, dtype)
    return failures


def check_case(
    name: str, backend: Any, case: Any, layout: str, rule: str, dtype: torch.dtype
) -> list[str]:
    """One case's q, k and v gradients against eager's under one rule: the kernel's own
    backward ("direct") or the forward re-run under autograd ("general"); q, k, v and the
    incoming gradient laid out as [B, H, L, E] or as a [B, L, H, E] tensor transposed (as
    transformers' attention layers pass them)."""
    b, h, length, keys, e, causal, mask_kind, kv = case
    cudnn_bias = attention_statistics.CUDNN_FLOAT_MASKS and mask_kind != "bool"
    learned = mask_kind is not None and mask_kind.startswith("learned")
    called = name == "efficient" or (name == "cudnn" and cudnn_bias and not learned)
    if rule == "direct" and mask_kind is not None and not called:  # (the general rule's)
        return []
    generator = torch.Generator(device="cuda").manual_seed(length * e + keys)

    def make(b: int, h: int, n: int, e: int, grad: bool = True) -> torch.Tensor:
        shape = (b, h, n, e) if layout == "bhld" else (b, n, h, e)
        data = torch.randn(*shape, device="cuda", dtype=dtype, generator=generator)
        data = data if layout == "bhld" else data.transpose(1, 2)
        return data.detach().requires_grad_(grad)

    q, k, v = make(b, h, length, e), make(b, kv, keys, e), make(b, kv, keys, e)
    mask = None
    if mask_kind == "float":
        mask = torch.randn(b, 1, 1, keys, device="cuda", dtype=dtype, generator=generator)
    elif mask_kind == "rows":  # ([B, 1, L, S], as a decoder's materialized mask)
        mask = torch.randn(b, 1, length, keys, device="cuda", dtype=dtype, generator=generator)
    elif mask_kind == "causal":  # (transformers' causal mask: the dtype's minimum)
        above = torch.ones(length, keys, device="cuda", dtype=torch.bool).triu(1)
        mask = torch.zeros(b, 1, length, keys, device="cuda", dtype=dtype)
        mask.masked_fill_(above, torch.finfo(dtype).min)
    elif learned:
        rows = b if mask_kind == "learned_b" else 1
        mask = torch.randn(rows, h, length, keys, device="cuda", dtype=dtype, generator=generator)
        mask.requires_grad_(True)
    elif mask_kind == "bool":
        mask = torch.rand(1, 1, length, keys, device="cuda", generator=generator) > 0.3
        mask[..., 0] = True
    grad = make(b, h, length, e, grad=False)

    def attend(q: Any, k: Any, v: Any, mask: Any, causal: bool = causal) -> Any:
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
        )

    label = f"{name} {tuple(q.shape)} S={keys} kv={kv} causal={causal} mask={mask_kind}"
    label += f" {layout} {rule} {dtype}"
    before = _training_graphs()
    leaves = (q, k, v, mask) if learned else (q, k, v)
    try:
        with sdpa_kernel([backend]):
            expected = torch.autograd.grad(attend(q, k, v, mask), leaves, grad)
    except RuntimeError as error:  # eager cannot run this kernel here: nothing to check
        print(f"  skip {label}: {str(error)[:100]}")
        return []
    original = attention_statistics._kernel
    if rule == "general":
        attention_statistics._kernel = lambda node: None
    try:
        with sdpa_kernel([backend]):
            kiln.reset()
            compiled = kiln.compile(attend, options={"strict": True})
            calls = [  # (the first call compiles; the second runs the cached entry)
                torch.autograd.grad(compiled(q, k, v, mask), leaves, grad) for _ in range(2)
            ]
    except Exception as error:
        print(f"  FAIL {label}: Kiln raised {type(error).__name__}: {str(error)[:300]}")
        return [label]
    finally:
        attention_statistics._kernel = original
    functions = called_externs(before)
    direct = sdpa_cuda_forward in functions and sdpa_cuda_backward in functions
    exact = truth(q, k, v, mask, causal, grad)
    worst, eager = max(_error(got, exact) for got in calls), _error(expected, exact)
    ran = direct and sdpa_backward not in functions if rule == "direct" else not direct
    ok = worst < 1e-2 and ran
    print(
        f"  {'ok  ' if ok else 'FAIL'} {label}: relative norm error to float64 {worst:.2e} "
        "(the worse of calls 1 and 2) "
        f"(eager's {eager:.2e}), ran {ran}"
    )
    return [] if ok else [label]


def truth(q: Any, k: Any, v: Any, mask: Any, causal: bool, grad: Any) -> tuple[Any, ...]:
    """q's, k's and v's gradients (and a mask's that requires grad) in float64, attention
    written out (the reference: PyTorch 2.11's cuDNN backward can be wrong, eager's
    included)."""
    learned = mask is not None and mask.requires_grad
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    q64, k64, v64 = leaves
    mask64 = mask.detach().double().requires_grad_(True) if learned else mask
    leaves += [mask64] if learned else []
    if q64.shape[1] != k64.shape[1]:
        k64 = k64.repeat_interleave(q64.shape[1] // k64.shape[1], 1)
        v64 = v64.repeat_interleave(q64.shape[1] // v64.shape[1], 1)
    scores = q64 @ k64.transpose(-1, -2) / q64.shape[-1] ** 0.5
    if causal:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(mask.logical_not(), float("-inf"))
    elif mask is not None:
        scores = scores + mask64.double()
    out = scores.softmax(-1) @ v64
    return torch.autograd.grad(out, leaves, grad.double())


def _error(got: Any, exact: Any) -> float:
    return max(
        ((a.double() - b).norm() / b.norm().clamp_min(1e-12)).item()
        for a, b in zip(got, exact, strict=True)
    )


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
        names = [n for n, _ in model.named_parameters()]
        step(model, inputs)
        grads = {"eager": _grads(model)}
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
            grads[variant] = _grads(model)
            print(f"  {name} {variant}: attention externs {sorted(_names(called_externs(before)))}")
        for variant in ("kiln", "kiln (forward re-run)"):  # (bf16 autocast: eager's own noise)
            errors = [
                ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()
                for a, b in zip(grads[variant], grads["eager"], strict=True)
            ]
            worst = max(range(len(errors)), key=errors.__getitem__)
            print(
                f"  {name} {variant}: {len(errors)} gradients against eager, worst relative "
                f"norm error {errors[worst]:.2e} ({names[worst]}), median "
                f"{statistics.median(errors):.2e}"
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
        print("  | model | eager ms | kiln ms | kiln, forward re-run ms | re-run / kiln |")
        print(
            f"  | {name} | {medians['eager']:.2f} | {medians['kiln']:.2f} | "
            f"{medians['kiln (forward re-run)']:.2f} | "
            f"{medians['kiln (forward re-run)'] / medians['kiln']:.3f} |"
        )


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


def _names(functions: set[Any]) -> set[str]:
    return {getattr(f, "__name__", str(f)) for f in functions if "sdpa" in str(f)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="vit_b_16,bert_base")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--no-cudnn-masks", action="store_true", help="no float masks to cuDNN")
    parser.add_argument("--masks", default="", help="only cases of these mask kinds")
    args = parser.parse_args()
    attention_statistics.CUDNN_FLOAT_MASKS = not args.no_cudnn_masks
    print(f"== {torch.cuda.get_device_name()}, torch {torch.__version__}")
    failures = []
    for dtype in args.dtypes.split(","):
        failures += check_kernels(getattr(torch, dtype), args.masks)
    print(f"== kernel checks: {len(failures)} failed {failures}")
    if args.models:
        time_models(args.models.split(","), args.rounds)
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
