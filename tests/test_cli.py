"""The command line: bad configuration stops with one line that says what to change; runs write results."""

import json
import subprocess
import sys

import pytest

QUICK = ["--model", "nano", "--batch-size", "2", "--eval-batches", "1"]


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "streamdiloco", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--sync-every", "32", "--num-fragments", "5"], "use H=30 or H=35"),
        # SyncConfig's checks reach this one line the way the first case does; their messages are checked
        # in-process in make test (test_schedule.py::test_bad_config_says_what_to_change): in make test-slow
        pytest.param(
            ["--fragment-update-alpha", "1.5"],
            "fragment_update_alpha must be in [0, 1]",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--uplink-codec", "fp4"],
            "unknown uplink_codec 'fp4': choose one of fp32, bf16, int8, e3m0, sq2, or topkK_C",
            marks=pytest.mark.slow,
        ),
        (["--data", "/nonexistent/file.txt"], "does not exist: give --data a path to a text file"),
        pytest.param(
            ["--fragment-sync-delay", "30"],
            "fragment_sync_delay (tau=30) must be in [0, H-1]",
            marks=pytest.mark.slow,
        ),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--num-fragments", "9", "--sync-every", "9"], "8 block fragments need at least as many blocks"),
    ],
)
def test_bad_configuration_is_one_line(args, expect):
    r = run("simulate", *QUICK, "--steps", "2", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("streamdiloco: error: ") and expect in lines[0]


def test_empty_data_file(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("")
    r = run("simulate", *QUICK, "--steps", "2", "--data", str(f))
    assert r.returncode == 2 and "is empty" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_simulate_writes_json(tmp_path):
    out = tmp_path / "r.json"
    r = run(
        "simulate",
        *QUICK,
        "--steps",
        "12",
        "--sync-every",
        "6",
        "--num-fragments",
        "3",
        "--eval-every",
        "6",
        "--json",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert "step    12/12" in r.stdout  # progress lines
    res = json.loads(out.read_text())
    for key in (
        "eval_loss",
        "tokens",
        "bytes_sent_per_worker",
        "bytes_received_per_worker",
        "peak_sync_bytes",
        "wall_seconds",
    ):
        assert key in res
    assert res["tokens"] == 12 * 2 * 2 * 32
    assert res["mirrors_match_masters"] is True


# in `make test-slow`; covered by test_simulate_writes_json (the same simulator through the CLI) and
# tests/test_sim.py::test_data_parallel_equals_one_model_on_the_joined_batch (the DP side)
@pytest.mark.slow
def test_compare_prints_table_and_saves_plot(tmp_path):
    r = run(
        "compare",
        *QUICK,
        "--setups",
        "dp,full",
        "--steps",
        "6",
        "--sync-every",
        "6",
        "--num-fragments",
        "3",
        "--eval-every",
        "3",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    assert "Data-parallel" in r.stdout and "+ E3M0 up and down" in r.stdout
    png = tmp_path / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "| Data-parallel | 2 |" in (tmp_path / "results.md").read_text()


def test_help_lists_the_flags():
    r = run("simulate", "--help")
    for flag in (
        "--workers",
        "--steps",
        "--sync-every",
        "--num-fragments",
        "--fragment-sync-delay",
        "--fragment-update-alpha",
        "--uplink-codec",
        "--downlink-codec",
        "--outer-lr",
        "--data",
        "--seed",
        "--json",
        "--method",
    ):
        assert flag in r.stdout


@pytest.mark.parametrize(
    "args, expect",
    [
        (["server", "--model", "nosuchpreset"], "give a built-in preset (nano, tiny, small, medium, large)"),
        (["server", "--model", "no_such_module_xyz:build"], "cannot import 'no_such_module_xyz'"),
        (["server", "--model", "json:nothing_here"], "json has no callable 'nothing_here'"),
        (
            ["server", "--model", "nano", "--shard", "2", "--num-shards", "2"],
            "shard index 2 is outside [0, 1]",
        ),
        (["server", "--model", "nano", "--min-workers", "0"], "--min-workers must be at least 1"),
        (["server", "--model", "nano", "--sync-every", "7"], "use H=5 or H=10"),
        (["server", "--model", "nano", "--round-timeout", "inf"], "--round-timeout must be a finite number"),
        (["server", "--model", "nano", "--round-timeout", "0"], "--round-timeout must be positive"),
        (["worker", "--servers", "localhost", "--model", "nano"], "--servers: 'localhost' is not HOST:PORT"),
        (["worker", "--servers", ",", "--model", "nano"], "--servers: give at least one shard"),
        (["worker", "--servers", "127.0.0.1:1", "--steps", "0"], "--steps must be at least 1"),
        (["launch", "--uplink-codec", "fp4"], "unknown uplink_codec 'fp4'"),
        (["worker", "--servers", "127.0.0.1:1", "--resume"], "--resume needs the worker's --name"),
        (
            ["worker", "--servers", "127.0.0.1:1", "--resume", "--checkpoint", "/nonexistent/w.pt"],
            "--resume: no checkpoint at /nonexistent/w.pt",
        ),
        (
            [
                "worker",
                "--servers",
                "127.0.0.1:1",
                "--name",
                "w",
                "--resume",
                "--checkpoint",
                "/nonexistent/w.pt",
            ],
            "--resume: no checkpoint at /nonexistent/w.pt",
        ),
        (["worker", "--servers", "127.0.0.1:1", "--checkpoint-every", "-1"], "--checkpoint-every must be 0"),
        (["worker", "--servers", "127.0.0.1:1", "--step-delay", "-1"], "--step-delay must be in [0, 3600)"),
        (["worker", "--servers", "127.0.0.1:1", "--eval-every", "-1"], "--eval-every must be 0 (start"),
        (
            ["server", "--model", "nano", "--peers", "shardb:8080"],
            "--peers: give each shard's HTTP address as http(s)://HOST:PORT, got 'shardb:8080'",
        ),
        (
            ["server", "--model", "nano", "--peers-ca", "/nonexistent/ca.pem"],
            "--peers-ca /nonexistent/ca.pem: cannot read it",
        ),
        (
            ["worker", "--servers", "127.0.0.1:1", "--reconnect-timeout", "0"],
            "--reconnect-timeout must be positive",
        ),
    ],
)
def test_bad_server_and_worker_flags_are_one_line(args, expect):
    r = run(*args, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("streamdiloco: error: ") and expect in lines[0]


def test_help_lists_the_process_commands():
    r = run("--help")
    assert r.returncode == 0
    for cmd in ("server", "worker", "launch", "simulate", "compare"):
        assert cmd in r.stdout
    r = run("worker", "--help")
    assert "--servers" in r.stdout and "--sync-every" in r.stdout and "--lr" in r.stdout
    r = run("server", "--help")
    assert "--min-workers" in r.stdout and "--round-timeout" in r.stdout and "--outer-lr" in r.stdout


def _pid_of(name: str, out_dir) -> int:
    """The pid of the `launch` child named `name` (its --name, or its --shard) writing into out_dir."""
    import os

    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if name.encode() in args and any(str(out_dir).encode() in a for a in args):
            return int(pid)
    raise AssertionError(f"no process {name} for {out_dir}")


# [sigterm] in `make test`; Ctrl+C and a worker that dies end launch by the same stop, in `make test-slow`
@pytest.mark.parametrize(
    "how",
    [
        pytest.param("ctrl-c", marks=pytest.mark.slow),
        "sigterm",
        pytest.param("a-worker-dies", marks=pytest.mark.slow),
    ],
)
def test_launch_stops_every_process_it_started(tmp_path, how):
    """Ctrl+C (SIGINT to the terminal's process group), SIGTERM to launch alone, or one worker killed
    (the other would wait for its pushes for ever): every process launch started is gone."""
    import os
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "streamdiloco", "launch", *QUICK, "--steps", "100000", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    pgid = os.getpgid(proc.pid)
    try:
        seen = []
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # wait until both workers train
            seen.append(line)
            if sum("step 20/100000" in s for s in seen) >= 2 or time.monotonic() > deadline:
                break
        assert sum("step 20/100000" in s for s in seen) >= 2, "".join(seen[-30:])
        if how == "ctrl-c":
            os.killpg(pgid, signal.SIGINT)  # what Ctrl+C in a terminal does
        elif how == "sigterm":
            proc.send_signal(signal.SIGTERM)  # launch alone: it must pass it on
        else:
            os.kill(_pid_of("worker-1", tmp_path), signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        if how == "a-worker-dies":
            assert proc.returncode == 1, out[-2000:]
            assert "worker-1 stopped; stopping everything" in out
        else:
            assert proc.returncode == 130, out[-2000:]
            assert "interrupted: stopping every process" in out
        time.sleep(0.5)
        with pytest.raises(ProcessLookupError):  # nothing of the group is left
            os.killpg(pgid, 0)
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# in `make test-slow`; covered by test_checkpoint_checks.py::test_a_shard_restarted_on_its_checkpoint_...
# (a real shard resumes its checkpoint) and test_export.py::test_bad_inputs_... (another run's is named)
@pytest.mark.slow
def test_a_shard_resumes_only_a_checkpoint_of_the_same_run_and_fresh_starts_over(tmp_path):
    from tests.support.procs import http_json, shard_process

    ckpt = tmp_path / "ckpt"
    flags = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3", "--checkpoint-dir", str(ckpt)]
    with shard_process(tmp_path, *flags, name="first"):
        pass  # stopped with SIGTERM: it writes its checkpoint
    assert (ckpt / "meta.json").exists() and len(list(ckpt.glob("fragment-*.pt"))) == 3
    with shard_process(tmp_path, *flags, name="again") as (_, http, _):
        assert http_json(http)["checkpoint"]["dir"] == str(ckpt)
    assert "resumed from checkpoint" in (tmp_path / "again.log").read_text()
    other = [*flags[:3], "12", *flags[4:]]  # another H
    r = run("server", *other, "--port", "0", "--http-port", "0", timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "was written by a run with other sync settings (sync_every)" in lines[0], lines
    assert "--fresh" in lines[0]
    with shard_process(tmp_path, *other, "--fresh", name="fresh") as (_, http, _):
        assert all(f["round"] == 0 for f in http_json(http)["fragments"])
    assert json.loads((ckpt / "meta.json").read_text())["config"]["sync_every"] == 12
