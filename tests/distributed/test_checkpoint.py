"""``torch.distributed.checkpoint`` of compiled models (DDP and FSDP2, two processes on gloo;
``fsdp_workers.py``): state dict keys are the original module's, and a checkpoint of model and
optimizer saved from one compiled model loads into another."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_ddp import free_port

import kiln

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="no gloo backend")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import fsdp_workers

    out = tmp_path_factory.mktemp("checkpoint")
    mp.spawn(fsdp_workers.run_checkpoint, args=(2, free_port(), str(out)), nprocs=2)
    return [torch.load(Path(out) / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("kind", ["ddp", "ddp_outer", "fsdp"])
def test_save_and_load(ranks: list[dict[str, Any]], kind: str) -> None:
    for found in ranks:
        result, reference = found[kind], found["reference"]
        wrapped = reference["plain" if kind == "fsdp" else "ddp"]
        assert result["keys"] == wrapped
        # DCP names a DDP module's state without "module."; kiln.compile(DDP(m)) is no DDP
        # to it, so that order keeps the prefix (its model and optimizer state agree).
        expected = wrapped if kind == "ddp_outer" else reference["plain"]
        assert result["dcp_keys"] == expected
        assert result["optimizer_keys"] == expected
        assert result["same"] and all(result["same"]), result["same"]
    assert ranks[0]["counters"]["graphs"] >= 2


def test_state_dict_keys_are_the_original_modules() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    compiled = kiln.compile(model)
    assert list(compiled.state_dict()) == list(model.state_dict())
    state = {k: torch.rand_like(v.float()).to(v.dtype) for k, v in model.state_dict().items()}
    compiled.load_state_dict(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    parent = torch.nn.ModuleDict({"inner": compiled})  # nested: keys keep the parent's prefix
    assert list(parent.state_dict()) == [f"inner.{k}" for k in model.state_dict()]
    parent.load_state_dict(parent.state_dict())
