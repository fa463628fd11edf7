"""Errors for a port that cannot be listened on, naming the flag that chose it.

"[Errno 98] Address already in use" says neither which port nor which of a process's flags to change; a
shard listens on two ports (--port, --http-port), a worker on one (--metrics-port), and `launch` hands ports
to its children. Every place that binds turns the OSError into one line such as
`--port 7070: address 127.0.0.1:7070 already in use (another shard? pick another port or 0)`.

`parse_target` checks a shard's HOST:PORT (torch-free: the command line checks --servers before it imports
torch). `free_ports` picks ports that nothing listens on (launch's children, the benchmarks' and the tests'
processes). Pure apart from `probe` and `free_ports`, which bind a socket for a moment. No networking beyond
that.
"""

from __future__ import annotations

import errno
import socket


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_error(
    flag: str,
    host: str,
    port: int,
    err: OSError | None,
    holder: str = "another process",
    given: int | None = None,
) -> OSError:
    """One-line OSError for `err`, raised binding `host:port` chosen by `flag` (whose value was `given`, if
    not the port itself: launch's --http-port is shard 0's, shard s gets that + s); `holder` guesses who else
    listens there ("another shard", "another worker"). `err` None: the cause is unknown (gRPC says none)."""
    where = _address(host, port)
    code = err.errno if err is not None else None
    if code == errno.EADDRINUSE:
        why = f"address {where} already in use ({holder}? pick another port or 0)"
    elif code == errno.EADDRNOTAVAIL:
        why = f"{host} is not an address of this machine (pick a local address, or 0.0.0.0 for all)"
    elif code == errno.EACCES:
        why = f"no permission to listen on {where} (ports below 1024 need root: pick another port or 0)"
    elif err is not None:
        why = f"cannot listen on {where}: {err.strerror or err}"
    else:
        why = f"cannot listen on {where}: the port is in use or the address is not local"
    return OSError(f"{flag} {port if given is None else given}: {why}")


def probe(host: str, port: int) -> OSError | None:
    """Why `host:port` cannot be bound now (None if it can): for listeners that report no cause (gRPC's
    add_port only says 0). Port 0 always binds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listeners do: TIME_WAIT is fine
            s.bind((host, port))
    except OSError as e:
        return e
    return None


def parse_target(target: str) -> str:
    """Check a HOST:PORT string; returns it stripped, or raises ValueError with a one-line reason."""
    t = target.strip()
    host, sep, port = t.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--servers: {target!r} is not HOST:PORT")
    return t


def free_ports(n: int) -> list[int]:
    """n different ports on 127.0.0.1 that nothing listens on now (the processes given them bind them a
    moment later)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:  # all held open until all are picked: no port comes twice
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    return free_ports(1)[0]
