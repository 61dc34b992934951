"""DistributedDataParallel around and inside ``kiln.compile``: two processes on gloo train a
compiled and an eager DDP model side by side (``ddp_workers.py``); losses and every gradient
must agree at every step, and the compiled graphs must have run."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="no gloo backend")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import ddp_workers

    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(ddp_workers.run, args=(2, free_port(), str(out)), nprocs=2)
    return [torch.load(Path(out) / f"rank{rank}.pt") for rank in range(2)]


def _check_pair(found: dict[str, Any]) -> None:
    kiln_losses = [loss for key, loss in found["losses"] if key == "kiln"]
    eager_losses = [loss for key, loss in found["losses"] if key == "eager"]
    assert kiln_losses == pytest.approx(eager_losses, rel=1e-4, abs=1e-5)
    for step, grads in enumerate(found["grads"]):
        assert max(grads) < 1e-4, f"step {step}: gradient differences {grads}"
    assert found["graphs"] >= 1 and found["fallbacks"] == 0, found  # it ran compiled


@pytest.mark.parametrize(
    "case", ["inner", "outer", "outer_split", "inner_split", "no_sync", "unused"]
)
def test_trains_like_eager_ddp(ranks: list[dict[str, Any]], case: str) -> None:
    for found in ranks:
        _check_pair(found[case])


def test_compiled_graphs_ran(ranks: list[dict[str, Any]]) -> None:
    for found in ranks:
        counters = found["counters"]
        assert counters["graphs"] >= 5, counters
        assert counters["fallbacks"] == [], counters
        assert any("DistributedDataParallel runs eagerly" in b for b in counters["breaks"])


def test_allreduce_starts_before_the_backward_ends(ranks: list[dict[str, Any]]) -> None:
    """Split at the buckets, an all-reduce starts while compiled backward pieces remain; the
    whole graph (one bucket) is the control: its all-reduce can only start at the end."""
    for found in ranks:
        events = found["overlap_split"]["events"]
        assert events.count("piece") >= 3, events
        assert events.index("allreduce") < len(events) - 1 - events[::-1].index("piece"), events
        whole = found["overlap_whole"]["events"]
        assert whole.count("piece") == 1, whole
        assert whole.index("allreduce") > whole.index("piece"), whole
