"""The artifact cache (``kiln/capture/driver/artifact.py``): a second process running the same
program reuses the first one's captures (no capture at all), and anything that does not fit (a
changed source, a changed global, a damaged file) is captured again, never a wrong result."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import kiln
from kiln.capture.driver import artifact
from kiln.config import config

ROOT = Path(__file__).resolve().parents[2]

# Four programs, each compared with eager on fresh random inputs (outputs, BatchNorm's running
# statistics, every parameter's gradient); prints the counters and each first call's time.
PROGRAM = textwrap.dedent(
    """
    import copy, json, sys, time
    import torch, kiln
    import torch.nn as nn
    import torch.nn.functional as F

    SCALE = float(sys.argv[1])

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(F.relu(self.fc1(x))) * SCALE  # EDIT

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            # (arange: a tensor constant in the graph, whose own pickle differs by process)
            return F.relu(self.bn(self.conv(x))).mean((2, 3)) * torch.arange(1.0, 5.0)

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x)
            print("", end="")  # a graph break: the rest runs in a resume function
            return torch.tanh(y) * 2

    def close(a, b):
        return bool(torch.allclose(a, b, atol=1e-5, rtol=1e-4))

    torch.manual_seed(int(sys.argv[2]))
    report = {"ok": {}, "first_call": {}}
    for name, model, shape in [
        ("mlp", MLP(), (4, 8)),
        ("cnn", CNN(), (2, 3, 8, 8)),
        ("cnn_eval", CNN().eval(), (2, 3, 8, 8)),  # (conv+BatchNorm folded: passes rewire)
        ("break", Broken(), (4, 8)),
    ]:
        reference, x = copy.deepcopy(model), torch.randn(shape)
        compiled = kiln.compile(model)
        start = time.perf_counter()
        out = compiled(x)
        report["first_call"][name] = time.perf_counter() - start
        same = close(out, reference(x)) and close(compiled(x), reference(x))
        for a, b in zip(model.buffers(), reference.buffers()):
            same = same and close(a.float(), b.float())
        report["ok"][name] = same

    model = MLP()
    reference = copy.deepcopy(model)
    def step(model, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    start = time.perf_counter()
    loss = kiln.compile(step)(model, x, y)
    report["first_call"]["train"] = time.perf_counter() - start
    same = close(loss, step(reference, x, y))
    for (_, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        same = same and close(a.grad, b.grad)
    report["ok"]["train"] = same
    report["captures"] = kiln.counters.captures
    report["hits"] = kiln.counters.artifact_hits
    report["programs"] = kiln.counters.programs_reused
    print(json.dumps(report))
    """
)


def _run(
    script: Path, cache: Path, *args: str, wait: bool = True, **env: str
) -> dict | subprocess.Popen:
    environment = dict(os.environ, PYTHONPATH=str(ROOT), KILN_CACHE_DIR=str(cache))
    environment.update({"KILN_ARTIFACT_CACHE": "1", **env})
    command = [sys.executable, "-W", "always", str(script), *args]
    process = subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if not wait:
        return process
    return _report(process)


def _report(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    report["stderr"] = err
    return report


@pytest.fixture
def program(tmp_path: Path) -> Path:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    return script


def test_second_process_skips_capture(program: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _run(program, cache, "2.0", "1")
    assert first["captures"] >= 7 and first["hits"] == 0, first  # (3 for the break)
    assert all(first["ok"].values()), first
    assert first["programs"] == 0, first
    stored = len(list((cache / "artifacts").glob("p-*.kart")))
    assert stored >= 6, stored  # (a training step: a forward and a backward program)
    second = _run(program, cache, "2.0", "2")  # other random inputs and weights
    assert second["captures"] == 0, second
    assert second["hits"] == first["captures"], second
    assert second["programs"] == stored, second  # every scheduled program too
    assert all(second["ok"].values()), second
    print("first calls, cold process:", first["first_call"])
    print("first calls, warm process:", second["first_call"])


def test_changed_global_or_source_captures_again(program: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _run(program, cache, "2.0", "1")
    changed_global = _run(program, cache, "3.0", "2")  # SCALE's guard fails: MLP recaptured
    assert changed_global["captures"] == 2 and all(changed_global["ok"].values()), changed_global
    program.write_text(PROGRAM.replace("* SCALE  # EDIT", "+ SCALE  # EDIT"))
    changed_source = _run(program, cache, "3.0", "3")  # MLP's class differs: recaptured
    assert changed_source["captures"] == 2 and all(changed_source["ok"].values()), changed_source


def test_damaged_files_are_rebuilt_with_a_warning(program: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _run(program, cache, "2.0", "1")
    files = sorted(path for path in cache.rglob("*") if path.is_file() and path.stat().st_size)
    assert len(list((cache / "artifacts").glob("*.kart"))) >= 4 and len(files) > 8
    for i, path in enumerate(files):  # every cache file: artifacts and C++ kernels
        data = bytearray(path.read_bytes())
        data[(i * 7919) % len(data)] ^= 0xFF  # one byte, somewhere different in each file
        path.write_bytes(bytes(data))
    damaged = _run(program, cache, "2.0", "2")
    assert damaged["captures"] == first["captures"] and all(damaged["ok"].values()), damaged
    assert "is damaged; rebuilding it" in damaged["stderr"]
    rebuilt = _run(program, cache, "2.0", "3")
    assert rebuilt["captures"] == 0 and all(rebuilt["ok"].values()), rebuilt


def test_two_processes_writing_at_once(program: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    processes = [_run(program, cache, "2.0", str(seed), wait=False) for seed in (1, 2)]
    for report in map(_report, processes):
        assert all(report["ok"].values()), report
    third = _run(program, cache, "2.0", "3")
    assert third["captures"] == 0 and "damaged" not in third["stderr"], third
    assert not list((cache / "artifacts").glob(".tmp-*"))


def _count(value: torch.Tensor) -> torch.Tensor:
    return torch.sin(value) * 3


@pytest.fixture
def artifact_cache(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(config, "artifact_cache", True)
    kiln.reset()
    yield tmp_path / "artifacts"
    kiln.reset()


def test_reused_in_process_after_reset(artifact_cache: Path) -> None:
    x = torch.randn(5, 3)
    torch.testing.assert_close(kiln.compile(_count)(x), _count(x))
    kiln.reset()
    x = torch.randn(5, 3)
    torch.testing.assert_close(kiln.compile(_count)(x), _count(x))
    assert (kiln.counters.captures, kiln.counters.artifact_hits) == (0, 1)
    y = torch.randn(2, 3)  # another shape: the stored entry's guards fail, capture runs
    torch.testing.assert_close(kiln.compile(_count)(y), _count(y))
    assert (kiln.counters.captures, kiln.counters.artifact_hits) == (1, 1)


def _sized(value: torch.Tensor) -> torch.Tensor:
    return torch.relu(value).sum(0) * value.shape[0]


def test_symbolic_sizes_reused(artifact_cache: Path) -> None:
    compiled = kiln.compile(_sized, dynamic=True)
    for size in (5, 7):
        x = torch.randn(size, 3)
        torch.testing.assert_close(compiled(x), _sized(x))
    kiln.reset()
    x = torch.randn(9, 3)
    torch.testing.assert_close(kiln.compile(_sized, dynamic=True)(x), _sized(x))
    assert (kiln.counters.captures, kiln.counters.artifact_hits) == (0, 1)


class _Flagged(torch.nn.Module):
    def __init__(self, squash: bool) -> None:
        super().__init__()
        self.squash = squash

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return torch.tanh(value) if self.squash else value * 2


def test_another_instance_with_other_state_captures_again(artifact_cache: Path) -> None:
    x = torch.randn(4)
    torch.testing.assert_close(kiln.compile(_Flagged(True))(x), torch.tanh(x))
    kiln.reset()
    torch.testing.assert_close(kiln.compile(_Flagged(True))(x), torch.tanh(x))
    assert (kiln.counters.captures, kiln.counters.artifact_hits) == (0, 1)
    torch.testing.assert_close(kiln.compile(_Flagged(False))(x), x * 2)  # its guard fails
    assert (kiln.counters.captures, kiln.counters.artifact_hits) == (1, 1)


def test_two_instances_of_one_class_reuse_one_entry(artifact_cache: Path) -> None:
    x = torch.randn(4)
    kiln.compile(_Flagged(True))(x)
    kiln.reset()
    for _ in range(2):  # the entry binds to each instance in turn
        torch.testing.assert_close(kiln.compile(_Flagged(True))(x), torch.tanh(x))
    assert (kiln.counters.captures, kiln.counters.artifact_hits) == (0, 2)


class _Holder(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return self.inner(value)


class _BreaksInside(torch.nn.Module):
    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return value * 2 if value.sum() > 0 else value - 1  # data-dependent: a break


def test_a_break_inside_one_callee_is_not_carried_to_another(artifact_cache: Path) -> None:
    """Every compiled module's call frame is one code (``return self(*args, **kwargs)``): a
    stored head that broke at that call because of what its callee did must not serve a
    module without the break (it did, and a T5 run reported a Whisper run's break)."""
    x = torch.randn(4)
    kiln.compile(_Holder(_BreaksInside()))(x)
    assert len(kiln.counters.graph_breaks) >= 1
    kiln.reset()
    clean = _Holder(_Flagged(True))
    torch.testing.assert_close(kiln.compile(clean)(x), torch.tanh(x))
    assert not kiln.counters.graph_breaks
    assert kiln.counters.graphs == 1


class _Pair(torch.nn.Module):
    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = self.a if shared else torch.nn.Linear(3, 3)

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return self.a(value) * (2 if self.a is self.b else 3)


def test_objects_distinct_at_capture_must_stay_distinct(artifact_cache: Path) -> None:
    x = torch.randn(2, 3)
    kiln.compile(_Pair(shared=False))(x)
    kiln.reset()
    pair = _Pair(shared=True)  # both paths lead to one module: the stored entry must not bind
    torch.testing.assert_close(kiln.compile(pair)(x), pair.a(x) * 2)
    assert (kiln.counters.captures, kiln.counters.artifact_hits) == (1, 0)


def _scaler(scale: float):  # type: ignore[no-untyped-def]
    def scaled(value: torch.Tensor) -> torch.Tensor:
        return value * scale

    return scaled


_SCALED = _scaler(2.0)


def _uses_a_closure(value: torch.Tensor) -> torch.Tensor:
    return _SCALED(value) + 1  # (the cell is stored as G['_SCALED'].__closure__[0])


def test_closure_cells_bind_by_path(artifact_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4)
    torch.testing.assert_close(kiln.compile(_uses_a_closure)(x), x * 2 + 1)
    kiln.reset()
    torch.testing.assert_close(kiln.compile(_uses_a_closure)(x), x * 2 + 1)
    assert (kiln.counters.captures, kiln.counters.artifact_hits) == (0, 1)
    kiln.reset()
    monkeypatch.setitem(globals(), "_SCALED", _scaler(3.0))  # same code, another cell value
    torch.testing.assert_close(kiln.compile(_uses_a_closure)(x), x * 3 + 1)
    assert (kiln.counters.captures, kiln.counters.artifact_hits) == (1, 0)


def test_entry_holding_an_undescribable_object_is_not_stored(
    artifact_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    compiled = kiln.compile(_count)
    compiled(torch.randn(3))
    for stored in artifact_cache.glob("*.kart"):  # (the capture and its scheduled program)
        stored.unlink()
    capture = compiled._kiln_cache.entries[0].capture
    lock = threading.Lock()  # (no name, no path, no value: what would a new process bind?)
    held = dataclasses.replace(capture, scope={**capture.scope, "___lock0": lock})
    caplog.set_level(logging.INFO, logger="kiln.cache")
    artifact.store(_count, held, compiled._kiln_cache.compiler.options)
    assert not list(artifact_cache.glob("*.kart"))
    assert "not storing _count: a lock object" in caplog.text


class _Registry(dict):
    def get(self, key, default=None):  # type: ignore[no-untyped-def]
        return super().get(key, default)  # (its ``__class__`` cell)


def test_a_guard_on_a_methods_class_cell_is_stored_and_bound_again(artifact_cache: Path) -> None:
    """A guard read through a method's zero-argument ``super()`` can name the ``__class__``
    cell itself (transformers' ``DynamicCache.__init__`` and ``AttentionInterface.get`` on
    the H200): stored as the class's cell by the class's name, bound to this process's."""
    from kiln.capture.guards.guards import Identity
    from kiln.capture.guards.sources import Attr, Constant

    compiled = kiln.compile(_count)
    compiled(torch.randn(3))
    for stored in artifact_cache.glob("*.kart"):
        stored.unlink()
    capture = compiled._kiln_cache.entries[0].capture
    cell = _Registry.get.__closure__[0]
    guard = Identity(Attr(Constant(cell), "cell_contents"), "super()", obj=_Registry)
    held = dataclasses.replace(capture, guards=[*capture.guards, guard])
    artifact.store(_count, held, compiled._kiln_cache.compiler.options)
    assert list(artifact_cache.glob("*.kart")), "not stored"
    kiln.reset()
    x = torch.randn(3)
    torch.testing.assert_close(kiln.compile(_count)(x), _count(x))
    assert (kiln.counters.captures, kiln.counters.artifact_hits) == (0, 1)


def test_least_recently_used_files_go_first(artifact_cache: Path) -> None:
    artifact_cache.mkdir()
    for i in range(5):
        path = artifact_cache / f"{i}.kart"
        path.write_bytes(b"x" * 1000)
        os.utime(path, ns=(i * 10**9, i * 10**9))
    removed = artifact.evict(2500)
    assert sorted(p.name for p in removed) == ["0.kart", "1.kart", "2.kart"]
    assert sorted(p.name for p in artifact_cache.iterdir()) == ["3.kart", "4.kart"]


def test_cache_info_and_clear(artifact_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.cli import main

    kiln.compile(_count)(torch.randn(3))
    assert main(["cache", "info"]) == 0
    info = capsys.readouterr().out
    # a capture, its scheduled program and its generated code (kiln/backends/programs.py),
    # the compiled guard, head and host program (kiln/code_cache.py)
    assert "artifacts" in info and "6 files" in info and "bounded at 1024 MiB" in info
    assert main(["cache", "clear"]) == 0
    assert not artifact_cache.exists()
    assert "cleared" in capsys.readouterr().out


TRANSFORMERS = textwrap.dedent(
    """
    import copy, json, sys
    import torch, kiln
    from kiln.bench.worker import prepare

    ok = {}
    for name in ("gpt2_tiny", "bert_tiny"):
        model, inputs, _ = prepare(name, "train", torch.device("cpu"), torch.float32)
        torch.manual_seed(int(sys.argv[1]))
        inputs = tuple(torch.randint_like(t, 0, 100) for t in inputs)
        reference = copy.deepcopy(model)
        out, expected = kiln.compile(model)(*inputs).logits, reference(*inputs).logits
        out.pow(2).mean().backward()
        expected.pow(2).mean().backward()
        grads = zip(model.parameters(), reference.parameters())
        ok[name] = torch.allclose(out, expected, atol=1e-4, rtol=1e-3) and all(
            torch.allclose(a.grad, b.grad, atol=1e-4, rtol=1e-3)
            for a, b in grads if b.grad is not None
        )
    report = {"ok": ok, "captures": kiln.counters.captures, "hits": kiln.counters.artifact_hits}
    print(json.dumps(report))
    """
)


@pytest.mark.slow
def test_transformers_models_reused(tmp_path: Path) -> None:
    """Hugging Face models read closure cells of decorated forwards and write module globals
    in their heads: both are stored by path or name."""
    pytest.importorskip("transformers")
    script = tmp_path / "transformers_program.py"
    script.write_text(TRANSFORMERS)
    first = _run(script, tmp_path / "cache", "1")
    assert first["captures"] >= 2 and all(first["ok"].values()), first
    second = _run(script, tmp_path / "cache", "2")
    assert second["captures"] == 0 and second["hits"] == first["captures"], second
    assert all(second["ok"].values()), second


def test_a_source_keeps_its_hash_in_process_only() -> None:
    """Sources keep their hash once computed (a deep path hashed itself again at each dict
    lookup), and pickle without it: a string hashes differently in another process."""
    from kiln.capture.guards.sources import Attr, Item, Local

    path = Item(Attr(Attr(Local("self"), "_modules"), "layer1"), "0")
    table = {path: 1}
    assert hash(path) == hash(Item(Attr(Attr(Local("self"), "_modules"), "layer1"), "0"))
    assert "_hash" in vars(path)
    copy = pickle.loads(pickle.dumps(path))
    assert "_hash" not in vars(copy) and "_hash" not in vars(copy.base)
    assert copy == path and table[copy] == 1
    program = "import pickle, sys; print(hash(pickle.loads(sys.stdin.buffer.read())))"
    other = subprocess.run(  # another process (another string hash seed) hashes it anew
        [sys.executable, "-c", program],
        input=pickle.dumps(path),
        capture_output=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="123"),
        check=True,
    )
    expected = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            + "from kiln.capture.guards.sources import *; "
            "print(hash(Item(Attr(Attr(Local('self'), '_modules'), 'layer1'), '0')))",
        ],
        capture_output=True,
        env=dict(os.environ, PYTHONHASHSEED="123"),
        check=True,
    )
    assert other.stdout == expected.stdout
