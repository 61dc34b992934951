"""The processes of the DDP tests: each rank trains a compiled and an eager DDP model side by
side on gloo and saves what the test checks (``test_ddp.py`` spawns them)."""

import copy
import gc
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import kiln


def start(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


class Net(torch.nn.Module):
    """Layers of several bucket sizes; ``unused`` takes part only when asked."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 3)
        self.unused = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, use_all: bool = False) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x)) + x
        out = self.head(x)
        return out + self.unused(x) if use_all else out


def differences(a: torch.nn.Module, b: torch.nn.Module) -> list[float]:
    """Max difference of every parameter's gradient (inf where one has none)."""
    out = []
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        if p.grad is None or q.grad is None:
            out.append(0.0 if p.grad is None and q.grad is None else float("inf"))
        else:
            out.append((p.grad - q.grad).abs().max().item())
    return out


def train_pair(
    rank: int,
    compiled: Callable[[torch.nn.Module], torch.nn.Module],
    steps: int = 3,
    accumulate: int = 1,
    use_all: bool = True,
    **ddp_args: Any,
) -> dict[str, Any]:
    """Train ``compiled(net)`` and ``DDP(copy of net)`` on the same per-rank batches: losses
    and every gradient's difference per step."""
    graphs, fallbacks = kiln.counters.graphs, len(kiln.counters.fallbacks)
    torch.manual_seed(0)
    net = Net()
    eager = DDP(copy.deepcopy(net), **ddp_args)
    model = compiled(net)
    found: dict[str, Any] = {"losses": [], "grads": []}
    for step in range(steps):
        for model_ in (model, eager):
            model_.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            torch.manual_seed(100 * step + 10 * micro + rank)
            x = torch.randn(8, 16)
            syncing = micro == accumulate - 1
            for model_, key in ((model, "kiln"), (eager, "eager")):
                ddp = model_ if isinstance(model_, DDP) else model_._orig_mod
                with ddp.no_sync() if not syncing else _Nothing():
                    loss = model_(x, use_all).square().mean()
                    loss.backward()
                found["losses"].append((key, loss.item()))
        found["grads"].append(differences(model, eager))
    found["graphs"] = kiln.counters.graphs - graphs
    found["fallbacks"] = len(kiln.counters.fallbacks) - fallbacks
    return found


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def overlap(rank: int, bucket_cap_mb: float) -> dict[str, Any]:
    """Events of one backward of ``kiln.compile(DDP(net))``: each compiled piece's backward
    ending (``piece``) and each bucket's all-reduce starting (``allreduce``)."""
    torch.manual_seed(0)
    ddp = DDP(Net(width=64, depth=6), bucket_cap_mb=bucket_cap_mb)
    events: list[str] = []

    def allreduce(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        events.append("allreduce")
        work = dist.all_reduce(bucket.buffer().div_(2), async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    ddp.register_comm_hook(None, allreduce)
    model = kiln.compile(ddp)
    for _ in range(2):  # the second step runs DDP's rebuilt buckets
        events.clear()
        loss = model(torch.randn(8, 64) + rank, True).square().mean()
        for node in _kiln_backward_nodes(loss.grad_fn):
            node.register_hook(lambda *_: events.append("piece"))
        loss.backward()
    return {"events": events}


def _kiln_backward_nodes(root: Any) -> list[Any]:
    seen, stack, found = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "_FunctionBackward":
            found.append(node)
        stack.extend(next_ for next_, _ in node.next_functions)
    return found


def _outer(net: torch.nn.Module, **ddp_args: Any) -> Any:
    return kiln.compile(DDP(net, **ddp_args))


def _inner(net: torch.nn.Module, **ddp_args: Any) -> Any:
    return DDP(kiln.compile(net), **ddp_args)


def run(rank: int, world: int, port: int, out: str) -> None:
    start(rank, world, port)
    results = {
        "inner": train_pair(rank, _inner),
        "outer": train_pair(rank, _outer),
        "outer_split": train_pair(rank, lambda n: _outer(n, bucket_cap_mb=0.001)),
        "inner_split": train_pair(rank, lambda n: _inner(n, bucket_cap_mb=0.001)),
        "no_sync": train_pair(rank, _outer, accumulate=3),
        "unused": train_pair(
            rank,
            lambda n: _outer(n, find_unused_parameters=True),
            use_all=False,
            find_unused_parameters=True,
        ),
        "overlap_split": overlap(rank, bucket_cap_mb=0.02),
        "overlap_whole": overlap(rank, bucket_cap_mb=1000),
        "counters": {
            "graphs": kiln.counters.graphs,
            "fallbacks": [str(record) for record in kiln.counters.fallbacks],
            "breaks": [str(record) for record in kiln.counters.graph_breaks],
        },
    }
    torch.save(results, Path(out) / f"rank{rank}.pt")
    gc.collect()  # (models and their hooks before the group; gloo aborted at exit otherwise)
    dist.barrier()
    dist.destroy_process_group()
