"""Training steps of many torchvision and timm models compiled by Kiln against eager, on one
device: every parameter's gradient and every buffer after one step, and the
graphs, breaks and fallbacks each model makes. A correctness sweep beyond the suites' models
(run on the GPU machine, which has torchvision and timm):

    PYTHONPATH=. python benchmarks/model_breadth.py [--device cuda] [--models a,b,...]

Prints one row per model: the worst relative gradient error ||g - g64|| / ||g64|| over
parameters against a float64 eager step, Kiln's and eager's (float32, TF32 off, dropout off),
the loss error, the counters, the first break or fallback.
"""

from __future__ import annotations

import argparse
import copy
import time
import traceback
from typing import Any

import torch
import torch.nn.functional as F

import kiln

TORCHVISION = [
    "resnet18",
    "resnet50",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "squeezenet1_1",
    "shufflenet_v2_x0_5",
    "densenet121",
    "regnet_y_400mf",
    "convnext_tiny",
    "mnasnet0_5",
    "googlenet",
    "vgg11_bn",
    "alexnet",
    "swin_t",
    "vit_b_16",
    "maxvit_t",
]
TIMM = [
    "resnet26d",
    "efficientnet_b0",
    "mixnet_s",
    "rexnet_100",
    "ghostnet_100",
    "deit_tiny_patch16_224",
    "convnextv2_atto",
    "poolformer_s12",
    "levit_128s",
    "coat_lite_tiny",
    "mobilevit_xxs",
    "cait_xxs24_224",
    "crossvit_tiny_240",
    "edgenext_xx_small",
    "efficientformer_l1",
    "repvgg_a0",
    "dla34",
    "hrnet_w18_small",
    "nfnet_l0",
    "regnetz_b16",
]


def _build(name: str) -> tuple[torch.nn.Module, int]:
    source, _, model = name.partition(":")
    if source == "tv":
        import torchvision.models as tvm

        side = 224 if model in ("vit_b_16", "swin_t", "maxvit_t") else 96
        return getattr(tvm, model)(num_classes=10, **_tv_kwargs(model)), side
    import timm

    net = timm.create_model(model, pretrained=False, num_classes=10)
    side = net.default_cfg.get("input_size", (3, 224, 224))[-1]
    fixed = any(
        k in model for k in ("deit", "cait", "crossvit", "levit", "coat", "efficientformer")
    )
    return net, side if fixed else min(side, 128)


def _tv_kwargs(model: str) -> dict[str, Any]:
    return {"aux_logits": False, "init_weights": True} if model == "googlenet" else {}


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / (want.double().norm() + 1e-12)).item()


