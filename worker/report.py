"""What a worker reports about its training to experiment trackers (what its pushes report to the shards'
dashboards is common/progress.py's `Progress`). `ScalarLogger` is the hook: the sync engine
(`TrackedScalars`) calls `log_scalars` with the training loss, eval loss, tokens/s, utilization, bytes and
blocked time, for the `streamdiloco worker` command and for `connect(model, servers, loggers=[...])` alike.
Two are built in: `TensorBoardLogger` (`--tensorboard DIR`) and `WandbLogger` (`--wandb-project NAME`), each
importing its package only when made. Nothing here talks to a shard.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Protocol


class ScalarLogger(Protocol):
    """Where a worker's scalars go besides its log and the shards: called on the training thread, between
    steps (every --log-every steps, and after each evaluation), so it must not block for long."""

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    """Scalars as TensorBoard event files in `logdir` (torch.utils.tensorboard; needs the `tensorboard`
    package: pip install tensorboard). Tags are grouped: train/loss, eval/loss, ..."""

    def __init__(self, logdir: str, flag: str = "--tensorboard") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's module imports tensorboard at once
            raise ValueError(f"{flag} needs the tensorboard package: pip install tensorboard") from None
        try:
            self.writer = SummaryWriter(log_dir=logdir)
        except OSError as e:
            raise ValueError(f"{flag} {logdir}: cannot write there ({e.strerror or e})") from None

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Scalars to a Weights & Biases run (`--wandb-project NAME`, `--wandb-run-name`; needs the `wandb`
    package: pip install wandb, imported only here). With WANDB_MODE=offline the run is written under
    WANDB_DIR (or ./wandb) for `wandb sync` later; W&B's own settings (WANDB_API_KEY, WANDB_ENTITY, ...)
    come from its environment variables as usual. `init` goes to wandb.init (group, tags, ...)."""

    def __init__(
        self,
        project: str,
        name: str | None = None,
        config: dict[str, Any] | None = None,
        flag: str = "--wandb-project",
        **init: Any,
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise ValueError(
                f"{flag} needs the wandb package: pip install wandb (or pip install 'streamdiloco[wandb]')"
            ) from None
        try:
            self.run = wandb.init(project=project, name=name, config=config, **init)
        except Exception as e:  # wandb raises its own kinds (no login, no network, a bad setting)
            raise ValueError(f"{flag} {project}: W&B did not start a run ({type(e).__name__}: {e})") from None

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class TrackedScalars:
    """What the sync engine hands its ScalarLoggers: every `every` schedule steps (and at the last one) the
    training loss (the mean of the losses given to step() since the last time), tokens/s over that span,
    the compute utilization when reported, blocked seconds and bytes so far; each eval loss reported at
    once. It closes the loggers once, when the engine closes."""

    def __init__(self, loggers: Sequence[ScalarLogger] = (), every: int = 20) -> None:
        if every < 1:
            raise ValueError(f"log_every must be at least 1, got {every}")
        self.loggers, self.every = list(loggers), every
        self.losses: list[float] = []
        self.tokens = 0
        self.since = time.perf_counter()
        self.closed = False

    def count(self, tokens: int, loss: float | None) -> None:
        """An inner step's tokens and loss."""
        self.tokens += tokens
        if loss is not None and math.isfinite(loss):
            self.losses.append(float(loss))

    def stepped(self, step: int, total: int | None, sync: dict[str, float]) -> None:
        """A schedule step ended: the scalars, if it is a step to log them at."""
        if not self.loggers or (step % self.every and step != total):
            return
        now = time.perf_counter()
        scalars = {"train/loss": sum(self.losses) / len(self.losses)} if self.losses else {}
        if now > self.since:
            scalars["perf/tokens_per_second"] = self.tokens / (now - self.since)
        self.losses, self.tokens, self.since = [], 0, now
        self.log(step, {**scalars, **sync})

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for logger in self.loggers:
            logger.log_scalars(step, scalars)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for logger in self.loggers:
                logger.close()
