"""The edges a new user meets first (issue 14, part 5): a port in use named by its flag, progress while the
shard is not there, a token on one side only, a model the worker CLI cannot train, and the layout given by
the user (blocks_path, fragments) on both sides. Real processes where the behaviour is the CLI's."""

from __future__ import annotations

import contextlib
import socket

import pytest
from procs import streamdiloco


@contextlib.contextmanager
def held_port():
    """A port something listens on, for the test's duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def one_error_line(r) -> str:
    """The process's error: exactly one `streamdiloco: error:` line, and no traceback."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("streamdiloco: error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_shard_port_in_use_is_named_by_its_flag(tmp_path, flag):
    with held_port() as port:
        other = "--http-port" if flag == "--port" else "--port"
        r = streamdiloco(
            "server", "--model", "nano", flag, str(port), other, "0", "--no-checkpoint", timeout=120
        )
    assert r.returncode == 1
    assert one_error_line(r) == (
        f"streamdiloco: error: {flag} {port}: address 127.0.0.1:{port} already in use "
        "(another shard? pick another port or 0)"
    )


def test_a_worker_metrics_port_in_use_is_named_by_its_flag(tmp_path):
    with held_port() as port:
        r = streamdiloco(
            "worker",
            *("--servers", "127.0.0.1:1", "--model", "nano", "--metrics-port", str(port)),
            *("--checkpoint", str(tmp_path / "w.pt")),
            timeout=120,
        )
    assert r.returncode == 1
    assert one_error_line(r) == (
        f"streamdiloco: error: --metrics-port {port}: address 127.0.0.1:{port} already in use "
        "(another worker? pick another port or 0)"
    )


def test_launch_http_port_in_use_is_named_by_its_flag(tmp_path):
    with held_port() as port:
        # shard 1 would take port + 1: the error names the flag's value and the address taken
        r = streamdiloco(
            "launch", "--shards", "1", "--workers", "1", "--http-port", str(port), "--out", str(tmp_path)
        )
    assert r.returncode == 1
    assert one_error_line(r) == (
        f"streamdiloco: error: --http-port {port}: address 127.0.0.1:{port} already in use "
        "(another run? pick another port or 0)"
    )
