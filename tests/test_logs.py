"""Logs for runs across sites (common/logs.py) and the experiment trackers (worker/report.py).

Every line of a shard and a worker is dated in ISO 8601 with milliseconds and the machine's zone; with
`--log-format json` every line a collector sees is one JSON object (time, level, logger, message and the
record's fields); `--log-level warning` leaves the info lines out; a bad value is one line. The W&B logger
is tested for real in W&B's offline mode: a worker process against a shard process writes an offline run
whose history is read back with wandb's own reader.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import re
import struct
import sys
import types
import warnings
from datetime import datetime
from pathlib import Path

import pytest

from streamdiloco.common.logs import JsonFormatter, TextFormatter, asked_format, iso_time, setup_logging
from streamdiloco.launch import echo_line
from streamdiloco.worker.report import TrackedScalars, WandbLogger
from tests.support.nowire import NoWire
from tests.support.procs import ROOT, Cluster, streamdiloco

# 2026-11-26T15:31:02.123+00:00 (any zone: the machine's own)
ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"
TEXT_LINE = re.compile(rf"^{ISO} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
KEYS = {"time", "level", "logger", "message"}
NANO = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3"]
WORK = [
    *NANO,
    "--steps",
    "12",
    "--batch-size",
    "2",
    "--log-every",
    "4",
    "--eval-every",
    "0",
    "--eval-batches",
    "1",
]


def _record(fmt: logging.Formatter, msg: str, *args, exc=None, **extra) -> str:
    record = logging.LogRecord("streamdiloco.worker", logging.INFO, __file__, 1, msg, args, exc)
    record.__dict__.update(extra)
    return fmt.format(record)


# --- the formats --------------------------------------------------------------------------------------
def test_iso_time_has_milliseconds_and_the_zone_and_is_the_moment_it_says():
    text = iso_time(1_800_000_000.1234)
    assert re.fullmatch(ISO, text), text
    assert datetime.fromisoformat(text).timestamp() == pytest.approx(1_800_000_000.123, abs=1e-6)


def test_the_text_format_dates_each_line():
    line = _record(TextFormatter(), "w step %d", 4)
    assert TEXT_LINE.match(line) and line.endswith(" INFO streamdiloco.worker: w step 4"), line


def test_a_json_record_is_one_line_with_its_fields_and_the_exception_as_a_string():
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        exc = sys.exc_info()
    line = _record(JsonFormatter(), "w step %d", 4, exc=exc, step=4, loss=float("nan"), hashes=[["ab"]])
    assert "\n" not in line
    got = json.loads(line)
    assert got["message"] == "w step 4" and got["level"] == "INFO" and got["logger"] == "streamdiloco.worker"
    assert re.fullmatch(ISO, got["time"]) and got["step"] == 4 and got["loss"] == "nan"
    assert got["hashes"] == [["ab"]]
    assert "Traceback" in got["exception"] and "boom\nsecond line" in got["exception"]


def test_setup_logging_routes_warnings_and_library_loggers_through_the_format():
    out = io.StringIO()
    root = logging.getLogger()
    before = root.handlers[:], root.level
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        try:
            setup_logging("info", "json", stream=out)
            logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.")
            logging.getLogger("grpc.aio._server").warning("a failed call")
            logging.getLogger("streamdiloco.shard").debug("not at info")
            logging.getLogger("streamdiloco.shard").info("round %d closed", 3, extra={"round": 3})
            warnings.warn("a library's warning", UserWarning, stacklevel=1)
        finally:
            setup_logging("info", "text")  # the hooks back as they were
            logging.captureWarnings(False)
            for handler in root.handlers[:]:
                if handler not in before[0]:
                    root.removeHandler(handler)
            root.setLevel(before[1])
    records = [json.loads(line) for line in out.getvalue().splitlines()]  # every line parses
    ours = ("uvicorn.error", "grpc.aio._server", "streamdiloco.shard", "py.warnings")
    assert [r["logger"] for r in records if r["logger"] in ours] == list(ours), records
    assert all(KEYS <= set(r) for r in records) and "not at info" not in out.getvalue()
    assert next(r for r in records if r["logger"] == "streamdiloco.shard")["round"] == 3


def test_bad_values_are_one_line_and_asked_format_reads_an_unparsed_command_line():
    with pytest.raises(
        ValueError, match=r"^--log-level must be one of debug, info, warning, error, got 'loud'$"
    ):
        setup_logging("loud")
    with pytest.raises(ValueError, match=r"^--log-format must be one of text, json, got 'xml'$"):
        setup_logging("info", "xml")
    assert asked_format(["worker", "--log-format", "json"]) == "json"
    assert asked_format(["worker", "--log-format=text"]) == "text"
    assert asked_format(["worker"]) is None


def test_launch_shows_a_childs_json_record_with_its_name_and_wraps_a_line_that_is_none():
    rec = json.loads(
        echo_line("shard0", '{"time": "t", "level": "INFO", "logger": "x", "message": "m"}\n', True)
    )
    assert rec["process"] == "shard0" and rec["message"] == "m"
    wrapped = json.loads(echo_line("worker-1", "Segmentation fault\n", True))
    assert (
        wrapped["process"] == "worker-1"
        and wrapped["message"] == "Segmentation fault"
        and KEYS <= set(wrapped)
    )
    assert echo_line("worker-1", "a line\n", False) == "[worker-1] a line\n"


# --- real processes -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> tuple[Cluster, Path]:
    """One run of a shard and a worker in the text format, for the two tests below (real processes are the
    slow part); where wandb is installed the worker also writes a W&B run in its offline mode."""
    tmp = tmp_path_factory.mktemp("text_run")
    has_wandb = importlib.util.find_spec("wandb") is not None
    tracked = ["--wandb-project", "streamdiloco-test", "--wandb-run-name", "site-a"] if has_wandb else []
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "WANDB_SILENT": "true"}
    with Cluster(tmp, env=env) as c:
        target, _ = c.shard("shard", *NANO)
        c.worker("w", [target], *WORK, *tracked)
        assert c.wait("w") == 0, c.log("w")[-3000:]
    return c, tmp


def test_text_lines_of_a_shard_and_a_worker_are_dated(text_run):
    """The text format's ISO dates on every line of a shard's and a worker's."""
    c, _ = text_run
    for name in ("shard", "w"):
        lines = [x for x in c.log(name).splitlines() if x.strip()]
        assert lines and all(TEXT_LINE.match(x) for x in lines), c.log(name)[-3000:]
    assert re.search(rf"^{ISO} INFO streamdiloco.worker: w step 12/12 ", c.log("w"), re.M)


