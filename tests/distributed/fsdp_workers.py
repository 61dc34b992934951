"""The processes of the FSDP2 and checkpoint tests (``test_fsdp.py``, ``test_checkpoint.py``):
each rank trains a compiled and an eager model side by side on gloo, or saves and loads a
compiled model's state with ``torch.distributed.checkpoint``, and saves what the test checks."""

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ddp_workers import start
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import kiln


class Blocks(torch.nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width))
            for _ in range(depth)
        )
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.nn.functional.gelu(block(x)) + x
        return self.head(x)


def sharded(policy: MixedPrecisionPolicy) -> Blocks:
    torch.manual_seed(0)
    model = Blocks()
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def train_fsdp(rank: int, per_block: bool, policy: MixedPrecisionPolicy) -> dict[str, Any]:
    """Losses and every (full) gradient's difference from eager FSDP2, per step."""
    graphs = kiln.counters.graphs
    eager, model = sharded(policy), sharded(policy)
    compiled: Any = model
    if per_block:
        for index, block in enumerate(model.blocks):
            model.blocks[index] = kiln.compile(block)
    else:
        compiled = kiln.compile(model)
    found: dict[str, Any] = {"losses": [], "grads": []}
    for step in range(3):
        torch.manual_seed(10 * step + rank)
        x = torch.randn(8, 16)
        for module, key in ((compiled, "kiln"), (eager, "eager")):
            module.zero_grad(set_to_none=True)
            loss = module(x).float().square().mean()
            loss.backward()
            found["losses"].append((key, loss.item()))
        found["grads"].append(
            [
                (p.grad.full_tensor() - q.grad.full_tensor()).abs().max().item()
                for p, q in zip(eager.parameters(), model.parameters(), strict=True)
            ]
        )
    found["graphs"] = kiln.counters.graphs - graphs
    return found


def checkpoint(rank: int, kind: str, folder: Path) -> dict[str, Any]:
    """Save a trained compiled model's state with DCP, load it into a fresh compiled model:
    its keys (plain and DCP's), and whether every parameter came back."""
    make: Any = {
        "ddp": lambda: DDP(kiln.compile(Blocks())),
        "ddp_outer": lambda: kiln.compile(DDP(Blocks())),
        "fsdp": lambda: kiln.compile(sharded(MixedPrecisionPolicy())),
    }[kind]
    torch.manual_seed(1)
    model = make()
    model(torch.randn(4, 16) + rank).square().mean().backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    # kiln.compile(DDP(m)) is no DDP to DCP's helpers, which name the state of a DDP module
    # without its "module." prefix: that order saves its plain state dict.
    state_of: Any = get_model_state_dict if kind != "ddp_outer" else type(model).state_dict
    dcp.save({"model": state_of(model)}, checkpoint_id=folder / kind)
    torch.manual_seed(2)
    fresh = make()
    state = {"model": state_of(fresh)}
    dcp.load(state, checkpoint_id=folder / kind)
    keys = list(state["model"])  # (set_model_state_dict renames them in place)
    if kind == "ddp_outer":
        fresh.load_state_dict(state["model"])
    else:
        set_model_state_dict(fresh, state["model"])
    same = [
        torch.equal(_full(p), _full(q))
        for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
    ]
    return {"keys": list(model.state_dict()), "dcp_keys": keys, "same": same}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor.detach()


def counted() -> dict[str, Any]:
    return {
        "graphs": kiln.counters.graphs,
        "fallbacks": [str(record) for record in kiln.counters.fallbacks],
        "breaks": [str(record) for record in kiln.counters.graph_breaks],
    }


def run_fsdp(rank: int, world: int, port: int, out: str) -> None:
    start(rank, world, port)
    plain, bf16 = MixedPrecisionPolicy(), MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    results = {
        "whole": train_fsdp(rank, per_block=False, policy=plain),
        "per_block": train_fsdp(rank, per_block=True, policy=plain),
        "bf16": train_fsdp(rank, per_block=False, policy=bf16),
        "counters": counted(),
    }
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run_checkpoint(rank: int, world: int, port: int, out: str) -> None:
    start(rank, world, port)
    folder = Path(out)
    results = {kind: checkpoint(rank, kind, folder) for kind in ("ddp", "ddp_outer", "fsdp")}
    results["reference"] = {
        "ddp": list(DDP(Blocks()).state_dict()),
        "plain": list(Blocks().state_dict()),
    }
    results["counters"] = counted()
    torch.save(results, folder / f"rank{rank}.pt")
    dist.destroy_process_group()
