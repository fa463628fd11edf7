"""common/progress.py in closed form: a worker's progress written into a push's header and read back, the
header's bytes as the proto says, and every field a shard refuses, each with its own message."""

from __future__ import annotations

import math

import pytest

from streamdiloco.common.progress import (
    MAX_COUNT,
    Progress,
    check_progress,
    progress_from_proto,
    progress_to_proto,
)
from streamdiloco.protos import streamdiloco_pb2 as pb

FULL = Progress(
    step=120,
    blocked_seconds=3.5,
    total_steps=1000,
    tokens=61_440,
    compute_utilization=0.75,
    eval_loss=2.5,
    eval_step=100,
    step_seconds=0.25,
)


@pytest.mark.parametrize(
    "progress", [FULL, Progress(), Progress(step=7, compute_utilization=0.0, eval_loss=0.0)]
)
def test_progress_goes_through_a_header_and_comes_back_the_same(progress):
    header = progress_to_proto(progress, weight=512.0, loss=3.0)
    assert check_progress(header) is None
    assert progress_from_proto(header) == progress
    again = pb.PushHeader.FromString(header.SerializeToString())  # through the wire's bytes too
    assert progress_from_proto(again) == progress


def test_the_header_is_the_protos_fields_with_their_presence_flags():
    assert progress_to_proto(FULL, 512.0, 3.0) == pb.PushHeader(
        weight=512.0,
        has_loss=True,
        loss=3.0,
        step=120,
        blocked_seconds=3.5,
        total_steps=1000,
        tokens=61_440,
        has_utilization=True,
        compute_utilization=0.75,
        has_eval_loss=True,
        eval_loss=2.5,
        eval_step=100,
        step_seconds=0.25,
    )
    # nothing said: no flag set, zeros (0 step time: not measured); a zero utilization or eval loss is said
    assert progress_to_proto(Progress(), 1.0, None) == pb.PushHeader(weight=1.0)
    said = progress_to_proto(Progress(compute_utilization=0.0, eval_loss=0.0), 1.0, 0.0)
    assert said.has_loss and said.has_utilization and said.has_eval_loss


def test_what_a_header_does_not_say_reads_as_none():
    got = progress_from_proto(pb.PushHeader(weight=1.0, compute_utilization=0.5, eval_loss=2.0))
    assert got == Progress()  # values without their flags are not said
    assert progress_from_proto(pb.PushHeader(step_seconds=0.0)).step_seconds is None


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"step": MAX_COUNT + 1}, f"the reported step must be at most 2^53, got {MAX_COUNT + 1}"),
        ({"total_steps": MAX_COUNT + 1}, "the reported total steps must be at most 2^53"),
        ({"tokens": 2**64 - 1}, f"the reported token count must be at most 2^53, got {2**64 - 1}"),
        ({"eval_step": MAX_COUNT + 1}, "the reported eval step must be at most 2^53"),
        ({"blocked_seconds": -1.0}, "the reported blocked time must be 0..1e+09 seconds, got -1.0"),
        ({"blocked_seconds": math.nan}, "the reported blocked time must be 0..1e+09 seconds, got nan"),
        ({"blocked_seconds": 2e9}, "the reported blocked time must be 0..1e+09 seconds"),
        (
            {"has_utilization": True, "compute_utilization": 1.5},
            "the reported compute utilization must be a fraction in [0, 1], got 1.5",
        ),
        (
            {"has_utilization": True, "compute_utilization": math.nan},
            "the reported compute utilization must be a fraction in [0, 1], got nan",
        ),
        (
            {"has_eval_loss": True, "eval_loss": -0.5},
            "the reported eval loss must be a cross-entropy in [0, 10000], got -0.5",
        ),
        (
            {"has_eval_loss": True, "eval_loss": math.inf},
            "the reported eval loss must be a cross-entropy in [0, 10000], got inf",
        ),
        (
            {"step_seconds": -0.25},
            "the reported step time must be 0 (not measured) or in (0, 3600] seconds, got -0.25",
        ),
        ({"step_seconds": math.nan}, "the reported step time must be 0 (not measured) or in (0, 3600]"),
        ({"step_seconds": 3601.0}, "the reported step time must be 0 (not measured) or in (0, 3600]"),
    ],
)
def test_each_field_out_of_range_is_refused_in_words(fields, message):
    problem = check_progress(pb.PushHeader(weight=1.0, **fields))
    assert problem is not None and problem.startswith(message), problem


def test_the_bounds_themselves_are_taken():
    edge = pb.PushHeader(
        step=MAX_COUNT,
        total_steps=MAX_COUNT,
        tokens=MAX_COUNT,
        eval_step=MAX_COUNT,
        blocked_seconds=1e9,
        has_utilization=True,
        compute_utilization=1.0,
        has_eval_loss=True,
        eval_loss=1e4,
        step_seconds=3600.0,
    )
    assert check_progress(edge) is None
    # values without their presence flag are not read, so they are not checked either
    assert check_progress(pb.PushHeader(compute_utilization=7.0, eval_loss=-1.0)) is None
