"""``torch.save``/``torch.load`` and ``copy.deepcopy`` of ``kiln.compile``'s results work like
``torch.compile``'s: a compiled module stores its original module and options and comes back
as a compiled module with its own caches (compiling on its first call); a compiled function
decorated at module level pickles by reference, and copies are the function itself."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import torch
from tiny_models import SmallResNet
from torch import nn

import kiln
from kiln.api import CompiledModule


@kiln.compile
def scaled_sine(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 3 + x


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 3))


def _compiles(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, asserting that this call captured (and compiled) one graph."""
    before = kiln.counters.captures
    result = module(x)
    assert kiln.counters.captures == before + 1
    return result


def _separate(first: nn.Module, second: nn.Module) -> None:
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
        assert a.data_ptr() != b.data_ptr(), f"{name} shares memory"


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    kiln.reset()
    compiled = kiln.compile(_model(), options={"codegen": "evaluate"})
    x = torch.randn(5, 6)
    expected = compiled(x)
    path = tmp_path / "model.pt"
    torch.save(compiled, path)
    loaded = torch.load(path, weights_only=False)
    assert isinstance(loaded, CompiledModule) and loaded is not compiled
    assert loaded._kiln_options == compiled._kiln_options
    assert loaded._kiln_options.codegen == "evaluate"
    _separate(loaded._orig_mod, compiled._orig_mod)
    torch.testing.assert_close(_compiles(loaded, x), expected)
    fresh = torch.randn(7, 6)
    torch.testing.assert_close(loaded(fresh), loaded._orig_mod(fresh))
    assert loaded.state_dict().keys() == compiled.state_dict().keys()  # "_orig_mod." prefixed


def test_deepcopy_has_its_own_parameters_and_compiled_state() -> None:
    kiln.reset()
    model = SmallResNet().eval()
    compiled = kiln.compile(model)
    x = torch.randn(2, 3, 16, 16)
    expected = compiled(x)
    twin = copy.deepcopy(compiled)
    assert isinstance(twin, CompiledModule) and twin._kiln_call is not compiled._kiln_call
    _separate(twin._orig_mod, model)
    torch.testing.assert_close(_compiles(twin, x), expected)
    with torch.no_grad():
        twin.fc.weight.add_(torch.randn_like(twin.fc.weight))
    hits = kiln.counters.cache_hits
    torch.testing.assert_close(compiled(x), expected)  # the original is untouched
    assert kiln.counters.cache_hits == hits + 1
    torch.testing.assert_close(twin(x), twin._orig_mod(x))


def test_deepcopy_trains_separately() -> None:
    kiln.reset()
    compiled = kiln.compile(_model())
    twin = copy.deepcopy(compiled)
    x = torch.randn(4, 6)
    _compiles(twin, x).square().sum().backward()
    assert all(p.grad is None for p in compiled.parameters())
    reference = copy.deepcopy(twin._orig_mod)
    reference.zero_grad()
    reference(x).square().sum().backward()
    for (name, got), want in zip(twin.named_parameters(), reference.parameters(), strict=True):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad, want.grad, msg=name)


def test_compiled_module_inside_a_module_is_copied_and_pickled() -> None:
    kiln.reset()
    outer = nn.ModuleDict({"body": kiln.compile(_model())})
    x = torch.randn(3, 6)
    expected = outer["body"](x)
    for clone in (copy.deepcopy(outer), pickle.loads(pickle.dumps(outer))):
        assert isinstance(clone["body"], CompiledModule)
        torch.testing.assert_close(_compiles(clone["body"], x), expected)


def test_compiled_function_pickles_by_reference_like_torch_compile() -> None:
    kiln.reset()
    assert pickle.loads(pickle.dumps(scaled_sine)) is scaled_sine
    assert copy.deepcopy(scaled_sine) is scaled_sine
    x = torch.randn(8)
    torch.testing.assert_close(_compiles(scaled_sine, x), torch.sin(x) * 3 + x)
