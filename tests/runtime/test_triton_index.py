"""The Triton binary index (kiln/runtime/triton_index.py): a compile records where Triton put
the binary, a later lookup builds the compiled kernel from those files without compiling, and
a damaged or missing entry compiles again. Triton's compiler and CompiledKernel are stood in
for (no GPU here); the key is computed by the real code from the source's hash."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

from kiln.config import config
from kiln.runtime import triton_index


class Source:
    def __init__(self, text: str) -> None:
        self.text = text

    def hash(self) -> str:
        return self.text


class Compiled:
    def __init__(self, src: Any, group: dict[str, str], hash: str) -> None:
        self.src, self.metadata_group, self.hash = src, group, hash


class Function:
    """A JITFunction as the index sees one: ``compile`` (called on a miss) and ``warmup``."""

    def __init__(self, files: Path) -> None:
        self.files = files
        self.compiles = 0
        self.compile = self._compile

    def _compile(self, src: Any, target: Any = None, options: Any = None) -> Compiled:
        self.compiles += 1
        binary = self.files / f"{src.text}.cubin"
        binary.write_bytes(b"binary")
        return Compiled(src, {"k.cubin": str(binary)}, f"hash-{src.text}")

    def warmup(self) -> None:
        raise AssertionError("not called")

    def create_binder(self) -> None:
        """(as Triton's JIT does on its first run on a device: the index must stay in place)"""
        self.compile = self._compile


@pytest.fixture
def function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Function:
    monkeypatch.setattr(config, "cache_dir", str(tmp_path / "cache"))
    import triton.compiler.compiler as compiler

    def loaded(src: Any, group: dict[str, str], hash: str) -> Compiled:
        for path in group.values():
            Path(path).read_bytes()  # (what CompiledKernel does: a missing file raises)
        return Compiled(src, group, hash)

    monkeypatch.setattr(compiler, "CompiledKernel", loaded)
    files = tmp_path / "triton"
    files.mkdir()
    fn = Function(files)
    waits: list[int] = []
    triton_index.install(types.SimpleNamespace(kernel=fn, other=3), lambda: waits.append(1))
    fn.create_binder()
    fn.waits = waits  # type: ignore[attr-defined]
    return fn


def test_a_compile_is_recorded_and_the_next_lookup_loads_it(function: Function) -> None:
    first = function.compile(Source("a"), target="sm90", options={"num_warps": 4})
    assert function.compiles == 1 and function.waits == [1]  # type: ignore[attr-defined]
    again = function.compile(Source("a"), target="sm90", options={"num_warps": 4})
    assert function.compiles == 1, "the second lookup compiled again"
    assert (again.hash, again.metadata_group) == (first.hash, first.metadata_group)
    # another specialization, options or target is another kernel
    function.compile(Source("a"), target="sm90", options={"num_warps": 8})
    function.compile(Source("a"), target="sm80", options={"num_warps": 4})
    function.compile(Source("b"), target="sm90", options={"num_warps": 4})
    assert function.compiles == 4


def test_only_raises_on_a_miss_and_loads_a_hit(function: Function) -> None:
    with triton_index.only(), pytest.raises(triton_index.NotIndexed):
        function.compile(Source("a"), target="sm90", options={})
    assert function.compiles == 0
    function.compile(Source("a"), target="sm90", options={})
    with triton_index.only():
        assert function.compile(Source("a"), target="sm90", options={}).hash == "hash-a"
    assert function.compiles == 1


@pytest.mark.parametrize("damage", ["binary removed", "entry truncated"])
def test_a_damaged_entry_compiles_again(function: Function, damage: str) -> None:
    first = function.compile(Source("a"), target="sm90", options={})
    if damage == "binary removed":
        Path(first.metadata_group["k.cubin"]).unlink()
    else:
        (entry,) = (Path(config.cache_dir) / "triton-index").glob("*.json")
        entry.write_text(entry.read_text()[:5])
    function.compile(Source("a"), target="sm90", options={})
    assert function.compiles == 2
    (entry,) = (Path(config.cache_dir) / "triton-index").glob("*.json")
    assert json.loads(entry.read_text())["hash"] == "hash-a"  # written whole again
