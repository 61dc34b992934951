"""``kiln demo``: trace a small real model, check it against eager, print the timings.

The model is a small GPT-style transformer defined here (no download). Until the code
generators land (issues 5 and 6), the graph runs on the reference ``eager`` backend, so the
"speedup" printed is the interpreter's overhead: honest, and the number later issues move.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kiln.backends import get_backend
from kiln.frontends import graph_inputs, rebuild_outputs, trace


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class TinyGPT(nn.Module):
    """A GPT-2-shaped language model: token and position embeddings, blocks, tied LM head."""

    def __init__(
        self, vocab: int = 512, width: int = 128, depth: int = 2, heads: int = 4, context: int = 128
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tokens.weight.t()


def _median_seconds(fn: Callable[[], Any], repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run_demo(backend_name: str = "eager") -> bool:
    """Trace TinyGPT, run it on ``backend_name``, compare with eager, print a report.

    Returns whether the result matched eager.
    """
    torch.manual_seed(0)
    model = TinyGPT().eval()
    ids = torch.randint(0, 512, (4, 64))
    with torch.no_grad():
        start = time.perf_counter()
        graph = trace(model, ids)
        compiled = get_backend(backend_name).compile(graph)
        inputs = graph_inputs(graph, model, ids)
        result = rebuild_outputs(graph, compiled(inputs))
        first_call = time.perf_counter() - start
        expected = model(ids)
        error = (result - expected).abs().max().item()
        eager_time = _median_seconds(lambda: model(ids))
        kiln_time = _median_seconds(lambda: compiled(graph_inputs(graph, model, ids)))
    ok = torch.allclose(result, expected, rtol=1e-4, atol=1e-4)
    print(
        f"model        TinyGPT ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), "
        f"ids {tuple(ids.shape)}, cpu, float32"
    )
    print(f"graph        {len(graph.nodes)} nodes, {len(graph.inputs)} inputs")
    print(f"backend      {backend_name}")
    print(f"correct      {'yes' if ok else 'NO'} (max abs error vs eager {error:.2e})")
    print(f"first call   {first_call * 1e3:.1f} ms (trace + compile + run)")
    print(f"eager        {eager_time * 1e3:.2f} ms")
    print(f"kiln         {kiln_time * 1e3:.2f} ms")
    print(f"speedup      {eager_time / kiln_time:.2f}x")
    return ok
