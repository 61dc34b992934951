"""``kiln demo``: compile a small real model, check it against eager, print the timings.

The model is a small GPT-style transformer defined here (no download), compiled with
``kiln.compile(model)`` exactly as a user would, on the GPU when there is one. Until the code
generators land (issues 5 and 6), the captured graph runs on the reference interpreter, so
the "speedup" printed is below 1: honest, and the number later issues move.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kiln.bench.compare import max_relative_error, passes
from kiln.bench.timing import median_seconds, timed


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


def run_demo(backend: str = "kiln", device: str | None = None) -> bool:
    """Compile TinyGPT with ``kiln.compile``, check it against eager, print a report: what the
    README's first command shows a new user. Returns whether the result matched eager."""
    import kiln

    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    model = TinyGPT().eval().to(where)
    ids = torch.randint(0, 512, (4, 64), device=where)
    kiln.reset()
    with torch.no_grad():
        compiled, first_call = timed(lambda: _compile_and_call(kiln, model, backend, ids), where)
        expected = model(ids)
        result = compiled(ids)
        eager_time, _ = median_seconds(lambda x: model(x), [ids], where, budget_s=1.0)
        kiln_time, _ = median_seconds(lambda x: compiled(x), [ids], where, budget_s=1.0)
    error = max_relative_error([result.cpu()], [expected.cpu()])
    ok = passes(error, torch.float32)
    counters = kiln.counters
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model        TinyGPT ({params:.2f}M params), ids {tuple(ids.shape)}, {where}, float32")
    print(f"compiled     kiln.compile(model, backend={backend!r})")
    print(
        f"captured     {counters.graphs} graph(s), {len(counters.graph_breaks)} graph break(s), "
        f"{len(counters.fallbacks)} frame(s) run uncompiled"
    )
    print(f"correct      {'yes' if ok else 'NO'} (max relative error vs eager {error:.1e})")
    print(f"first call   {first_call * 1e3:.1f} ms (capture + compile + run)")
    print(f"eager        {eager_time * 1e3:.2f} ms")
    print(f"kiln         {kiln_time * 1e3:.2f} ms")
    print(f"speedup      {eager_time / kiln_time:.2f}x")
    return ok


def _compile_and_call(kiln: Any, model: nn.Module, backend: str, ids: torch.Tensor) -> Any:
    compiled = kiln.compile(model, backend=backend)
    compiled(ids)
    return compiled
