"""What a worker reports about its training, and to whom. `Progress` goes up with every push (the shards'
dashboards show it: step of total, tokens, compute utilization, the latest eval loss of the global
parameters). `ScalarLogger` is the hook for experiment trackers: the worker calls `log_scalars` with its
training loss, eval loss, tokens/s, utilization, bytes and blocked time; `TensorBoardLogger` is the one
built in (`--tensorboard DIR`), and a W&B logger is five lines (docs/monitoring.md). Nothing here talks
to a shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Progress:
    """A push header's progress fields (protos/streamdiloco.proto, PushHeader); the shard checks each."""

    step: int = 0  # inner steps done (by the run, for a worker that joined late)
    blocked_seconds: float = 0.0  # waited for updates so far
    total_steps: int = 0  # the steps it will do in all; 0: not said
    tokens: int = 0  # trained on so far
    compute_utilization: float | None = None  # compute time over training time, 0..1
    eval_loss: float | None = None  # the global parameters' latest eval loss, measured at eval_step
    eval_step: int = 0
    step_seconds: float | None = None  # median of its recent seconds per inner step, waits not counted


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
