"""A worker's progress as its pushes report it, declared once for both ends of the wire.

Every push's header (protos/streamdiloco.proto, PushHeader) carries the push's own weight and loss and the
worker's progress: its inner step, the seconds it has waited for updates, the steps it will do in all, the
tokens it trained on, its compute utilization, its latest eval loss of the global parameters (and the step
it was measured at), and its median seconds per inner step. `Progress` holds them; `progress_to_proto`
writes a header (the worker's link), `check_progress` is what a shard takes of a header's progress (numbers
in range: the dashboard plots them, the pace is made of the step times), and `progress_from_proto` reads a
checked one (the shard's intake). The proto's presence flags (has_utilization, has_eval_loss) and its
"0: not said" conventions are written here and nowhere else: a field that is not said is None.

Pure: no I/O, no state. It must not decide what a shard does with a push (ShardState does) nor check the
push's weight and training loss (server/rounds/staging.py does).
"""

from __future__ import annotations

from dataclasses import dataclass

from streamdiloco.common.pace import MAX_STEP_SECONDS, valid_step_seconds
from streamdiloco.protos import streamdiloco_pb2 as pb

__all__ = [
    "MAX_BLOCKED_SECONDS",
    "MAX_COUNT",
    "MAX_REPORTED_LOSS",
    "Progress",
    "check_progress",
    "progress_from_proto",
    "progress_to_proto",
]

MAX_COUNT = 1 << 53  # a step or token count beyond this is not one (a float64 holds it exactly)
MAX_BLOCKED_SECONDS = 1e9  # ~30 years: a reported wait beyond this is not a measurement
# A reported loss is a cross-entropy (the built-in GPT starts near ln 256 = 5.5): a negative one, or one
# beyond this, is not a measurement (a push's training loss on the shard is held to it too)
MAX_REPORTED_LOSS = 1e4


@dataclass(frozen=True)
class Progress:
    """What a worker reports with every push (the shards' dashboards show it; see the module's docstring)."""

    step: int = 0  # inner steps done (by the run, for a worker that joined late)
    blocked_seconds: float = 0.0  # waited for updates so far
    total_steps: int = 0  # the steps it will do in all; 0: not said
    tokens: int = 0  # trained on so far
    compute_utilization: float | None = None  # compute time over training time, 0..1
    eval_loss: float | None = None  # the global parameters' latest eval loss, measured at eval_step
    eval_step: int = 0
    step_seconds: float | None = None  # median of its recent seconds per inner step, waits not counted


def progress_to_proto(p: Progress, weight: float, loss: float | None) -> pb.PushHeader:
    """A push's header: its weight (tokens trained on since the fragment's last push) and mean training
    loss (None: not measured), and the worker's progress `p`."""
    return pb.PushHeader(
        weight=weight,
        has_loss=loss is not None,
        loss=loss or 0.0,
        step=p.step,
        blocked_seconds=p.blocked_seconds,
        total_steps=p.total_steps,
        tokens=p.tokens,
        has_utilization=p.compute_utilization is not None,
        compute_utilization=p.compute_utilization or 0.0,
        has_eval_loss=p.eval_loss is not None,
        eval_loss=p.eval_loss or 0.0,
        eval_step=p.eval_step,
        step_seconds=p.step_seconds or 0.0,
    )


def check_progress(h: pb.PushHeader) -> str | None:
    """What is wrong with the progress a push's header reports, in words (None: nothing): the counts at
    most 2^53, the blocked time 0..MAX_BLOCKED_SECONDS, the utilization a fraction, the eval loss a
    cross-entropy in [0, MAX_REPORTED_LOSS], the step time 0 (not measured) or a worker's (common/pace.py).
    NaN and infinities fail every range. A shard refuses the push of a header that fails as a whole."""
    for what, value in (
        ("step", h.step),
        ("total steps", h.total_steps),
        ("token count", h.tokens),
        ("eval step", h.eval_step),
    ):
        if value > MAX_COUNT:
            return f"the reported {what} must be at most 2^53, got {value}"
    if not (0.0 <= h.blocked_seconds <= MAX_BLOCKED_SECONDS):  # also refuses NaN
        return (
            f"the reported blocked time must be 0..{MAX_BLOCKED_SECONDS:g} seconds, got {h.blocked_seconds}"
        )
    if h.has_utilization and not (0.0 <= h.compute_utilization <= 1.0):
        return f"the reported compute utilization must be a fraction in [0, 1], got {h.compute_utilization}"
    if h.has_eval_loss and not (0.0 <= h.eval_loss <= MAX_REPORTED_LOSS):
        return (
            f"the reported eval loss must be a cross-entropy in [0, {MAX_REPORTED_LOSS:g}], got {h.eval_loss}"
        )
    if h.step_seconds != 0.0 and not valid_step_seconds(h.step_seconds):  # NaN too
        return (
            f"the reported step time must be 0 (not measured) or in (0, {MAX_STEP_SECONDS:g}] seconds, "
            f"got {h.step_seconds}"
        )
    return None


def progress_from_proto(h: pb.PushHeader) -> Progress:
    """A push header's progress, once check_progress has passed it (what is not said is None)."""
    return Progress(
        step=h.step,
        blocked_seconds=h.blocked_seconds,
        total_steps=h.total_steps,
        tokens=h.tokens,
        compute_utilization=h.compute_utilization if h.has_utilization else None,
        eval_loss=h.eval_loss if h.has_eval_loss else None,
        eval_step=h.eval_step,
        step_seconds=h.step_seconds or None,
    )
