"""A fork server for the tests' `python -m streamdiloco ...` processes.

Every shard, worker, launch and export that a test starts is a real process, but starting one costs about
4 s of CPU before it does anything: importing torch, numpy, numba, FastAPI and gRPC. The suite starts a few
hundred, on a 2-core machine. This module runs one interpreter per test process that imports all of that
once and then forks a child for each command: the child is an ordinary process (its own pid, its own
memory, signals and exit status as usual) that runs `python -m streamdiloco ARGS` from the point where the
imports are done. It saves the imports and nothing else: every child parses its flags, builds its model,
opens its sockets and exits as a fresh interpreter would.

Nothing runs in the server between imports and fork: no thread starts (torch, numba and gRPC start theirs
lazily, at the first op, kernel or channel) and no socket opens, which is what makes the fork safe.
A request whose environment differs from the server's in what an import reads (PYTHONPATH, the numba
switch) gets a fresh interpreter instead (`procs.start_process` decides).

The server reads one JSON request per line on stdin and writes one JSON line per event on stdout:
{"started": id, "pid": pid} after a fork, {"exited": pid, "code": returncode} once a child is reaped
(returncode as subprocess gives it: negative for a signal).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys

# What a child would otherwise import on its own; a change here changes only how fast the tests start.
PRELOAD = (
    "torch",
    "numpy",
    "numba",
    "fastapi",
    "uvicorn",
    "grpc",
    "prometheus_client",
    "safetensors.torch",
    "streamdiloco.cli",
    "streamdiloco.server.main",
    "streamdiloco.worker.run",
)


def _child(request: dict, fds: tuple[int, int]) -> None:
    """In the forked child: become `python -m streamdiloco ARGS` with the request's files, directory and
    environment, run it, and exit as an interpreter would. Never returns."""
    code = 1
    try:
        for fd in fds:
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        err = request["stderr"] and os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(err or out, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)
        sys.path[0] = request["cwd"]  # as `python -m` puts the working directory first
        sys.argv = ["streamdiloco", *request["args"]]
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
        import runpy

        try:
            runpy.run_module("streamdiloco", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:  # as the interpreter does: die of SIGINT
            _finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        _finish()
    finally:
        os._exit(code)


def _finish() -> None:
    """What the interpreter does at exit: wait for non-daemon threads, run atexit, flush."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def serve() -> None:
    requests, replies = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # nothing of the server's may sit in a buffer that a child would flush into its log
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # a fork would copy a process whose other threads are gone: refuse to serve
        raise SystemExit(f"forkserver: {threads} threads after the imports; forking is not safe")

    def send(obj: dict) -> None:
        os.write(replies, (json.dumps(obj) + "\n").encode())

    send({"ready": os.getpid()})
    buf = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([requests], [], [], 0.02)
        if readable:
            chunk = os.read(requests, 65536)
            if not chunk:  # the test process is gone: its children go too
                for pid in children:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request, (requests, replies))
                children.add(pid)
                send({"started": request["id"], "pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
