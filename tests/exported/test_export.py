"""``kiln.export`` and ``kiln.load``: exported programs against eager PyTorch (an MLP, a CNN, a
GPT-2), the input spec and its errors, dynamic shapes, saving and loading in another process
that cannot import the model, damaged files, and kernels loaded from the file, not rebuilt."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from tiny_models import SmallResNet, tiny_gpt2_config

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.recording import recording

ROOT = Path(__file__).resolve().parents[2]


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    ).eval()


def _export(*args: object, **kwargs: object) -> kiln.ExportedProgram:
    """``kiln.export``, checking that its graph compiled to generated kernels (no fallback)."""
    with recording(CompiledProgramRecord) as records:
        program = kiln.export(*args, **kwargs)  # type: ignore[arg-type]
    assert [(r.codegen, r.fallback) for r in records] == [("cpp", "")]
    return program


def test_mlp_runs_compiled_and_prints_its_spec() -> None:
    model = _mlp()
    program = _export(model, (torch.randn(5, 8),))
    x = torch.randn(5, 8)
    torch.testing.assert_close(program(x), model(x).detach())
    text = str(program)
    assert "input: f32[5, 8]" in text and "v_0_weight: f32[16, 8]  (0.weight)" in text
    assert "addmm(" in text and "def Sequential(" in text
    assert len(program.weights) == len(model.state_dict())
    with torch.no_grad():  # the weights are copies: the program no longer follows the module
        model[0].weight.add_(1.0)
    assert not torch.allclose(program(x), model(x))


def test_cnn_matches_eager() -> None:
    model = SmallResNet().eval()
    with torch.no_grad():
        for module in model.modules():  # statistics that are not the identity
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    program = _export(model, (torch.randn(2, 3, 16, 16),))
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(program(x), model(x).detach(), rtol=1e-4, atol=1e-5)


GPT2_LOAD_SCRIPT = """
import sys, torch, kiln
assert "transformers" not in sys.modules
program = kiln.load(sys.argv[1])
data = torch.load(sys.argv[2])
for ids, expected in zip(data["ids"], data["expected"], strict=True):
    got = program(ids, use_cache=False)  # a transformers output class, imported by kiln.load
    torch.testing.assert_close(got.last_hidden_state, expected, rtol=1e-4, atol=1e-5)
