"""What a client can make the shard log, bounded: warnings a client can cause are written at most LOG_BURST
times per LOG_PERIOD seconds per kind (the rest counted in the next line), and the libraries' own lines
(gRPC's, uvicorn's, h11's) the same way."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("streamdiloco.shard")

LOG_PERIOD = 10.0  # seconds over which the lines of one kind of warning are counted, after the first few
LOG_BURST = 3  # lines of one kind written per period before the rest are only counted


class Throttled:
    """Warnings that a client can cause, written at most LOG_BURST times per LOG_PERIOD seconds per kind;
    the ones held back are counted in the next line written. One line each, never a traceback."""

    def __init__(self, logger: logging.Logger = log, clock: Callable[[], float] = time.monotonic):
        self.logger, self.clock = logger, clock
        self._kinds: dict[str, list[float]] = {}  # kind -> [period start, lines written, lines held back]

    def allow(self, kind: str) -> tuple[bool, int]:
        """Whether a line of this kind may be written now, and how many were held back before it."""
        now = self.clock()
        k = self._kinds.get(kind)
        held = 0
        if k is None or now - k[0] >= LOG_PERIOD:
            held = int(k[2]) if k is not None else 0
            k = self._kinds[kind] = [now, 0, 0]
        if k[1] >= LOG_BURST:
            k[2] += 1
            return False, 0
        k[1] += 1
        return True, held

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, kind, msg, *args)

    def log(self, level: int, kind: str, msg: str, *args: object) -> bool:
        """Log `msg % args` unless this kind has had its lines this period; True if it was written. `kind`
        must come from a small fixed set (not from what the client sent)."""
        ok, held = self.allow(kind)
        if ok:
            more = f" ({held} more like it in the last {LOG_PERIOD:g} s, not logged)" if held else ""
            self.logger.log(level, msg + more, *args)
        return ok


class ThrottleFilter(logging.Filter):
    """The same bound on the lines of the libraries the shard runs on (uvicorn's "Invalid HTTP request
    received." for every bad request, gRPC's for a failed call): per message template, a few per period."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.throttled = Throttled(clock=clock)
        self._templates: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = str(record.msg)[:200]
        if kind not in self._templates and len(self._templates) >= 256:
            kind = "other"  # templates are the library's own: a few dozen at most
        self._templates.add(kind)
        ok, held = self.throttled.allow(kind)
        if ok and held:
            record.msg = f"{record.msg} ({held} more like it in the last {LOG_PERIOD:g} s, not logged)"
        return ok


def throttle_library_logs() -> None:
    """Put ThrottleFilter on the loggers of uvicorn and gRPC (once per process)."""
    for name in ("uvicorn.error", "grpc._cython.cygrpc", "grpc.aio._server"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, ThrottleFilter) for f in logger.filters):
            logger.addFilter(ThrottleFilter())
