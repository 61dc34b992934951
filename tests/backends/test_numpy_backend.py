"""The ``numpy`` backend (the worked example of a backend for a new device): models against
eager, forward and every gradient; fused kernels; its conformance kit on the op table."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

import kiln
import kiln.testing
from kiln.backends import BackendRecord, Capabilities, registry
from kiln.backends.numpy import counters, device
from kiln.backends.numpy.spellings import NUMPY_DTYPES
from kiln.ir import Op, TensorType, interpret
from kiln.recording import recording

device_to_host = device.to_host


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.Tanh()
    )


def test_mlp_inference_runs_on_the_device() -> None:
    kiln.reset()
    model = mlp()
    compiled = kiln.compile(model, backend="numpy")
    x = torch.randn(10, 16)
    counters.reset()
    with torch.no_grad(), recording(BackendRecord) as records:
        out = compiled(x)
        expected = model(x)
    torch.testing.assert_close(out, expected)
    assert [r.pieces for r in records] == [["numpy"]]  # the whole graph
    assert counters.programs == 1 and counters.launches >= 3
    assert counters.to_device >= 5 and counters.to_host == 1  # x, 4 parameters in; 1 out
    assert kiln.counters.graphs == 1 and not kiln.counters.fallbacks


def test_mlp_training_matches_eager_gradients() -> None:
    kiln.reset()
    model = mlp()
    reference = copy.deepcopy(model)

    def step(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(net(x), y)

    compiled = kiln.compile(step, backend="numpy")
    for _ in range(2):
        x, y = torch.randn(12, 16), torch.randn(12, 8)
        counters.reset()
        loss = compiled(model, x, y)
        loss.backward()
        assert counters.launches > 0
        expected = step(reference, x, y)
        expected.backward()
        torch.testing.assert_close(loss, expected)
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert mine.grad is not None, name
        torch.testing.assert_close(mine.grad, theirs.grad, msg=name)
    assert kiln.counters.graphs == 1 and not kiln.counters.fallbacks


def test_unsupported_ops_fall_to_the_default_backend_in_training() -> None:
    """GELU's erf is not in the table: forward and backward split around it."""
    kiln.reset()
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.GELU())
    reference = copy.deepcopy(model)
    compiled = kiln.compile(model, backend="numpy", options={"codegen": "evaluate"})
    x = torch.randn(4, 6)
    with recording(BackendRecord) as records:
        compiled(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad)
    assert len(records) == 2 and all(r.pieces == ["numpy", "kiln", "numpy"] for r in records)
    assert "op erf not supported" in "\n".join(records[0].backend_lines())


def test_elementwise_chain_fuses_into_one_kernel() -> None:
    def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x * w + 1).neg().exp() * 2

    x, w = torch.randn(5, 7), torch.randn(5, 7)
    graph = kiln.trace(chain, x, w)
    program = kiln.get_backend("numpy")(graph, [x, w])
    torch.testing.assert_close(program([x, w])[0], chain(x, w))
    (kernel,) = program.kernels  # type: ignore[attr-defined]
    assert len(kernel.nodes) == len(graph.nodes) == 6
    assert kernel.source.count("out=") >= 3, kernel.source  # one buffer for the chain
    assert "torch" not in kernel.source


def test_dropout_mask_agrees_between_forward_and_backward() -> None:
    """Random ops run on the default backend in both graphs, from the same seed input."""
    kiln.reset()
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.5))
    x = torch.randn(5, 6)
    out = kiln.compile(model, backend="numpy")(x)
    out.sum().backward()
    kept = (out != 0).float() * 2  # dropout's scale
    assert 0 < float(kept.mean()) < 2
    torch.testing.assert_close(model[0].weight.grad, kept.t() @ x)
    torch.testing.assert_close(model[0].bias.grad, kept.sum(0))


def test_numpy_passes_its_conformance_kit(monkeypatch: pytest.MonkeyPatch) -> None:
    drift: list[str] = []  # results NumPy computed in another dtype than the graph's

    def to_host(array: Any, type_: TensorType) -> torch.Tensor:
        if np.asarray(array).dtype != NUMPY_DTYPES[type_.dtype]:
            drift.append(f"{np.asarray(array).dtype} for {type_}")
        return device_to_host(array, type_)

    monkeypatch.setattr(device, "to_host", to_host)
    coverage = kiln.testing.check_backend("numpy")
    print(coverage)
    assert not drift, drift
    assert not coverage.failures, str(coverage)
    assert coverage.count("passed") >= 280 and coverage.on_backend >= 280, str(coverage)
    assert coverage.count("fallback") >= 100  # bfloat16, erf, sort, gather, ... go to kiln
    assert coverage.count("passed", coverage.models) == len(coverage.models) == 3


@pytest.fixture
def wrong_add() -> str:
    """A backend whose add subtracts."""

    def compile_fn(graph: kiln.Graph, example_inputs: list[torch.Tensor]) -> object:
        for node in graph.nodes:
            node.op = Op.SUB if node.op is Op.ADD else node.op
        return lambda inputs: interpret(graph, inputs)

    capabilities = Capabilities(ops=frozenset({Op.ADD}))
    kiln.register_backend("wrong-add", compile_fn, capabilities=capabilities)
    yield "wrong-add"
    registry._BACKENDS.pop("wrong-add")


def test_conformance_kit_reports_a_wrong_backend(wrong_add: str) -> None:
    coverage = kiln.testing.check_backend(wrong_add, models=False)
    failed = {result.name.split("-")[0] for result in coverage.failures}
    assert failed == {"add"} and coverage.on_backend == coverage.count("failed") > 0
    assert "fail" in str(coverage) and "add-float32: failed" in str(coverage)


def test_kiln_imports_and_compiles_without_numpy() -> None:
    """PyTorch runs without NumPy; so must Kiln (only the numpy backend is missing then)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'numpy':\n"
        "            raise ModuleNotFoundError('no numpy', name='numpy')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, kiln\n"
        "assert 'numpy' not in kiln.list_backends(), kiln.list_backends()\n"
        "x = torch.randn(5)\n"
        "got = kiln.compile(lambda t: t.sin() + 1)(x)\n"
        # float32's tolerances: sin(x) + 1 near 0 differs from eager's by an ulp of sin (one
        # call in 30 failed torch.allclose's atol=1e-8, measured; both equally far from float64)
        "torch.testing.assert_close(got, x.sin() + 1, msg=lambda m: f'{m} {x} {kiln.explain()}')\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
