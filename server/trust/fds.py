"""What the process's file descriptors allow: the connection caps derived from the open-file limit, leaving
RESERVE_FDS for the shard's own files (running short of descriptors must never stop a shard: its next
checkpoint write would fail)."""

from __future__ import annotations

import os
import resource

from streamdiloco.server.trust.bounds import MAX_DEFAULT_CONNECTIONS, Limits

# descriptors the shard keeps for itself beyond what it holds when it starts: checkpoint writes (the file and
# its directory, per compute thread), the dashboard's static files, /proc reads for the process metrics,
# libraries loaded late, and the one descriptor an accept takes before a connection over a cap is closed
RESERVE_FDS = 64


def open_fds() -> int:
    """Descriptors this process holds now."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself opened
    except OSError:  # no /proc: count the hard way
        return sum(_is_open(fd) for fd in range(resource.getrlimit(resource.RLIMIT_NOFILE)[0]))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def connection_caps(limits: Limits) -> tuple[int, int]:
    """(gRPC connections, HTTP connections) that fit in the open-file limit beside what the shard holds and
    RESERVE_FDS, raising the soft limit towards the hard one if that makes room. ValueError (one line) when
    the limit is too low for the caps asked for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = open_fds()
    http = limits.max_http_connections
    grpc_want = limits.max_connections or MAX_DEFAULT_CONNECTIONS
    want = in_use + RESERVE_FDS + http + grpc_want
    if soft < want and (hard == resource.RLIM_INFINITY or soft < hard):
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    room = soft - in_use - RESERVE_FDS - http
    if limits.max_connections:
        if room < limits.max_connections:
            raise ValueError(
                f"the open-file limit ({soft}, ulimit -n) leaves room for {max(room, 0)} gRPC connections "
                f"beside the {in_use} files open, {RESERVE_FDS} kept for checkpoints and {http} for HTTP, "
                f"not --max-connections {limits.max_connections}: raise the limit or lower a cap"
            )
        return limits.max_connections, http
    if room < 8:
        raise ValueError(
            f"the open-file limit ({soft}, ulimit -n) is too low: {in_use} files are open, {RESERVE_FDS} are "
            f"kept for checkpoints and {http} for HTTP connections, leaving {max(room, 0)} for workers; "
            "raise it (ulimit -n 4096) or lower --max-http-connections"
        )
    return min(room, MAX_DEFAULT_CONNECTIONS), http
