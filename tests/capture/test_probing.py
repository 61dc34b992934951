"""Kiln's own questions about user objects never run their ``__getattr__``
(``kiln/capture/guards/probing.py``), and containers written back unchanged are not replayed
(``kiln/capture/driver/reconstruct.py``)."""

from __future__ import annotations

from typing import Any

import torch

import kiln


class _Store:
    """A sloppy ``__getattr__``: a missing name raises KeyError, not AttributeError (eager
    Python only ever asks it for the names the program reads)."""

    def __init__(self, **items: Any) -> None:
        self.__dict__["items"] = items
        self.__dict__["asked"] = []

    def __getattr__(self, name: str) -> Any:
        self.__dict__["asked"].append(name)
        return self.__dict__["items"][name]


class _Scale(_Store):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


CONFIG = _Store(scale=3.0, labels={0: "a", 1: "b"})
SCALE = _Scale(factor=0.5)
LABELS = {0: "a", 1: "b"}
ORDER = ["x", "y"]


def _reads(x: torch.Tensor) -> torch.Tensor:
    return SCALE(x * CONFIG.scale) + 1


def test_a_sloppy_getattr_is_asked_only_what_the_program_reads() -> None:
    kiln.reset()
    CONFIG.__dict__["asked"].clear()
    SCALE.__dict__["asked"].clear()
    compiled = kiln.compile(_reads)
    for _ in range(3):
        x = torch.randn(4, 3)
        torch.testing.assert_close(compiled(x), _reads(x))
    dunders = [n for n in CONFIG.asked + SCALE.asked if n.startswith("__")]
    assert dunders == [], dunders  # (Kiln's probes: __self__, __wrapped__, __qualname__...)
    report = kiln.explain(_reads, torch.randn(4, 3))
    assert report.graph_count == 1 and not report.breaks and not report.skips, str(report)


def _writes_back(x: torch.Tensor) -> torch.Tensor:
    LABELS[0] = LABELS[0]  # (transformers' configs set their label maps again, equal)
    labels = CONFIG.labels
    labels[1] = labels[1]
    ORDER[0] = ORDER[0]
    return x * 2


def test_a_container_written_back_unchanged_is_not_replayed() -> None:
    kiln.reset()
    compiled = kiln.compile(_writes_back)
    before = (dict(LABELS), dict(CONFIG.labels), list(ORDER))
    for _ in range(3):
        x = torch.randn(5)
        torch.testing.assert_close(compiled(x), x * 2)
    assert (LABELS, CONFIG.labels, ORDER) == before
    (entry,) = compiled._kiln_cache.entries
    head = entry.capture.head_source
    assert "LABELS" not in head and "labels" not in head and "ORDER" not in head, head


def _changes(x: torch.Tensor, table: dict[int, str], order: list[str]) -> torch.Tensor:
    table[0] = table[0]  # unchanged
    table[1] = table[1] + "!"  # changed: replayed on every call
    order[0] = order[0]
    order.append("z")
    return x + 1


def test_a_changed_container_is_still_replayed() -> None:
    kiln.reset()
    compiled = kiln.compile(_changes)
    expected_table, expected_order = {0: "a", 1: "b"}, ["x"]
    table, order = dict(expected_table), list(expected_order)
    for _ in range(3):
        x = torch.randn(2)
        torch.testing.assert_close(
            compiled(x, table, order), _changes(x, expected_table, expected_order)
        )
        assert (table, order) == (expected_table, expected_order)


def _calls_pinned(x: torch.Tensor, scale: _Scale) -> torch.Tensor:
    return scale(x) - 1


def test_an_object_pinned_by_identity_is_named_without_its_getattr() -> None:
    """A guard names what it pins (``L['scale'] is _Scale@...``) from attributes really there."""
    kiln.reset()
    scale = _Scale(factor=2.0)
    compiled = kiln.compile(_calls_pinned)
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(compiled(x, scale), _calls_pinned(x, scale))
    report = kiln.explain(_calls_pinned, torch.randn(3), scale)
    assert report.graph_count == 1 and not report.skips, str(report)
    assert [n for n in scale.asked if n.startswith("__")] == []


def _breaks_then_calls(x: torch.Tensor) -> torch.Tensor:
    y = x + 1
    positive = int(y.sum() > 0)  # (a data-dependent int: a graph break, the rest resumes)
    return SCALE(y) * CONFIG.scale + positive


def test_the_code_after_a_break_compiles_with_a_sloppy_getattr_too() -> None:
    kiln.reset()
    compiled = kiln.compile(_breaks_then_calls)
    for _ in range(4):
        x = torch.randn(6)
        torch.testing.assert_close(compiled(x), _breaks_then_calls(x))
    report = kiln.explain(_breaks_then_calls, torch.randn(6))
    assert report.graph_count == 2 and len(report.breaks) == 1 and not report.skips, str(report)
