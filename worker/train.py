"""The inner training loop's pieces: inner optimizer, learning-rate schedule, one step, evaluation.

Shared by the in-process simulator, the data-parallel baseline and the worker process, so that every
method trains with exactly the same code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn

from streamdiloco.common.config import InnerConfig  # the [inner] section, declared with the others


def lr_at(step: int, total_steps: int, cfg: InnerConfig) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at total_steps. `step` counts from 0."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_inner_optimizer(model: nn.Module, cfg: InnerConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay on 1-D parameters (norms, biases), as in nanoGPT."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Loss of one batch; gradients accumulate into .grad."""
    _, loss = model(x, y)
    loss.backward()
    return float(loss.detach())


CLI_MODELS = (
    "the worker CLI trains models whose forward(idx, targets) returns (logits, loss), as the built-in GPT's "
    "does; train any other model with your own loop and streamdiloco.worker.join.connect() "
    "(docs/library.md: your own model and loop)"
)


def check_model_output(model: nn.Module, x: torch.Tensor, y: torch.Tensor, spec: str) -> None:
    """Run one batch through `model` (no gradients) and check it answers as the CLI's loop expects, so that
    a model built for another loop fails here with one line naming `spec` (--model), not with a traceback
    from deep in training."""
    was_training = model.training
    model.eval()  # no dropout: the check draws nothing from the generator that training then uses
    try:
        with torch.no_grad():
            out = model(x, y)
    except Exception as e:  # any model's own error: its first line is what the user needs
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"--model {spec}: forward(idx, targets) failed ({type(e).__name__}: {first}): {CLI_MODELS}"
        ) from None
    finally:
        model.train(was_training)
    if isinstance(out, tuple | list) and len(out) == 2:
        loss = out[1]
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
            return
        got = f"a pair whose second item is {_describe(loss)}, not a scalar loss"
    else:
        got = _describe(out)
    raise ValueError(f"--model {spec}: forward(idx, targets) returned {got}: {CLI_MODELS}")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: InnerConfig) -> None:
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str = "cpu"
) -> float:
    """Mean loss over fixed validation batches."""
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        _, loss = model(x.to(device), y.to(device))
        total += float(loss)
    model.train(was_training)
    return total / max(1, len(batches))
