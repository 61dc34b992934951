"""The processes of the FSDP2 and checkpoint tests (``test_fsdp.py``, ``test_checkpoint.py``):
each rank trains a compiled and an eager model side by side on gloo, or saves and loads a
compiled model's state with ``torch.distributed.checkpoint``, and saves what the test checks."""

import gc
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ddp_workers import start
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
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


def sharded(policy: MixedPrecisionPolicy, compile_first: bool = False) -> Blocks:
    """The model with each block and the root ``fully_shard``-ed; ``compile_first`` compiles
    each block before sharding it (``fully_shard(kiln.compile(block))``)."""
    torch.manual_seed(0)
    model = Blocks()
    for index, block in enumerate(model.blocks):
        model.blocks[index] = kiln.compile(block) if compile_first else block
        fully_shard(model.blocks[index], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def train_fsdp(rank: int, scope: str, policy: MixedPrecisionPolicy) -> dict[str, Any]:
    """Losses and every (full) gradient's difference from eager FSDP2, per step; ``scope``:
    the whole model compiled, each sharded block, or each block compiled, then sharded."""
    graphs = kiln.counters.graphs
    eager, model = sharded(policy), sharded(policy, compile_first=scope == "blocks_first")
    compiled: Any = model
    if scope == "blocks":
        for index, block in enumerate(model.blocks):
            model.blocks[index] = kiln.compile(block)
    elif scope == "whole":
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
    """Save a trained compiled model's and its optimizer's state with DCP, load them into a
    fresh compiled model and optimizer: the keys (plain and DCP's), and whether every
    parameter and every optimizer moment came back."""
    make: Any = {
        "ddp": lambda: DDP(kiln.compile(Blocks())),
        "ddp_outer": lambda: kiln.compile(DDP(Blocks())),
        "fsdp": lambda: kiln.compile(sharded(MixedPrecisionPolicy())),
    }[kind]
    models, optimizers = [], []
    for seed in (1, 2):
        torch.manual_seed(seed)
        models.append(make())
        optimizers.append(torch.optim.AdamW(models[-1].parameters(), lr=0.1))
        models[-1](torch.randn(4, 16) + rank + seed).square().mean().backward()
        optimizers[-1].step()
    model, fresh = models
    saved_model, saved_optimizer = get_state_dict(model, optimizers[0])
    dcp.save({"model": saved_model, "optim": saved_optimizer}, checkpoint_id=folder / kind)
    state_model, state_optimizer = get_state_dict(fresh, optimizers[1])
    state = {"model": state_model, "optim": state_optimizer}
    dcp.load(state, checkpoint_id=folder / kind)
    keys = list(state["model"])  # (set_state_dict renames them in place)
    optimizer_keys = list(state["optim"]["state"])
    set_state_dict(
        fresh, optimizers[1], model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    same = [
        torch.equal(_full(p), _full(q))
        for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
    ]
    moments = [
        torch.equal(
            _full(optimizers[0].state[p]["exp_avg"]), _full(optimizers[1].state[q]["exp_avg"])
        )
        for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
    ]
    return {
        "keys": list(model.state_dict()),
        "dcp_keys": keys,
        "optimizer_keys": optimizer_keys,
        "same": same + moments,
    }


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
        "whole": train_fsdp(rank, "whole", plain),
        "per_block": train_fsdp(rank, "blocks", plain),
        "blocks_first": train_fsdp(rank, "blocks_first", plain),
        "bf16": train_fsdp(rank, "whole", bf16),
        "counters": counted(),
    }
    torch.save(results, Path(out) / f"rank{rank}.pt")
    gc.collect()  # (models and their hooks before the group; gloo aborted at exit otherwise)
    dist.barrier()
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
    gc.collect()  # (models and their hooks before the group; gloo aborted at exit otherwise)
    dist.barrier()
    dist.destroy_process_group()
