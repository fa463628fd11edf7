"""The inner training loop's pieces: inner optimizer, learning-rate schedule, one step (its micro-batches and
its autocast), evaluation.

Shared by the in-process simulator, the data-parallel baseline and the worker process, so that every
method trains with exactly the same code.
"""

from __future__ import annotations

import contextlib
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


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context a forward pass and its loss run in: bf16 autocast on the device's kind (cpu or cuda) for
    precision "bf16", nothing for "fp32". The parameters stay fp32 either way (autocast casts on the fly)."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16")


def forward_backward(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batches: int = 1, precision: str = "fp32"
) -> float:
    """Loss of one batch; gradients accumulate into .grad. With `micro_batches` N > 1 the batch runs as N
    equal parts, one forward and backward each, every part's loss scaled by 1/N: the gradients and the loss
    returned (the parts' mean) are the whole batch's, up to float round-off, in 1/N of its activation
    memory. A DDP model all-reduces at the last part's backward only. `precision`: see autocast()."""
    if x.shape[0] % micro_batches:
        raise ValueError(f"a batch of {x.shape[0]} rows does not split into {micro_batches} micro-batches")
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    total = torch.zeros((), device=x.device)
    parts = list(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True))
    for i, (xm, ym) in enumerate(parts):
        last = i == len(parts) - 1
        with model.no_sync() if ddp and not last else contextlib.nullcontext():  # type: ignore[operator]
            with autocast(precision, x.device):
                _, loss = model(xm, ym)
            (loss / micro_batches if micro_batches > 1 else loss).backward()
        total += loss.detach().float()
    return float(total) / micro_batches


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