"""


def test_transformer_with_dynamic_sequence_length(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2Model(tiny_gpt2_config()).eval()
    dims = {0: kiln.Dim(name="batch"), 1: kiln.Dim(2, 32, name="seq")}
    ids = torch.randint(0, 99, (2, 8))
    program = _export(model, (ids,), {"use_cache": False}, dynamic_shapes={"input_ids": dims})
    assert "input_ids: i64[batch, seq]" in str(program)
    inputs, outputs = [torch.randint(0, 99, size) for size in ((2, 3), (3, 8), (2, 13))], []
    for ids in inputs:
        expected = model(ids, use_cache=False).last_hidden_state.detach()
        got = program(ids, use_cache=False).last_hidden_state
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        outputs.append(expected)
    with pytest.raises(kiln.ExportError, match="True is not the exported False"):
        program(ids, use_cache=True)  # (the graph was traced for use_cache=False)
    program.save(tmp_path / "gpt2.kiln")  # loaded by a process that has not imported transformers
    torch.save({"ids": inputs, "expected": outputs}, tmp_path / "data.pt")
    (tmp_path / "load_it.py").write_text(textwrap.dedent(GPT2_LOAD_SCRIPT))
    _python(tmp_path / "load_it.py", "gpt2.kiln", "data.pt", cache=tmp_path / "cache")


def _branchy(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:
        return x * 2
    return x


def _reads_a_value(x: torch.Tensor) -> torch.Tensor:
    return x * x.max().item()


@pytest.mark.parametrize("fn", [_branchy, _reads_a_value])
def test_graph_break_is_an_error_naming_the_line(fn: object) -> None:
    line = fn.__code__.co_firstlineno + 1  # type: ignore[attr-defined]
    with pytest.raises(kiln.ExportError, match="one whole graph") as info:
        kiln.export(fn, (torch.randn(4),))  # type: ignore[arg-type]
    assert f"test_export.py:{line}" in str(info.value)
    assert info.value.location is not None and info.value.location.line == line


def test_dynamic_batch_at_several_sizes_and_its_range() -> None:
    model = _mlp()
    batch = kiln.Dim(2, 64, name="batch")
    program = _export(model, (torch.randn(5, 8),), dynamic_shapes=({0: batch},))
    for size in (2, 3, 17, 64):
        x = torch.randn(size, 8)
        torch.testing.assert_close(program(x), model(x).detach())
    for size in (1, 65):
        with pytest.raises(kiln.ExportError, match=r"batch\) is \d+, outside \[2, 64\]"):
            program(torch.randn(size, 8))


def _add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y if x.shape[0] > 4 else x - y


def test_named_dims_are_one_size_and_decisions_are_checked() -> None:
    n = kiln.Dim(name="n")
    program = kiln.export(_add, (torch.randn(6, 3), torch.randn(6, 3)), None, ({0: n}, {0: n}))
    x, y = torch.randn(9, 3), torch.randn(9, 3)
    torch.testing.assert_close(program(x, y), x + y)
    with pytest.raises(kiln.ExportError, match="in another input"):
        program(torch.randn(9, 3), torch.randn(8, 3))
    with pytest.raises(kiln.ExportError, match="n > 4"):  # traced the x.shape[0] > 4 branch
        program(torch.randn(3, 3), torch.randn(3, 3))


def _sized(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    return x + torch.zeros(n, 1) + torch.arange(n).view(n, 1) + x.new_ones(n, 3) * n


def test_sizes_passed_to_torch_stay_symbolic_through_save_and_load(tmp_path: Path) -> None:
    program = kiln.export(_sized, (torch.randn(4, 3),), dynamic_shapes=({0: "n"},))
    assert "iota(length=n" in str(program) and "full(shape=(n, 1)" in str(program)
    program.save(tmp_path / "sized.kiln")
    loaded = kiln.load(tmp_path / "sized.kiln")
    for size in (2, 9):
        x = torch.randn(size, 3)
        torch.testing.assert_close(loaded(x), _sized(x))


def test_one_tensor_passed_twice_must_stay_one() -> None:
    x = torch.randn(3)
    program = kiln.export(torch.mul, (x, x))  # one graph input, read twice
    torch.testing.assert_close(program(x, x), x * x)
    with pytest.raises(kiln.ExportError, match="passed twice"):
        program(x, torch.randn(3))


def test_a_specialized_dynamic_size_is_an_error() -> None:
    def sized(x: torch.Tensor) -> torch.Tensor:
        return x + torch.ones(int(x.shape[0]), 1)

    with pytest.raises(kiln.ExportError, match="specialized"):
        kiln.export(sized, (torch.randn(6, 3),), dynamic_shapes={"x": {0: "n"}})


def test_calls_that_do_not_fit_the_spec() -> None:
    program = kiln.export(_mlp(), (torch.randn(5, 8),))
    with pytest.raises(kiln.ExportError, match=r"dim 0 is 6, not 5"):
        program(torch.randn(6, 8))
    with pytest.raises(kiln.ExportError, match="dtype"):
        program(torch.randn(5, 8, dtype=torch.float64))
    with pytest.raises(kiln.ExportError, match="3 dims, not 2"):
        program(torch.randn(5, 8, 1))
    with pytest.raises(kiln.ExportError, match=r"takes 1 positional arguments.*: got 2"):
        program(torch.randn(5, 8), torch.randn(5, 8))
    with pytest.raises(
        kiln.ExportError, match=r"must be a tensor of f32\[5, 8\], got <class 'list'>"
    ):
        program([torch.randn(5, 8)])
    with pytest.raises(
        kiln.ExportError, match=r"takes 1 positional arguments, keywords \[\]: got 1 "
    ):
        program(torch.randn(5, 8), scale=2.0)


def test_save_and_load_in_process(tmp_path: Path) -> None:
    model = _mlp()
    program = kiln.export(model, (torch.randn(5, 8),), dynamic_shapes=({0: "b"},))
    program.save(tmp_path / "mlp.kiln")
    loaded = kiln.load(tmp_path / "mlp.kiln")
    assert str(loaded) == str(program)
    x = torch.randn(7, 8)
    torch.testing.assert_close(loaded(x), model(x).detach())
    with zipfile.ZipFile(tmp_path / "mlp.kiln") as archive:
        names = archive.namelist()
    assert names[:3] == ["kiln-export", "graph.json", "weights.safetensors"]
    assert any(name.startswith("kernels/cpp/") and name.endswith(".so") for name in names)
    loaded.save(tmp_path / "again.kiln")  # what it loaded: size 7 needed no new kernels
    with zipfile.ZipFile(tmp_path / "again.kiln") as archive:
        assert set(names) == set(archive.namelist())  # (the kernels take their sizes)


def test_closed_over_tensors_are_weights(tmp_path: Path) -> None:
    scale = torch.randn(3)

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * scale + torch.tensor([1.0, 2.0, 3.0])

    program = kiln.export(scaled, (torch.randn(2, 3),))
    assert len(program.weights) == 2
    program.save(tmp_path / "scaled.kiln")
    x = torch.randn(2, 3)
    expected = scaled(x)
    scale.zero_()  # the program holds copies, not the closure's tensor
    torch.testing.assert_close(program(x), expected)
    torch.testing.assert_close(kiln.load(tmp_path / "scaled.kiln")(x), expected)


def _with_externs(x: torch.Tensor) -> torch.Tensor:
    return torch.special.i1e(x.tanh()) + torch.cummax(x, 1)[0]


def test_extern_calls_are_saved_by_name(tmp_path: Path) -> None:
    program = kiln.export(_with_externs, (torch.randn(3, 5),))
    assert "fn=torch.special.i1e" in str(program) and "fn=torch.cummax" in str(program)
    program.save(tmp_path / "externs.kiln")
    x = torch.randn(3, 5)
    torch.testing.assert_close(kiln.load(tmp_path / "externs.kiln")(x), _with_externs(x))


MODEL_SOURCE = """
import torch

