"""The lock on a shard's checkpoint directory: one process at a time. Two shards on one directory (a
duplicate during a redeploy, a `--fresh` start while the old shard still runs) would write the same
temporary files and take turns at meta.json, and the next start would refuse what they left.

The lock is `flock` on LOCK_NAME in the directory, taken before anything is read or written there and held
for the process's life; the file says who holds it (pid, host, start time), so that a second shard refuses
with one line naming the holder. The kernel lets go of the lock when its process ends, however it ends: the
file that a killed shard leaves behind blocks nobody. What this module must not do: read or write the
checkpoint itself (server/storage/checkpoint.py does), or wait for a lock (a second shard stops at once).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from datetime import datetime
from pathlib import Path

LOCK_NAME = "shard.lock"
MAX_HOLDER_BYTES = 4096  # what is read of the holder's line


class DirectoryLock:
    """A held lock on a directory (its file stays open until `release`, or until the process ends)."""

    def __init__(self, fd: int, path: Path):
        self.fd: int | None = fd
        self.path = path

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor of the open file releases the flock
            self.fd = None


def _holder(fd: int) -> str:
    """Who holds the lock, in words, as its file says."""
    try:
        info = json.loads(os.pread(fd, MAX_HOLDER_BYTES, 0).decode("utf-8", "replace"))
        return f"pid {int(info['pid'])} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said who it is yet"


def lock_directory(directory: str | Path, flag: str = "--checkpoint-dir") -> DirectoryLock:
    """Take the lock on `directory` (made if missing) for this process, and write who holds it; ValueError
    (one line naming the holder) when another process holds it."""
    folder = Path(directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise OSError(f"{flag} {folder}: cannot make its lock file ({e.strerror or e})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ValueError(
            f"{flag} {folder} is in use by another shard ({holder}): stop that one first, or give this one "
            f"another {flag}"
        ) from None
    except OSError as e:  # a file system without locks
        os.close(fd)
        raise OSError(f"{flag} {folder}: cannot lock {LOCK_NAME} ({e.strerror or e})") from None
    started = datetime.now().astimezone().isoformat(timespec="seconds")
    line = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}) + "\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, line.encode(), 0)
    return DirectoryLock(fd, folder / LOCK_NAME)
