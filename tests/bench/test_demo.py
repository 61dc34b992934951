"""``kiln demo``: the README's first command compiles TinyGPT with kiln.compile and checks it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kiln.cli import main


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One CPU thread: a shared two-core CI machine makes two-thread ops wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_demo_compiles_checks_and_times(
    capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    assert main(["demo", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "compiled     kiln.compile(model, backend='kiln')" in out
    assert "captured     1 graph(s), 0 graph break(s), 0 frame(s) run uncompiled" in out
    assert "correct      yes" in out
    for label in ("first call", "eager", "kiln", "speedup"):
        assert f"\n{label} " in out
    assert torch.is_grad_enabled()
