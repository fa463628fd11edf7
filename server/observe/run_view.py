"""The run's view from one shard: every shard of the run on one page. A shard knows its peers from
`--peers` (every shard's HTTP base URL; `launch` passes them) and fetches their /api/status itself, so the
page needs one origin (no CORS) and one read token. Each peer gets a bounded time and a bounded answer; one
that does not answer in time, or answers nonsense, is shown as down and never holds the page. Answers are
cached for a second and fetched once for every page polling at the time. Shards still never talk to each
other for training: this is read-only and for people.

The read token goes to the listed peers and nowhere else: a redirect is not followed (it is the peer's
error, `HTTP 302`), and with a read token a peer is reached over https, or over http on loopback only
(`check_peers`), unless the shard is told --insecure."""

from __future__ import annotations

import asyncio
import json
import math
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_PEERS = 64  # shards listed in --peers
PEER_TIMEOUT = 2.0  # seconds a peer has to answer, connection included
CACHE_SECONDS = 1.0  # pages polling within this long of the last fetch get its answer
MAX_ANSWER_BYTES = 4 << 20  # a peer's /api/status beyond this is not read (it is about 10 kB)


def parse_peers(text: str, flag: str = "--peers") -> tuple[str, ...]:
    """Every shard's HTTP base URL from `http://HOST:PORT,https://HOST:PORT,...`; one-line errors."""
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if len(urls) > MAX_PEERS:
        raise ValueError(f"{flag}: at most {MAX_PEERS} shards, got {len(urls)}")
    for url in urls:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise ValueError(f"{flag}: {url!r} is not a URL ({e})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
            raise ValueError(f"{flag}: give each shard's HTTP address as http(s)://HOST:PORT, got {url!r}")
        if parts.path or parts.query or parts.fragment or parts.username:
            raise ValueError(f"{flag}: {url!r}: only scheme, host and port (the page adds the paths)")
    if len(set(urls)) != len(urls):
        raise ValueError(f"{flag}: a shard is listed twice")
    return tuple(urls)


def check_peers(
    urls: tuple[str, ...], read_token: str, insecure: bool = False, flag: str = "--peers"
) -> None:
    """With a read token, every peer over https (or http on loopback, where the token stays on this
    machine): a one-line ValueError for the first that is not, unless `insecure`."""
    from streamdiloco.common.tls import is_loopback

    if not read_token or insecure:
        return
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme == "http" and not is_loopback(parts.hostname or ""):
            raise ValueError(
                f"{flag}: {url} is plain http, and the shard would send it the read token in clear: give "
                "the peers as https://HOST:PORT (with --peers-ca), or say --insecure"
            )


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed: urllib would send the Authorization header on to wherever a peer points
    (another host included). A 3xx is the peer's error."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        return None


@dataclass(frozen=True)
class Peers:
    """Where the run's shards answer HTTP, and how to read them."""

    urls: tuple[str, ...]  # every shard's base URL (this shard's own may be among them)
    read_token: str = ""  # the peers' read token (a run has one: this shard's own)
    ca: str | None = None  # PEM of the CA that signs the peers' certificates, for https


def _number(x, lo: float = 0.0) -> float | None:
    """A number a peer sent, if it is one: finite and at least `lo` (bools are not numbers here)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) and x >= lo else None


def _of(status: dict, key: str, kind: type):
    """status[key] if it is a `kind` (a dict or a list), else an empty one."""
    value = status.get(key)
    return value if isinstance(value, kind) else kind()


def shard_summary(status: dict) -> dict:
    """What the run view shows of a shard, from its /api/status; ValueError if it is not one."""
    if not isinstance(status, dict):
        raise ValueError("not a shard's status")
    shard, num_shards = status.get("shard"), status.get("num_shards")
    if not (isinstance(shard, int) and isinstance(num_shards, int) and 0 <= shard < num_shards <= 1 << 16):
        raise ValueError("not a shard's status (no shard index)")
    b: dict = _of(status, "bytes", dict)
    rs: dict = _of(status, "round_seconds", dict)
    members: list = _of(status, "members", list)
    refused: dict = _of(status, "pushes_refused", dict)
    fragments: list = _of(status, "fragments", list)
    rounds = [f.get("round") for f in fragments[:4096] if isinstance(f, dict)]
    return {
        "shard": shard,
        "num_shards": num_shards,
        "ready": status.get("ready") is True,
        "uptime_seconds": _number(status.get("uptime_seconds")),
        "members": sum(1 for m in members if isinstance(m, dict) and m.get("state") == "member"),
        "rounds_closed": _number(status.get("rounds_closed")),
        "rounds": [r if isinstance(r, int) and not isinstance(r, bool) else None for r in rounds],
        "pushes_accepted": _number(status.get("pushes_accepted")),
        "pushes_refused": sum(v for v in (_number(x) for x in refused.values()) if v is not None),
        "bytes_in": _number(b.get("message_bytes_in")),
        "bytes_out": sum(_number(b.get(k)) or 0.0 for k in ("message_bytes_out", "fetch_out")),
        "round_seconds_median": _number(rs.get("median")),
        "round_seconds_max": _number(rs.get("max")),
        "training_loss": _number(status.get("training_loss")),
    }


def run_totals(shards: list[dict]) -> dict:
    """The run's totals over the shards that answered."""
    up = [s for s in shards if s["up"]]

    def total(key: str) -> float:
        return sum(s[key] or 0.0 for s in up)

    medians = [s["round_seconds_median"] for s in up if s["round_seconds_median"] is not None]
    return {
        "shards": len(shards),
        "shards_up": len(up),
        "num_shards": max((s["num_shards"] for s in up), default=None),
        "rounds_closed": total("rounds_closed"),
        "pushes_accepted": total("pushes_accepted"),
        "pushes_refused": total("pushes_refused"),
        "bytes_in": total("bytes_in"),
        "bytes_out": total("bytes_out"),
        "round_seconds_median": max(medians, default=None),  # the slowest shard's: a round waits for all
    }


class RunView:
    """/api/run: this shard's summary (from `own`, no network) and its peers' (over HTTP), with totals."""

    def __init__(self, peers: Peers, own: Callable[[], dict | None]) -> None:
        self.peers = peers
        self.own = own  # this shard's /api/status (None while it loads)
        self.context = ssl.create_default_context(cafile=peers.ca) if peers.ca else None
        self._open = urllib.request.build_opener(
            _NoRedirects(), urllib.request.HTTPSHandler(context=self.context)
        ).open
        self._answer: dict | None = None
        self._at = -math.inf
        self._lock = asyncio.Lock()
        # its own threads, at most one fetch per peer at a time: a peer that hangs holds one thread, and
        # neither the event loop's default executor nor more threads
        self._pool = ThreadPoolExecutor(max(1, len(peers.urls)), thread_name_prefix="peers")
        self._fetching: dict[str, Future] = {}

    def fetch(self, url: str) -> dict:
        """One peer's summary (in a thread): up, or down with the reason in a few words."""
        headers = {"Authorization": f"Bearer {self.peers.read_token}"} if self.peers.read_token else {}
        # no rounds, hashes or contribution credits: the summary needs none of them
        request = urllib.request.Request(f"{url}/api/status?rounds=0&hashes=0&credits=0", headers=headers)
        deadline = time.monotonic() + PEER_TIMEOUT
        try:
            with self._open(request, timeout=PEER_TIMEOUT) as r:
                parts: list[bytes] = []
                size = 0
                while part := r.read(1 << 16):  # the timeout is per read: the deadline is for the whole
                    parts.append(part)
                    size += len(part)
                    if size > MAX_ANSWER_BYTES:
                        raise ValueError(f"answer over {MAX_ANSWER_BYTES >> 20} MiB")
                    if time.monotonic() > deadline:
                        raise TimeoutError("answer too slow")
            body = b"".join(parts)
            return {"url": url, "up": True, "error": None, **shard_summary(json.loads(body))}
        except (
            urllib.error.HTTPError
        ) as e:  # 401 (no read token), 503 (loading, stopping), 3xx (not followed)
            return {"url": url, "up": False, "error": f"HTTP {e.code}"}
        except (OSError, ValueError) as e:  # refused, timed out, TLS, not JSON, not a shard
            reason = getattr(e, "reason", None) or e
            return {"url": url, "up": False, "error": str(reason)[:200] or type(e).__name__}

    async def get(self) -> dict:
        async with self._lock:  # pages polling at once share one round of fetches
            if self._answer is not None and time.monotonic() - self._at < CACHE_SECONDS:
                return self._answer
            for url in self.peers.urls:  # a fetch still running from an earlier round goes on
                if url not in self._fetching or self._fetching[url].done():
                    self._fetching[url] = self._pool.submit(self.fetch, url)
            jobs = [asyncio.wrap_future(self._fetching[url]) for url in self.peers.urls]
            if jobs:
                await asyncio.wait(jobs, timeout=PEER_TIMEOUT + 1.0)
            shards = [
                job.result() if job.done() else {"url": url, "up": False, "error": "no answer in time"}
                for url, job in zip(self.peers.urls, jobs, strict=True)
            ]
            own = self.own()
            if own is not None:
                mine = shard_summary(own)
                listed = [s for s in shards if s["up"] and s["shard"] == mine["shard"]]
                if not listed:  # --peers without this shard's own address (or none at all)
                    shards.append({"url": None, "up": True, "error": None, **mine})
            shards.sort(key=lambda s: (s.get("shard", MAX_PEERS << 16), s["url"] or ""))
            self._answer = {"now": time.time(), "shards": shards, "totals": run_totals(shards)}
            self._at = time.monotonic()
            return self._answer