def test_the_worker_writes_a_wandb_offline_run_with_its_losses(text_run):
    """W&B in its offline mode: the worker's run, read back from the files W&B writes, has the training
    loss at every --log-every step and the eval losses."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'streamdiloco[wandb]')")
    _, tmp_path = text_run
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))
    history = _wandb_history(runs[0])
    losses = [(row["_step"], row["train/loss"]) for row in history if "train/loss" in row]
    assert [s for s, _ in losses] == [4, 8, 12] and all(0 < x < 10 for _, x in losses)
    assert [row["_step"] for row in history if "eval/loss" in row] == [0, 12]  # at the start and the end
    assert {"sync/bytes_sent", "perf/tokens_per_second"} <= {k for row in history for k in row}


def test_json_lines_of_a_shard_and_a_worker_parse_one_by_one_and_warning_hides_info(tmp_path):
    with Cluster(tmp_path) as c:
        target, _ = c.shard("shard", *NANO, "--log-format", "json")
        c.worker("w", [target], *WORK, "--log-format", "json")
        assert c.wait("w") == 0, c.log("w")[-3000:]
        # --log-level warning: a shard that serves (its info lines say so) says nothing
        c.shard("quiet", *NANO, "--log-level", "warning")
    records = {}
    for name in ("shard", "w"):
        records[name] = [json.loads(line) for line in c.log(name).splitlines()]  # every line parses
        assert records[name] and all(KEYS <= set(r) for r in records[name])
        assert all(re.fullmatch(ISO, r["time"]) for r in records[name])
    assert any(r["logger"] == "streamdiloco.shard" and r["level"] == "INFO" for r in records["shard"])
    progress = [r for r in records["w"] if "step" in r and "loss" in r]
    assert [r["step"] for r in progress] == [4, 8, 12] and all(r["steps"] == 12 for r in progress)
    assert any("gRPC on" in r["message"] for r in records["shard"]), c.log("shard")[-3000:]
    assert c.log("quiet").strip() == "", c.log("quiet")


def test_a_bad_log_flag_is_one_line_and_json_makes_argparse_errors_records_too():
    r = streamdiloco("server", "--log-level", "loud", timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines == [
        "streamdiloco: error: --log-level must be one of debug, info, warning, error, got 'loud'"
    ], r.stderr
    r = streamdiloco(
        "worker", "--servers", "127.0.0.1:1", "--log-format", "json", "--no-such-flag", timeout=60
    )
    records = [json.loads(line) for line in r.stderr.strip().splitlines()]
    assert r.returncode == 2 and len(records) == 1 and records[0]["level"] == "ERROR", r.stderr
    assert "--no-such-flag" in records[0]["message"]
    r = streamdiloco("worker", "--servers", "localhost", "--log-format", "json", timeout=60)
    records = [json.loads(line) for line in r.stderr.strip().splitlines()]
    assert r.returncode == 2 and "is not HOST:PORT" in records[-1]["message"], r.stderr


# --- the trackers -------------------------------------------------------------------------------------
class Recording:
    def __init__(self):
        self.got: list = []

    def log_scalars(self, step, scalars):
        self.got.append((step, dict(scalars)))

    def close(self):
        self.got.append("closed")


def test_tracked_scalars_log_every_n_steps_and_the_last_and_close_once():
    rec = Recording()
    t = TrackedScalars([rec], every=2)
    for step in range(1, 6):
        t.count(10, float(step))
        t.stepped(step, 5, {"sync/bytes_sent": step * 100})
    t.log(5, {"eval/loss": 2.5})
    t.close()
    t.close()
    steps = [(s, x["train/loss"], x["sync/bytes_sent"]) for s, x in rec.got[:-2]]
    assert steps == [(2, 1.5, 200), (4, 3.5, 400), (5, 5.0, 500)]  # each the mean since the last
    assert all(x["perf/tokens_per_second"] > 0 for _, x in rec.got[:-2])
    assert rec.got[-2:] == [(5, {"eval/loss": 2.5}), "closed"]


def test_the_engine_feeds_its_loggers_every_log_every_steps_each_eval_loss_and_closes_them():
    """What connect(loggers=..., log_every=...) hands the engine, with no shard: steps 1..4 send nothing."""
    from streamdiloco.common.config import SyncConfig
    from streamdiloco.common.fragments import build_layout
    from streamdiloco.worker.engine import SyncEngine
    from streamdiloco.worker.model import build_gpt

    model, rec = build_gpt("nano"), Recording()
    layout = build_layout(model, 3, "strided")
    engine = SyncEngine(model, layout, SyncConfig(num_fragments=3), NoWire(), 90, loggers=[rec], log_every=2)
    for loss in (4.0, 3.0, 2.0, 1.0):
        engine.step(512, loss)
    engine.report(eval_loss=2.5, compute_utilization=0.5)
    engine.close()
    assert [(s, x["train/loss"]) for s, x in rec.got[:2]] == [(2, 3.5), (4, 1.5)]
    assert {"sync/blocked_seconds", "sync/bytes_sent", "sync/bytes_received"} <= set(rec.got[0][1])
    assert rec.got[2:] == [(4, {"eval/loss": 2.5}), "closed"]


def test_without_wandb_its_flag_is_one_line_saying_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails as when not installed
    with pytest.raises(ValueError) as e:
        WandbLogger("my-run")
    assert str(e.value).startswith("--wandb-project needs the wandb package: pip install wandb")
    assert "\n" not in str(e.value)


def test_the_manuals_connect_snippet_hands_its_loggers_to_the_engine(monkeypatch):
    """docs/monitoring.md's snippet for your own loop, against a stand-in connect that records its options."""
    import streamdiloco.worker.join as join

    text = (ROOT / "docs" / "monitoring.md").read_text()
    code = re.search(
        r"```py\n(from streamdiloco.worker.report import WandbLogger\n.*?)```", text, re.S
    ).group(1)
    got: dict = {}
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **init: got.setdefault("init", init) and types.SimpleNamespace()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setattr(join, "connect", lambda model, servers, *a, **kw: got.setdefault("connect", kw))
    exec(compile(code.split("# your loop")[0], "docs/monitoring.md", "exec"), {"model": object()})
    assert got["init"]["project"] == "my-run"
    assert isinstance(got["connect"]["loggers"][0], WandbLogger) and got["connect"]["log_every"] == 20


@pytest.mark.slow  # in `make test-slow`; the shard's and worker's own flags are tested above
def test_launch_hands_its_log_flags_to_its_children_and_its_json_lines_parse(tmp_path):
    out = tmp_path / "run"
    r = streamdiloco(
        "launch",
        *("--shards", "1", "--workers", "1", "--out", str(out), "--log-format", "json"),
        *(*WORK, "--log-every", "6"),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = [json.loads(line) for line in r.stdout.splitlines()]  # every line parses
    assert {r.get("process") for r in records} >= {"shard0", "worker-0", None}
    assert any(r["logger"] == "streamdiloco.launch" and "summary" in r for r in records)
    for name in ("shard0", "worker-0"):  # each child logged in JSON itself
        assert all(KEYS <= set(json.loads(x)) for x in (out / f"{name}.log").read_text().splitlines())


def _wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline run's .wandb file: W&B's record log (a 7-byte header, then records in
    32 KiB blocks, each record's 7-byte header: checksum, length, kind) of wandb's own protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, part, rows = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows
