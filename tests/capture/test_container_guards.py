"""Reading a container's contents guards them: after a dict, set, deque or container module
gains an item, the compiled call captures again instead of returning the stale result.

Each case compiles a function that reads a container, calls it, changes the container and
calls it again with a fresh input: the result must be eager's, after exactly one recompile.
(Found by a user-like run: a ``Sequential`` of one convolution, then one of a convolution and
a BatchNorm, in a second process, reused the first one's graph and skipped the BatchNorm.)
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import kiln
from kiln.config import config

Case = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], Any]]


def _dict_values() -> Case:
    table = {"a": 1.0}
    return (lambda x: x + sum(v for v in table.values())), lambda: table.update(z=5.0)


def _dict_items() -> Case:
    table = {"a": 1.0}
    return (lambda x: x + sum(v for _, v in table.items())), lambda: table.update(z=5.0)


def _dict_keys() -> Case:
    table = {"a": 1.0}
    keys = lambda x: x + sum(len(k) for k in table.keys())  # noqa: SIM118 (the method)
    return keys, lambda: table.update(zz=5.0)


def _dict_get_missing() -> Case:
    table = {"a": 1.0}
    return (lambda x: x + table.get("z", 0.0)), lambda: table.update(z=5.0)


def _tuple_of_values() -> Case:
    table = collections.OrderedDict(a=1.0)
    return (lambda x: x + sum(tuple(table.values()))), lambda: table.update(z=5.0)


def _set_iteration() -> Case:
    members = {1.0}
    return (lambda x: x + sum(members)), lambda: members.add(7.0)


def _set_length() -> Case:
    members = {1.0}
    return (lambda x: x + len(members)), lambda: members.add(7.0)


def _deque() -> Case:
    queue = collections.deque([1.0])
    return (lambda x: x + sum(queue)), lambda: queue.append(2.0)


def _module_list() -> Case:
    layers = nn.ModuleList([nn.Linear(4, 4)])

    def run(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer(x)
        return x

    return run, lambda: layers.append(nn.Tanh())


def _sequential_call() -> Case:
    model = nn.Sequential(nn.Linear(4, 4))
    return model, lambda: model.append(nn.Tanh())


def _module_dict_values() -> Case:
    layers = nn.ModuleDict({"a": nn.Linear(4, 4)})

    def run(x: torch.Tensor) -> torch.Tensor:
        for layer in layers.values():
            x = layer(x)
        return x

    return run, lambda: layers.update({"b": nn.Tanh()})


def _module_dict_keys() -> Case:
    layers = nn.ModuleDict({"a": nn.Linear(4, 4)})

    def run(x: torch.Tensor) -> torch.Tensor:
        for name in layers:
            x = layers[name](x)
        return x

    return run, lambda: layers.update({"b": nn.Tanh()})


def _children() -> Case:
    model = nn.Sequential(nn.Linear(4, 4))

    def run(x: torch.Tensor) -> torch.Tensor:
        for child in model.children():
            x = child(x)
        return x

    return run, lambda: model.append(nn.Tanh())


def _parameters() -> Case:
    model = nn.Sequential(nn.Linear(4, 4))
    return (lambda x: x + sum(p.sum() for p in model.parameters())), lambda: model.append(
        nn.Linear(4, 4)
    )


def _parameter_list() -> Case:
    weights = nn.ParameterList([nn.Parameter(torch.randn(4))])

    def run(x: torch.Tensor) -> torch.Tensor:
        for weight in weights:
            x = x * weight
        return x

    return run, lambda: weights.append(nn.Parameter(torch.randn(4)))


def _parameter_dict() -> Case:
    weights = nn.ParameterDict({"a": nn.Parameter(torch.randn(4))})
    return (lambda x: x + sum(w for w in weights.values())), lambda: weights.update(
        {"b": nn.Parameter(torch.randn(4))}
    )


CASES = {
    case.__name__.lstrip("_"): case
    for case in (
        _dict_values,
        _dict_items,
        _dict_keys,
        _dict_get_missing,
        _tuple_of_values,
        _set_iteration,
        _set_length,
        _deque,
        _module_list,
        _sequential_call,
        _module_dict_values,
        _module_dict_keys,
        _children,
        _parameters,
        _parameter_list,
        _parameter_dict,
    )
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_changed_container_recompiles(name: str) -> None:
    kiln.reset()
    fn, change = CASES[name]()
    compiled = kiln.compile(fn)
    for _ in range(2):
        x = torch.randn(3, 4)
        torch.testing.assert_close(compiled(x), fn(x))
    assert kiln.counters.captures == 1
    change()
    for _ in range(2):
        x = torch.randn(3, 4)
        torch.testing.assert_close(compiled(x), fn(x))
    assert kiln.counters.captures == 2 and len(kiln.counters.recompiles) == 1


def test_a_stored_sequential_does_not_serve_a_longer_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every compiled module's call is one code object: the artifact cache's entry for a
    one-layer Sequential must fail its guards on a two-layer one (it bound and skipped the
    second layer)."""
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(config, "artifact_cache", True)
    kiln.reset()
    x = torch.randn(4, 3, 8, 8)
    short = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False))
    torch.testing.assert_close(kiln.compile(short)(x), short(x))
    kiln.reset()  # (a new process: only the disk remembers)
    long = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8))
    expected = long(x)
    with torch.no_grad():
        for module in long.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.reset_running_stats()
    torch.testing.assert_close(kiln.compile(long)(x), expected, atol=1e-5, rtol=1e-4)
    assert (kiln.counters.captures, kiln.counters.artifact_hits) == (1, 0)
    kiln.reset()
