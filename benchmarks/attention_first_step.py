"""Every training step's gradients against float64, the first step included, and each CUDA
attention backward call checked on its own: a diagnostic for attention's backward paths.

``benchmarks/attention_backward.py`` and ``kiln bench`` once judged gradients only after
warm-up steps. A "first-step fault" this script reported (an H100 and H200, PyTorch 2.11,
cuDNN 9.19: a Llama step's first cuDNN backward call with a float mask off by 1.4e3, its
log-sum-exp off by up to 7.0) was the scheduler's layout probe (``schedule.layouts.
probe_strides``), which runs the extern once on uninitialized tensors, seen as a call: probe
calls are left out now. The model's gradients were eager's from the first step.

For each variant in order (one process, ``kiln.reset()`` between them; ``eager`` runs the
model uncompiled):
- the relative norm error of every parameter's gradient to a float64 copy of the model (no
  autocast), after step 1 and after step 2, worst and median, eager bf16 beside them;
- each cuDNN backward call Kiln makes (``sdpa_cuda_backward``) and each re-run
  (``sdpa_backward``): the error of q's, k's and v's gradients to float64 attention written
  out; for the direct calls the log-sum-exp's difference from the one recomputed, and whether
  the output and log-sum-exp changed since their forward call wrote them.

    KILN_ARTIFACT_CACHE=0 python benchmarks/attention_first_step.py --model llama \\
        --variants direct,general [--no-cudnn-masks] [--no-probes] [--no-in-place] [--calls 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
from typing import Any

import torch

import kiln
import kiln.ops.attention as attention
import kiln.passes.attention_statistics as attention_statistics
import kiln.schedule.buffers as buffers
import kiln.schedule.layouts as layouts
from kiln.bench.worker import _step, prepare

SHOWN: dict[str, int] = {}
CALLS = 3  # attention calls shown a variant
PROBING = [False]  # a layout probe runs (on uninitialized tensors: nothing to judge)


def exact_grads(
    q: Any, k: Any, v: Any, mask: Any, grad: Any, scale: float | None, causal: bool = False
) -> Any:
    """q's, k's and v's gradients in float64 (k and v of q's head count: no grouped query)."""
    with torch.enable_grad():
        leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
        scores = leaves[0] @ leaves[1].transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
        if mask is not None:
            scores = scores + mask.double()
        if causal:
            above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(above, float("-inf"))
        return torch.autograd.grad(scores.softmax(-1) @ leaves[2], leaves, grad.double())


def check_call(
    kind: str, got: Any, q: Any, k: Any, v: Any, mask: Any, grad: Any, **extra: Any
) -> None:
    if _fake(q) or PROBING[0]:
        return  # (a typing run, a layout probe)
    seen = SHOWN.get(kind, 0)
    SHOWN[kind] = seen + 1
    if seen >= CALLS or (mask is not None and mask.dtype == torch.bool) or q.shape[1] != k.shape[1]:
        return  # (enough shown; the formula here takes float masks and no grouped query)
    causal = bool(extra.pop("causal", False))
    exact = exact_grads(q, k, v, mask, grad, extra.pop("scale", None), causal)
    error = max(
        ((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, exact, strict=True)
    )
    details = ", ".join(f"{key} {value:.2g}" for key, value in extra.items())
    print(f"    {kind} call {seen}: error to float64 {error:.2e} {details}", flush=True)


# Each cuDNN forward call's output and log-sum-exp, by the log-sum-exp's address: a backward
# call's operands are compared with what its forward wrote, telling a value changed in
# between (a buffer reused too early) from one computed wrong.
FORWARDS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


class _Aten:
    """``torch.ops.aten`` for ``kiln.ops.attention``, checking each cuDNN call."""

    def __getattr__(self, name: str) -> Any:
        op = getattr(torch.ops.aten, name)
        if name == "_scaled_dot_product_cudnn_attention":

            def recorded(*args: Any, **kw: Any) -> Any:
                found = op(*args, **kw)
                show_layouts("forward", q=args[0], out=found[0], lse=found[1])
                if not _fake(found[0]) and not PROBING[0] and len(FORWARDS) < 64:
                    FORWARDS[found[1].data_ptr()] = (found[0].clone(), found[1].clone())
                return found

            return recorded
        if name != "_scaled_dot_product_cudnn_attention_backward":
            return op

        def checked(grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *rest: Any, **kw: Any):
            extra: dict[str, float] = {}
            if not _fake(q) and not PROBING[0]:
                written = FORWARDS.get(lse.data_ptr())
                if written is None:
                    print("    (a backward lse no cuDNN forward call returned)", flush=True)
                else:
                    extra["lse changed since forward"] = (
                        (written[1].reshape(lse.shape) - lse).abs().max().item()
                    )
                    extra["output changed"] = (written[0] - out).abs().max().item()
            show_layouts("backward", q=q, k=k, v=v, mask=rest[2], out=out, grad=grad, lse=lse)
            got = op(grad, q, k, v, out, lse, *rest, **kw)
            mask, scale = rest[2], kw.get("scale")
            extra["causal"] = bool(rest[8])
            if not _fake(q) and not PROBING[0] and SHOWN.get("direct", 0) < CALLS:
                again = torch.ops.aten._scaled_dot_product_cudnn_attention(
                    q, k, v, mask, True, 0.0, False, scale=scale
                )
                extra["lse difference"] = (again[1].reshape(lse.shape) - lse).abs().max().item()
                extra["output difference"] = (again[0].float() - out.float()).abs().max().item()
            check_call("direct", got, q, k, v, mask, grad, scale=scale, **extra)
            return got

        return checked


LAYOUTS_SHOWN: dict[str, int] = {}


def show_layouts(kind: str, **tensors: Any) -> None:
    """The shapes and strides of a variant's first real calls' operands."""
    if PROBING[0] or any(_fake(t) for t in tensors.values() if isinstance(t, torch.Tensor)):
        return
    if LAYOUTS_SHOWN.get(kind, 0) >= 2:
        return
    LAYOUTS_SHOWN[kind] = LAYOUTS_SHOWN.get(kind, 0) + 1
    said = ", ".join(
        f"{name} {tuple(t.shape)}/{tuple(t.stride())}"
        for name, t in tensors.items()
        if isinstance(t, torch.Tensor)
    )
    print(f"    {kind} layouts: {said}", flush=True)


def _fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def main() -> None:
    global CALLS
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama")
    parser.add_argument("--variants", default="direct,general")
    parser.add_argument("--no-cudnn-masks", action="store_true", help="no float masks to cuDNN")
    parser.add_argument("--no-probes", action="store_true", help="no layout probes")
    parser.add_argument("--no-in-place", action="store_true", help="no in-place kernel writes")
    parser.add_argument("--calls", type=int, default=3, help="attention calls shown a variant")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    CALLS = args.calls
    attention_statistics.CUDNN_FLOAT_MASKS = not args.no_cudnn_masks
    probe = layouts.probe_strides

    def marked_probe(*a: Any, **k: Any) -> Any:
        PROBING[0] = True
        try:
            return probe(*a, **k)
        finally:
            PROBING[0] = False

    layouts.probe_strides = marked_probe  # type: ignore[assignment]
    if args.no_probes:
        layouts.probe_strides = lambda *a, **k: None  # type: ignore[assignment]
    if args.no_in_place:
        buffers._in_place_target = lambda *a, **k: None  # type: ignore[assignment]
    attention._aten = _Aten()  # type: ignore[assignment]
    rerun_grads = attention.autograd_grads

    def checked_rerun(outs: Any, leaves: Any, grads: Any) -> Any:
        got = rerun_grads(outs, leaves, grads)
        check_call("general", got, *leaves[:4], grads[0], scale=None)
        return got

    attention.autograd_grads = checked_rerun  # type: ignore[assignment]
    laid_out_as = attention.laid_out_as

    def shown_laid_out_as(out: Any, grad: Any) -> Any:
        given = laid_out_as(out, grad)
        show_layouts("laid_out_as", out=out, grad=grad, given=given)
        return given

    attention.laid_out_as = shown_laid_out_as  # type: ignore[assignment]
    plain_sdpa = attention._sdpa

    def shown_sdpa(attrs: Any, q: Any, k: Any, v: Any, mask: Any) -> Any:
        show_layouts("re-run", q=q, k=k, v=v, mask=mask)
        return plain_sdpa(attrs, q, k, v, mask)

    attention._sdpa = shown_sdpa  # type: ignore[assignment]
    device = torch.device(args.device)
    model, inputs, step = prepare(args.model, "train", device)
    names = [name for name, _ in model.named_parameters()]

    def grads(m: torch.nn.Module) -> list[torch.Tensor]:
        return [
            torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double()
            for p in m.parameters()
        ]

    exact = copy.deepcopy(model).double()
    as64 = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    torch.backends.cuda.matmul.allow_tf32 = False  # (the float64 copy's matmuls: none)
    _step("train", device, torch.float32, list(exact.parameters()))(exact, as64)
    truth = grads(exact)
    del exact

    # (gradients that are zero in exact arithmetic, such as a key projection's bias under
    # softmax, are left out: their relative error is rounding over nothing)
    largest = max(t.norm().item() for t in truth)
    judged = [i for i, t in enumerate(truth) if t.norm().item() > 1e-9 * largest]

    def report(label: str, found: list[torch.Tensor]) -> None:
        errors = [0.0] * len(found)
        for i in judged:
            errors[i] = ((found[i] - truth[i]).norm() / truth[i].norm()).item()
        worst = max(range(len(errors)), key=errors.__getitem__)
        print(
            f"  {label}: worst {errors[worst]:.2e} ({names[worst]}), "
            f"median {statistics.median(errors[i] for i in judged):.2e} "
            f"({len(found) - len(judged)} gradients zero in float64 left out)",
            flush=True,
        )

    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"== {args.model} on {card}, torch {torch.__version__}")
    step(model, inputs)
    report("eager bf16", grads(model))
    original = attention_statistics._kernel
    for variant in args.variants.split(","):
        kiln.reset()
        SHOWN.clear()
        FORWARDS.clear()
        LAYOUTS_SHOWN.clear()
        if variant == "general":
            attention_statistics._kernel = lambda node: None  # type: ignore[assignment]
        try:
            compiled = model if variant == "eager" else kiln.compile(model)
            for number in (1, 2):
                print(f"  -- {variant}, step {number}")
                step(compiled, inputs)
                report(f"kiln {variant} step {number}", grads(model))
        finally:
            attention_statistics._kernel = original


if __name__ == "__main__":
    main()
