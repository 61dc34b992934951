"""Models shared by the program tables (small, random weights, nothing downloaded)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SmallCNN(nn.Module):
    """Conv -> BatchNorm -> ReLU -> max-pool, twice, then a classifier."""

    def __init__(self, norm: str = "batch") -> None:
        super().__init__()

        def norm_layer(c: int) -> nn.Module:
            if norm == "batch":
                return nn.BatchNorm2d(c)
            if norm == "group":
                return nn.GroupNorm(2, c)
            return nn.InstanceNorm2d(c, affine=True)

        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            norm_layer(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            norm_layer(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(16, 5)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class HandAttention(nn.Module):
    """Causal self-attention written out: QK^T / sqrt(d), masked_fill, softmax, @ V."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, c))


class SDPAttention(nn.Module):
    """The same with ``F.scaled_dot_product_attention`` (causal, or with a padding mask)."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x, mask=None):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return self.proj(out.transpose(1, 2).reshape(b, t, c))


class TransformerBlock(nn.Module):
    """Pre-norm block: LayerNorm -> attention -> residual, LayerNorm -> GELU MLP -> residual."""

    def __init__(self, attention: str = "hand", width: int = 16) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = HandAttention(width) if attention == "hand" else SDPAttention(width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x, mask=None):
        x = x + (self.attn(self.ln1(x)) if mask is None else self.attn(self.ln1(x), mask))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Token + position embeddings, two blocks, a final norm and an LM head tied to the
    token embedding."""

    def __init__(self, attention: str = "sdpa", vocab: int = 50) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, 16)
        self.positions = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([TransformerBlock(attention), TransformerBlock(attention)])
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.tokens(tokens) + self.positions(torch.arange(t))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TorchEncoder(nn.Module):
    """``nn.TransformerEncoderLayer`` (batch_first, GELU, no dropout) and a key padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            16, 2, 32, dropout=0.0, activation="gelu", batch_first=True
        )
        self.head = nn.Linear(16, 3)

    def forward(self, x, padding):
        return self.head(self.layer(x, src_key_padding_mask=padding).mean(1))


class MHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.out = nn.Linear(16, 2)

    def forward(self, q, kv):
        attended, weights = self.attn(q, kv, kv, need_weights=True)
        return self.out(attended), weights
