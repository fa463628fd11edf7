"""How a streamdiloco process writes its log: every line dated in ISO 8601 with milliseconds and the
machine's zone (2026-11-26T15:31:02.123+00:00), at a level the user picks (`--log-level`), as text for
people or as one JSON object per line for log collectors (`--log-format json`).

`setup_logging(level, fmt)` configures the process's root logger once, at start (the CLI's main() does it
for every command; a library user may call it too). Everything that logs through Python's logging comes
out in that one format: streamdiloco's own loggers, uvicorn's and gRPC's (they propagate to the root),
Python's warnings, and in JSON an exception that nothing caught. A JSON line has `time`, `level`,
`logger`, `message`, every field given with `extra=` (`log.info("...", extra={"step": 3})`), and
`exception` (the traceback, as one string) when there is one: a record is never more than one line.
`error_line(message)` is the CLI's one-line error in the same spirit (text: `streamdiloco: error: ...`;
json: an ERROR record), and `ArgumentParser` makes argparse's own errors follow it. `escaped(text)` is how
any text that came from another process (a worker's name or fingerprint, a peer's answer) goes into a log
line: its control characters written as escapes, so that it can neither start a line of its own nor
colour the terminal.

This module imports nothing of the project and not torch (`--help` must stay quick); it configures logging
and writes nothing else.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import threading
from datetime import datetime
from typing import Any, NoReturn, TextIO

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")

# the attributes every LogRecord has: any other one came with `extra=` and goes into the JSON object
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def iso_time(created: float) -> str:
    """A record's time, ISO 8601 with milliseconds and this machine's zone: 2026-11-26T15:31:02.123+00:00."""
    return datetime.fromtimestamp(created).astimezone().isoformat(timespec="milliseconds")


class TextFormatter(logging.Formatter):
    """`2026-11-26T15:31:02.123+00:00 INFO streamdiloco.shard: message` (a traceback follows on its lines)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return iso_time(record.created)


def escaped(text: str) -> str:
    """`text` with every character that is not printable (newlines, carriage returns, escape sequences,
    NUL, Unicode's line separators) written as Python writes it in a repr (\\n, \\x1b, \\u2028): what a
    client sent can then neither forge a log line nor reach the terminal as a control sequence."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _plain(value: Any) -> Any:
    """A value JSON can carry as it is (NaN and infinities, which JSON has not, become strings)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: time, level, logger, message, the `extra=` fields, and
    `exception` (traceback text) when the record has one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": iso_time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out and not key.startswith("_"):
                out[key] = _plain(value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False)


class _Handler(logging.StreamHandler):
    """The process's handler: writes to sys.stderr or sys.stdout as they are at each record (a stream
    swapped later, as tests do, is followed), and stays quiet when its stream has gone away
    (`launch | head`)."""

    def __init__(self, stream: str | TextIO) -> None:
        self.follow = stream if isinstance(stream, str) else None
        super().__init__(getattr(sys, stream) if isinstance(stream, str) else stream)

    def emit(self, record: logging.LogRecord) -> None:
        if self.follow is not None:
            self.stream = getattr(sys, self.follow)
        super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handleError(record)


_state: dict[str, Any] = {"format": "text", "hooks": None}


def setup_logging(level: str = "info", fmt: str = "text", stream: str | TextIO = "stderr") -> None:
    """Send every log record of this process to `stream` ("stderr", "stdout", or a file object) in format
    `fmt` (text or json), at `level` and above (debug, info, warning, error). The handler goes on the root
    logger, in place of the one an earlier call put there (others are left alone). Other libraries' debug
    lines stay out at --log-level debug (only streamdiloco's come down to debug); uvicorn's HTTP lines stay
    at warning and above. ValueError (one line) for an unknown level or format."""
    if level not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = _Handler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    number = getattr(logging, level.upper())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(number, logging.INFO))
    logging.getLogger("streamdiloco").setLevel(number)
    logging.getLogger("uvicorn").setLevel(max(number, logging.WARNING))
    # warnings.warn: a record too, in the same format. Off first: captureWarnings(True) does nothing while
    # logging thinks it still captures, though warnings.showwarning may have been put back since (by a
    # warnings.catch_warnings block around an earlier setup_logging call)
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    _state["format"] = fmt
    if fmt == "json" and _state["hooks"] is None:  # a crash's traceback: one record, not many lines
        _state["hooks"] = (sys.excepthook, threading.excepthook)
        sys.excepthook, threading.excepthook = _log_uncaught, _log_thread_uncaught
    elif fmt == "text" and _state["hooks"] is not None:
        sys.excepthook, threading.excepthook = _state["hooks"]
        _state["hooks"] = None


def json_logs() -> bool:
    """Whether setup_logging chose JSON: a line for the user (an error) must then be a record too."""
    return _state["format"] == "json"


def error_line(message: str) -> None:
    """A one-line error for the user: `streamdiloco: error: MESSAGE` on stderr, or with --log-format json an
    ERROR record (a log collector parses every line)."""
    if json_logs():
        logging.getLogger("streamdiloco").error(message)
    else:
        print(f"streamdiloco: error: {message}", file=sys.stderr)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose own errors (a mistyped flag) are an ERROR record with --log-format json
    (its subcommands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        if not json_logs():
            super().error(message)
        error_line(f"{self.prog}: {message}")
        sys.exit(2)


def _log_uncaught(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    logging.getLogger("streamdiloco").critical(
        "uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, tb)
    )


def _log_thread_uncaught(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "a thread"
    logging.getLogger("streamdiloco").critical(
        "uncaught %s in %s: %s",
        args.exc_type.__name__,
        name,
        args.exc_value,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),  # type: ignore[arg-type]
    )


def add_log_flags(parser: argparse.ArgumentParser) -> None:
    """--log-level and --log-format: this process's own (not run settings: each site logs as it likes)."""
    g = parser.add_argument_group("logs")
    # the choices are checked by setup_logging (a one-line error), not by argparse (its usage and the error)
    g.add_argument(
        "--log-level",
        default="info",
        metavar="{" + ",".join(LEVELS) + "}",
        help="the least severe lines written (default %(default)s)",
    )
    g.add_argument(
        "--log-format",
        default="text",
        metavar="{" + ",".join(FORMATS) + "}",
        help="text (dated lines for people) or json (one object per line: time, level, logger, message "
        "and the record's fields; for log collectors) (default %(default)s)",
    )


def asked_format(argv: list[str]) -> str | None:
    """The --log-format an unparsed command line gives, if any: argparse's own errors (a mistyped flag)
    follow it too, so that with json even those are records."""
    for i, arg in enumerate(argv):
        if arg == "--log-format" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--log-format="):
            return arg.split("=", 1)[1]
    return None


def log_flags(level: str, fmt: str) -> list[str]:
    """The flags that give a child process the same logging (launch hands them to its shards and workers)."""
    return ["--log-level", level, "--log-format", fmt]