def _without_randomness(model: torch.nn.Module) -> None:
    """Dropout and stochastic depth off: Kiln's random stream differs from eager's by design,
    so only deterministic training steps are compared."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for attribute in ("drop_prob", "p"):  # timm's DropPath, torchvision's StochasticDepth
            if type(module).__name__ in ("DropPath", "StochasticDepth") and hasattr(
                module, attribute
            ):
                setattr(module, attribute, 0.0)


def _gradients(runner: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
    for parameter in model.parameters():
        parameter.grad = None
    loss = F.cross_entropy(_logits(runner(x)).double(), y)
    loss.backward()
    return loss.detach(), [(n, p.grad) for n, p in model.named_parameters()]


def check(
    name: str, device: torch.device, batch: int = 4, randomness: bool = False
) -> dict[str, Any]:
    """One training step (dropout off) in float32 by eager and by Kiln, and in float64 by
    eager: each float32 gradient's distance to float64's, relative to its norm. Kiln is as
    accurate as eager when its error is near eager's (a BatchNorm over few values amplifies
    rounding in both)."""
    kiln.reset()
    torch.manual_seed(0)
    eager, side = _build(name)
    if not randomness:
        _without_randomness(eager)
    eager = eager.to(device).train()
    model, exact = copy.deepcopy(eager), copy.deepcopy(eager).double()
    compiled = kiln.compile(model)
    x = torch.randn(batch, 3, side, side, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    start = time.perf_counter()
    kiln_loss, kiln_grads = _gradients(compiled, model, x, y)
    seconds = time.perf_counter() - start
    _, eager_grads = _gradients(eager, eager, x, y)
    exact_loss, exact_grads = _gradients(exact, exact, x.double(), y)
    worst = {"kiln": 0.0, "eager": 0.0}
    where = ""
    for (pname, got), (_, want), (_, truth) in zip(
        kiln_grads, eager_grads, exact_grads, strict=True
    ):
        if (got is None) != (truth is None):
            worst["kiln"], where = float("inf"), f"{pname}: grad None mismatch"
            continue
        if truth is None or truth.norm() == 0:
            continue
        kiln_error, eager_error = _relative(got, truth), _relative(want, truth)
        if kiln_error > worst["kiln"]:
            worst["kiln"], where = kiln_error, f"{pname} (eager {eager_error:.1e})"
        worst["eager"] = max(worst["eager"], eager_error)
    # Buffers (running statistics) against float64's, Kiln's and eager's: a running mean of
    # about 1e-9 (zero in exact arithmetic) is rounding in both, 5x apart relative to each other.
    buffers, eager_buffers = (
        max(
            (
                _relative(mine, truth)
                for mine, truth in zip(run.buffers(), exact.buffers(), strict=True)
                if truth.is_floating_point()
            ),
            default=0.0,
        )
        for run in (model, eager)
    )
    counters = kiln.counters
    first = [str(r)[:160] for r in [*counters.fallbacks, *counters.graph_breaks][:1]]
    loss_error = abs((kiln_loss - exact_loss).item()) / max(abs(exact_loss.item()), 1e-9)
    return {
        "model": name,
        "grad_err": worst["kiln"],
        "eager_grad_err": worst["eager"],
        "worst_param": where,
        "loss_err": loss_error,
        "buffer_err": buffers,
        "eager_buffer_err": eager_buffers,
        "graphs": counters.graphs,
        "breaks": len(counters.graph_breaks),
        "fallbacks": len(counters.fallbacks),
        "seconds": seconds,
        "note": first[0] if first else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds; later models skipped")
    parser.add_argument(
        "--random",
        action="store_true",
        help="keep dropout and stochastic depth (gradients then differ from eager's by design: "
        "read the graph, break and fallback counts)",
    )
    args = parser.parse_args()
    names = (
        args.models.split(",")
        if args.models
        else [*(f"tv:{m}" for m in TORCHVISION), *(f"timm:{m}" for m in TIMM)]
    )
    device = torch.device(args.device)
    torch.backends.cudnn.allow_tf32 = False  # (float32 convolutions and products in eager too)
    torch.backends.cuda.matmul.allow_tf32 = False
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in names:
        if time.perf_counter() - started > args.budget:
            print(f"{name}: skipped (budget)", flush=True)
            continue
        try:
            row = check(name, device, randomness=args.random)
        except Exception as error:
            row = {"model": name, "error": f"{type(error).__name__}: {error}"[:300]}
            traceback.print_exc()
        rows.append(row)
        print(row, flush=True)
    print(
        "\n| model | grad err | eager's | loss err | buffer err | eager's | graphs | breaks "
        "| fallbacks | s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        if "error" in row:
            print(f"| {row['model']} | ERROR {row['error'][:120]} |")
            continue
        print(
            f"| {row['model']} | {row['grad_err']:.1e} | {row['eager_grad_err']:.1e} | "
            f"{row['loss_err']:.1e} | "
            f"{row['buffer_err']:.1e} | {row['eager_buffer_err']:.1e} | {row['graphs']} | "
            f"{row['breaks']} | {row['fallbacks']} "
            f"| {row['seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()
