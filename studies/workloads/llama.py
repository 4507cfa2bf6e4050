"""A compact Llama-style decoder in PyTorch: RMSNorm, rotary embeddings, causal multi-head
attention, SwiGLU MLP, tied or untied embeddings, no biases.

Shapes: tokens (batch, seq) int64 -> logits (batch, seq, vocab) float32. Every Linear weight is
(out_features, in_features), the layout the geometry package expects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "Llama", "CONFIGS"]


@dataclass(frozen=True)
class LlamaConfig:
    """vocab: tokens; dim: model width; layers; heads (dim % heads == 0); ffn: SwiGLU hidden
    width; seq_len: max context; tied: share the embedding with the output head;
    rope_base: rotary frequency base; eps: RMSNorm epsilon."""

    vocab: int = 256
    dim: int = 256
    layers: int = 6
    heads: int = 8
    ffn: int = 688
    seq_len: int = 256
    tied: bool = True
    rope_base: float = 10000.0
    eps: float = 1e-5


CONFIGS = {
    # ~5.3M parameters: the end-to-end comparison (python -m studies train)
    "small": LlamaConfig(dim=256, layers=7, heads=8, ffn=688, seq_len=128),
    # ~85M parameters, 1,024-token sequences: the paper-scale capture a GPU runs (perf/paper_scale.sh)
    "paper-gpu": LlamaConfig(dim=768, layers=12, heads=12, ffn=2048, seq_len=1024),
    # ~0.8M parameters: the training comparison's model (studies.train --size medium)
    "medium": LlamaConfig(dim=128, layers=4, heads=4, ffn=344, seq_len=64),
    # ~246k parameters: the training grid's model (studies.train.Config's shape; docs/results.md)
    "grid": LlamaConfig(dim=96, layers=2, heads=4, ffn=256, seq_len=64),
    # a few 10^4 parameters: CI (--quick)
    "tiny": LlamaConfig(dim=64, layers=2, heads=4, ffn=160, seq_len=64),
}


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last axis (dim,)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (seq_len, head_dim // 2) float32."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of x (batch, heads, seq, head_dim)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.dim // cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        split = lambda t: t.view(b, s, self.heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        q, k = apply_rotary(q, cos[:s], sin[:s]), apply_rotary(k, cos[:s], sin[:s])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim, cfg.eps), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim, cfg.eps), SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """The decoder. forward(tokens (B, S) int64) -> logits (B, S, vocab) float32."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.heads or (cfg.dim // cfg.heads) % 2:
            raise ValueError("dim must be a multiple of heads, with an even head dimension")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.head = None if cfg.tied else nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rotary_tables(cfg.seq_len, cfg.dim // cfg.heads, cfg.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights; residual output projections scaled by 1/sqrt(2 layers)."""
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = 0.02 / math.sqrt(2 * self.cfg.layers) if name.endswith(("o.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        x = self.norm(x)
        return F.linear(x, self.embed.weight) if self.head is None else self.head(x)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Next-token cross entropy (mean over tokens, nats) of batch (B, S + 1) int64."""
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