def squash(x):
    return torch.tanh(x) * 0.5 + x.sigmoid()

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        return self.fc(squash(self.conv(x)).flatten(1)).softmax(-1)
"""

EXPORT_SCRIPT = """
import sys, torch, kiln
import user_model
model = user_model.Net().eval()
program = kiln.export(model, (torch.randn(4, 3, 8, 8),), dynamic_shapes=({0: "batch"},))
inputs = [torch.randn(n, 3, 8, 8) for n in (4, 5)]
with torch.no_grad():
    expected = [model(x) for x in inputs]
    assert all(torch.allclose(program(x), e, atol=1e-6) for x, e in zip(inputs, expected))
program.save(sys.argv[1])
torch.save({"inputs": inputs, "expected": expected}, sys.argv[2])
"""

LOAD_SCRIPT = """
import json, sys, torch, kiln
import kiln.runtime.cpp_build as cpp_build
from kiln.recording import recording
from kiln.runtime.kernel_files import KernelFiles
try:
    import user_model
except ImportError:
    pass
else:
    raise SystemExit("the model's source can still be imported")
if sys.argv[3] == "another-cpu":  # the saved libraries were built for another machine
    cpp_build.host_identity = lambda: "another CPU"
program = kiln.load(sys.argv[1])
data = torch.load(sys.argv[2])
with recording(KernelFiles) as used:
    for x, expected in zip(data["inputs"], data["expected"], strict=True):
        torch.testing.assert_close(program(x), expected)
print(json.dumps({"built": sum(u.built for u in used), "entries": len(used)}))
"""


def _python(script: Path, *args: str, cache: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), KILN_CACHE_DIR=str(cache))
    result = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=script.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A program exported and saved by another process, whose model module is then deleted."""
    folder = tmp_path_factory.mktemp("saved")
    (folder / "user_model.py").write_text(MODEL_SOURCE)
    (folder / "export_it.py").write_text(textwrap.dedent(EXPORT_SCRIPT))
    (folder / "load_it.py").write_text(textwrap.dedent(LOAD_SCRIPT))
    _python(folder / "export_it.py", "net.kiln", "data.pt", cache=folder / "cache-export")
    (folder / "user_model.py").unlink()
    shutil.rmtree(folder / "__pycache__", ignore_errors=True)
    return folder


