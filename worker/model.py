"""The built-in model: a small byte-level GPT, in the spirit of nanoGPT's model.py.

Vocabulary 256 (raw bytes), so no tokenizer is downloaded. Sizes from ~1M to ~100M parameters are picked
by a preset name or by setting the fields of GPTConfig. The transformer blocks live in one nn.ModuleList
(`transformer.h`), which is what the fragment layout splits into fragments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 128  # context length in bytes
    vocab_size: int = 256  # byte-level: every byte is a token
    n_layer: int = 4  # transformer blocks; these are split into fragments
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # 0 for pretraining-style runs
    bias: bool = False  # no biases in Linear/LayerNorm: a little faster, no worse


# Presets by approximate parameter count (weights tied between embedding and head).
PRESETS: dict[str, GPTConfig] = {
    "nano": GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=32),  # ~60K, for tests
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128),  # ~0.8M
    "small": GPTConfig(n_layer=8, n_head=8, n_embd=256, block_size=256),  # ~6.4M
    "medium": GPTConfig(n_layer=12, n_head=12, n_embd=384, block_size=256),  # ~21M
    "large": GPTConfig(n_layer=16, n_head=16, n_embd=768, block_size=512),  # ~113M
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer["wte"].weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} bytes is longer than block_size={self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        # by key: mypy types a ModuleDict's attributes as Tensor | Module, its items as Module
        x = self.transformer["drop"](self.transformer["wte"](idx) + self.transformer["wpe"](pos))
        for block in cast(nn.ModuleList, self.transformer["h"]):
            x = block(x)
        logits = self.lm_head(self.transformer["ln_f"](x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def gpt_config(preset: str = "tiny", **overrides: Any) -> GPTConfig:
    """A preset's config with some fields overridden; unknown names get a clear error."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}: choose one of {', '.join(PRESETS)}")
    base = PRESETS[preset]
    fields = {**base.__dict__, **{k: v for k, v in overrides.items() if v is not None}}
    return GPTConfig(**fields)


def build_gpt(preset: str = "tiny", **overrides: Any) -> GPT:
    """The model factory used by the CLI (`--model tiny`, `--model small`, ...)."""
    return GPT(gpt_config(preset, **overrides))
