"""Normalization modules traced end to end: outputs and buffers match eager.

Each module is traced with ``kiln.frontends.trace`` and run with ``run_traced`` on one copy,
while an identical copy runs eagerly; the outputs and every buffer afterwards (BatchNorm's
running statistics and ``num_batches_tracked`` in training mode) must agree.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import kiln.ops  # noqa: F401  (registers translations)
from kiln.frontends import run_traced, trace
from kiln.ir import Op
from kiln.passes.markers import is_marker

MODULES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], bool]] = {
    "layer_norm": (lambda: nn.LayerNorm(6), (3, 6), False),
    "layer_norm_2d_no_affine": (
        lambda: nn.LayerNorm((4, 5), elementwise_affine=False),
        (2, 4, 5),
        False,
    ),
    "group_norm": (lambda: nn.GroupNorm(2, 6), (3, 6, 4), False),
    "batch_norm_1d_train": (lambda: nn.BatchNorm1d(5), (8, 5), True),
    "batch_norm_1d_3d_input_train": (lambda: nn.BatchNorm1d(4, momentum=0.3), (3, 4, 6), True),
    "batch_norm_2d_train": (lambda: nn.BatchNorm2d(3), (4, 3, 5, 5), True),
    "batch_norm_2d_eval": (lambda: nn.BatchNorm2d(3), (4, 3, 5, 5), False),
    "batch_norm_2d_no_running_stats": (
        lambda: nn.BatchNorm2d(3, track_running_stats=False),
        (2, 3, 4, 4),
        True,
    ),
    "rms_norm": (lambda: nn.RMSNorm(6), (3, 6), False),
    "rms_norm_eps": (lambda: nn.RMSNorm([2, 6], eps=1e-3), (3, 2, 6), False),
}


def _randomize(module: nn.Module) -> None:
    """Non-trivial parameters and running statistics, so a dropped term shows."""
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.rand_like(parameter) + 0.5)
        for name, buffer in module.named_buffers():
            if name.endswith("running_mean"):
                buffer.copy_(torch.randn_like(buffer))
            elif name.endswith("running_var"):
                buffer.copy_(torch.rand_like(buffer) + 0.5)


@pytest.mark.parametrize("name", list(MODULES))
def test_norm_module(name: str) -> None:
    make, shape, training = MODULES[name]
    module = make()
    _randomize(module)
    module.train(training)
    eager, traced = module, copy.deepcopy(module)
    x = torch.randn(shape)

    graph = trace(copy.deepcopy(module), x)
    # (a differentiated BatchNorm's closed-form backward is a marker, not a fallback)
    externs = [n for n in graph.nodes if n.op is Op.EXTERN and not is_marker(n)]
    assert not externs, f"{name} fell back to extern\n{graph}"
    for _ in range(2):  # twice: the second run starts from the updated statistics
        expected = eager(x)
        actual = run_traced(graph, traced, x)
        torch.testing.assert_close(actual, expected)
        for (key, want), (_, got) in zip(
            eager.named_buffers(), traced.named_buffers(), strict=True
        ):
            torch.testing.assert_close(got, want, msg=f"{name}: buffer {key}")
    if training and getattr(module, "track_running_stats", False):
        assert graph.mutations, f"{name}: training BatchNorm must update its buffers"