@pytest.mark.parametrize("machine", ["same-cpu", "another-cpu"])
def test_load_in_a_process_without_the_model_source(saved: Path, machine: str) -> None:
    cache = saved / f"cache-{machine}"  # empty: only what the file seeds
    report = json.loads(
        _python(saved / "load_it.py", "net.kiln", "data.pt", machine, cache=cache).splitlines()[-1]
    )
    assert report["entries"] >= 1  # (sizes 4 and 5 share their kernels: they take sizes)
    if machine == "same-cpu":
        assert report["built"] == 0  # every kernel library came from the file
    else:
        assert 1 <= report["built"] <= report["entries"]  # rebuilt from the sources, once each


@pytest.fixture
def small_file(tmp_path: Path) -> Path:
    program = kiln.export(torch.nn.Linear(4, 3).eval(), (torch.randn(2, 4),))
    program.save(tmp_path / "small.kiln")
    return tmp_path / "small.kiln"


def test_truncated_and_foreign_files_raise_clear_errors(small_file: Path) -> None:
    data = small_file.read_bytes()
    for cut in (0, 10, len(data) // 2, len(data) - 30):
        small_file.write_bytes(data[:cut])
        with pytest.raises(kiln.ExportFileError, match="damaged or not a saved Kiln program"):
            kiln.load(small_file)
    small_file.write_text("def forward(x): return x\n")
    with pytest.raises(kiln.ExportFileError):
        kiln.load(small_file)


def test_wrong_version_raises_a_clear_error(small_file: Path, tmp_path: Path) -> None:
    other = tmp_path / "future.kiln"
    with zipfile.ZipFile(small_file) as source, zipfile.ZipFile(other, "w") as target:
        for name in source.namelist():
            data = source.read(name)
            target.writestr(name, b'{"format": 99}' if name == "kiln-export" else data)
    with pytest.raises(kiln.ExportFileError, match="format version 99; this Kiln reads version 1"):
        kiln.load(other)


def test_every_flipped_bit_raises_or_changes_nothing(small_file: Path) -> None:
    """Each byte of the file, with its low or high bit flipped: a clear error, or (a field
    nothing reads, such as a timestamp) the same results; never a crash or a wrong answer."""
    linear_input = torch.randn(2, 4)
    expected = kiln.load(small_file)(linear_input)
    data = small_file.read_bytes()
    errors = 0
    for position in range(len(data)):
        for bit in (0x01, 0x80):
            damaged = bytearray(data)
            damaged[position] ^= bit
            small_file.write_bytes(bytes(damaged))
            try:
                program = kiln.load(small_file)
            except kiln.ExportFileError:
                errors += 1
                continue
            torch.testing.assert_close(program(linear_input), expected)
    assert errors >= 0.8 * 2 * len(data)


def test_triton_kernels_travel_in_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton kernels (CPU tensors run them in Triton's interpreter): their modules are saved
    and seeded into an empty cache on load, where nothing is written again."""
    pytest.importorskip("triton")
    from kiln.config import config
    from kiln.runtime.kernel_files import KernelFiles

    monkeypatch.setattr(config, "codegen", "triton")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
    with recording(CompiledProgramRecord) as records:
        program = kiln.export(model.eval(), (torch.randn(4, 8),), dynamic_shapes=({0: "b"},))
    assert [(r.codegen, r.fallback) for r in records] == [("triton", "")]
    program.save(tmp_path / "triton.kiln")
    monkeypatch.setattr(config, "cache_dir", str(tmp_path / "empty-cache"))
    loaded = kiln.load(tmp_path / "triton.kiln")
    x = torch.randn(4, 8)
    with recording(KernelFiles) as used:
        torch.testing.assert_close(loaded(x), model(x).detach())
    assert used and all(entry.kind == "triton" and not entry.built for entry in used)
