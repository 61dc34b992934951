"""What a compiled module's guard function costs, and where: a ResNet-50-shaped model (no
torchvision needed; batch 1, 64x64, CPU), its guard timed alone with the tensors checked in
Python and by the native extension (``kiln/capture/guards/native_guards.py``, built first when it is
not cached), then with only its access paths (the prelude), and without its tensor checks.

    python benchmarks/guard_cost.py
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import kiln
from kiln.capture.guards import native_guards
from kiln.capture.guards.guards import compile_guards


class Bottleneck(nn.Module):
    def __init__(self, inputs: int, width: int, stride: int, down: bool) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(inputs, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (
            nn.Sequential(
                nn.Conv2d(inputs, width * 4, 1, stride, bias=False), nn.BatchNorm2d(width * 4)
            )
            if down
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet50(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        self.relu, self.maxpool = nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        layers, inputs = [], 64
        for width, blocks, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
            first = Bottleneck(inputs, width, stride, True)
            rest = [Bottleneck(width * 4, width, 1, False) for _ in range(blocks - 1)]
            layers.append(nn.Sequential(first, *rest))
            inputs = width * 4
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(2048, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def microseconds(guard: Callable[..., bool], arguments: tuple[Any, ...], calls: int = 500) -> float:
    assert guard(*arguments)
    start = time.perf_counter()
    for _ in range(calls):
        guard(*arguments)
    return (time.perf_counter() - start) / calls * 1e6


def rebuilt(source: str, scope: dict[str, Any], body: str | None) -> Callable[..., bool]:
    """The guard function with its checks replaced by ``body`` (None: ``True``)."""
    head = source.split("        return bool(", 1)[0]
    tail = "    except Exception:\n        return False\n"
    checks = (
        f"        return bool(\n            {body}\n        )\n"
        if body
        else "        return True\n"
    )
    namespace = dict(scope)
    exec(compile(head + checks + tail, "<guard variant>", "exec"), namespace)
    function: Callable[..., bool] = namespace["___guard"]
    return function


def main() -> None:
    native = native_guards.load_now()
    model, x = ResNet50().eval(), torch.randn(1, 3, 64, 64)
    compiled = kiln.compile(model)
    with torch.no_grad():
        compiled(x)
        call = compiled._kiln_call
        entry, fn = call._kiln_cache.entries[0], call.__wrapped__
        arguments: tuple[Any, ...] = (fn, model, (x,), {})
        params = ("self", "args", "kwargs")
        loaded, native_guards._module = native_guards._module, None
        python_guard, source, _ = compile_guards(entry.capture.guards, params)
        native_guards._module = loaded
        scope = python_guard.__globals__
        checks = [line.strip() for line in source.split("\n")]
        checks = [c.removeprefix("and ") for c in checks if c.startswith(("(", "and ("))]
        tensors = [c for c in checks if ".dtype is" in c]
        others = " and ".join(c for c in checks if ".dtype is" not in c)
        print(f"{len(tensors)} tensor checks, {len(checks) - len(tensors)} other checks")
        rows = [
            ("whole guard, Python", python_guard),
            ("access paths only", rebuilt(source, scope, None)),
            ("without tensor checks", rebuilt(source, scope, others)),
        ]
        if native is not None:
            rows.insert(1, ("whole guard, native", compile_guards(entry.capture.guards, params)[0]))
        # The same model compiled with symbolic sizes (batch, height, width): the input's
        # sizes are checked by the size guard (bindings and relations) in Python.
        kiln.reset()
        dynamic = kiln.compile(model, dynamic=True)
        dynamic(x)
        call = dynamic._kiln_call
        entry = call._kiln_cache.entries[0]
        symbolic = (call.__wrapped__, model, (x,), {})
        sizes = [g for g in entry.capture.guards if type(g).__name__ == "SizeGuard"]
        print(f"dynamic=True: {sizes[0].describe() if sizes else 'no symbolic sizes'}")
        for name, guard in rows:
            print(f"{name:22s} {microseconds(guard, arguments):7.1f} us")
        guard = compile_guards(entry.capture.guards, params)[0]
        print(f"{'dynamic=True, whole':22s} {microseconds(guard, symbolic):7.1f} us")


if __name__ == "__main__":
    main()
