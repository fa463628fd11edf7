"""`streamdiloco credits` (alias `ledger`, its old name): merge the shards' contribution credits
(server/storage/credits.py) into CSV or JSON, so that a collective can credit its volunteers. Each shard
keeps its own credits of the pushes of its slice;
the command reads every shard's, from the live shards' /api/status (`--status-url`, with the run's read token)
or from their checkpoint directories (`--checkpoint-dir`: credits.json, checked against meta.json's hash),
and needs all of the run's S shards.

How the shards' rows merge. A worker's push of a fragment goes to every shard, one slice each, and each
shard takes or refuses its slice on its own (a round of shard 0 may close before the slice reaches it, while
shard 1 takes it). So a merged count is the mean over the S shards: `tokens`, `pushes`, `clipped`,
`capped`, `late`, `refused` and `rounds` count a push (a round) that every shard took as 1, one that one of
two shards took as 0.5; `tokens` is then the tokens of the worker's training that reached the model,
weighted by the share of the model's values (the slices, about equal) they reached. `tokens_by_shard` (CSV:
tokens_shard_<s>) keeps each shard's own number. A session is open on every shard at once: `sessions` and
`connected_seconds` are the largest over the shards. Rows a shard folded into its `others` (beyond its
bound) merge into one `others` row.

What it must not do: write to a shard (it only reads), or import torch (its checks answer at once).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import math
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from streamdiloco.server.storage.credits import (
    COUNTS,
    MAX_IDENTITIES,
    REASONS,
    Credits,
    Row,
    checked_row,
    shown,
)

MAX_STATUS_BYTES = 64 << 20  # a shard's /api/status with every credits row: a few hundred bytes a worker
TIMEOUT = 10.0  # seconds a shard has to answer
MEAN = ("tokens", "pushes", "clipped", "capped", "late", "rounds")  # merged as the mean over the shards
LARGEST = ("sessions", "connected_seconds")  # merged as the largest


def add_credits_parser(sub: argparse._SubParsersAction) -> None:
    """The `credits` subcommand (and its old name `ledger`), under `streamdiloco`'s subparsers."""
    lp = sub.add_parser(
        "credits",
        aliases=["ledger"],
        help="merge the shards' contribution credits into CSV or JSON",
        description="Read every shard's contribution credits (per worker: tokens that reached the model, "
        "pushes accepted, clipped, capped, late and refused by reason, rounds contributed, time connected) "
        "from the live shards or their checkpoint directories, and merge them: counts are the mean over "
        "the run's shards (a push every shard took counts 1), time connected the largest; tokens per shard "
        "are kept beside. Every shard of the run must be given.",
    )
    lp.add_argument(
        "--status-url",
        action="append",
        default=[],
        metavar="URL",
        help="a live shard's HTTP address, http(s)://HOST:PORT (repeat for every shard)",
    )
    lp.add_argument(
        "--checkpoint-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a shard's --checkpoint-dir, read while the shard is stopped or running (repeatable)",
    )
    lp.add_argument("--read-token", default="", help="the shards' read token (for --status-url)")
    lp.add_argument("--read-token-file", default=None, metavar="PATH", help="--read-token, from a file")
    lp.add_argument("--ca", default=None, metavar="PEM", help="the CA of the shards' https certificates")
    lp.add_argument(
        "--insecure",
        action="store_true",
        help="send the read token over plain http beyond loopback (it is sent in clear)",
    )
    lp.add_argument("--format", choices=("csv", "json"), default="csv", help="output format (default csv)")
    lp.add_argument("--out", default=None, metavar="PATH", help="write here (default: standard output)")
    lp.set_defaults(func=_cmd_credits)


@dataclass
class ShardCredits:
    """One shard's credits, checked: its rows by name and its others row."""

    shard: int
    num_shards: int
    source: str
    rows: dict[str, Row]
    others: Row = field(default_factory=Row)
    folded: int = 0  # identities its others row holds


def from_checkpoint(directory: str) -> ShardCredits:
    """A shard's credits from its checkpoint directory: credits.json, as meta.json lists its hash."""
    where = f"--checkpoint-dir {directory}"
    try:
        meta = json.loads((Path(directory) / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot read meta.json ({e}): is it a shard's checkpoint?") from None
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or "credits.json" not in files:
        raise ValueError(
            f"{where}: its meta.json lists no credits.json (no contribution credits were saved there yet: a "
            "shard writes it every few seconds while it changes, and when it stops)"
        )
    try:
        data = (Path(directory) / "credits.json").read_bytes()
    except OSError as e:
        raise ValueError(f"{where}: cannot read credits.json ({e.strerror or e})") from None
    if hashlib.sha256(data).hexdigest() != files["credits.json"]:
        raise ValueError(f"{where}: credits.json does not hash to what meta.json lists (damaged, or being "
                         "written: try again)")  # fmt: skip
    try:
        credits = Credits.from_state(json.loads(data), max_rows=1 << 53)
    except ValueError as e:
        raise ValueError(f"{where}: credits.json: {e}") from None
    shard, num_shards = _place(meta, where)
    return ShardCredits(shard, num_shards, directory, credits.rows, credits.others, credits.folded)


def _place(d: dict, where: str) -> tuple[int, int]:
    shard, num_shards = d.get("shard"), d.get("num_shards")
    ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (shard, num_shards))
    if not ok or not 0 <= shard < num_shards <= 1 << 16:  # type: ignore[operator]
        raise ValueError(f"{where}: names no shard index (shard {shard!r:.20} of {num_shards!r:.20})")
    return shard, num_shards  # type: ignore[return-value]


def from_status(status: object, source: str, where: str) -> ShardCredits:
    """A shard's credits from its /api/status (with every row: ?credits=MAX_IDENTITIES)."""
    if not isinstance(status, dict) or not isinstance(credits := status.get("credits"), dict):
        raise ValueError(f"{where}: its status has no contribution credits (a shard of an older version?)")
    shard, num_shards = _place(status, where)
    workers, others = credits.get("workers"), credits.get("others")
    if not isinstance(workers, list) or not isinstance(others, dict):
        raise ValueError(f"{where}: its contribution credits are malformed")
    rows: dict[str, Row] = {}
    try:
        for d in workers:
            name, row = checked_row(d, live=True)
            assert name is not None
            if name in rows:
                raise ValueError(f"{shown(name)} is listed twice")
            rows[name] = row
        folded = others.get("identities")
        _, rest = checked_row({k: v for k, v in others.items() if k != "identities"}, named=False)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if not isinstance(folded, int) or isinstance(folded, bool) or folded < 0:
        raise ValueError(f"{where}: its credits' others row has no count of identities")
    return ShardCredits(shard, num_shards, source, rows, rest, folded)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """The read token goes to the URL given and nowhere else: a redirect is the shard's error."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        return None


def fetch(url: str, read_token: str, ca: str | None) -> ShardCredits:
    """A live shard's credits over HTTP(S); ValueError (one line) when it cannot be read."""
    import ssl

    where = f"--status-url {url}"
    context = ssl.create_default_context(cafile=ca) if ca else None
    opener = urllib.request.build_opener(_NoRedirects(), urllib.request.HTTPSHandler(context=context))
    headers = {"Authorization": f"Bearer {read_token}"} if read_token else {}
    request = urllib.request.Request(
        f"{url}/api/status?rounds=0&hashes=0&credits={MAX_IDENTITIES}", headers=headers
    )
    try:
        with opener.open(request, timeout=TIMEOUT) as r:
            body = r.read(MAX_STATUS_BYTES + 1)
    except urllib.error.HTTPError as e:
        hint = " (give the run's --read-token)" if e.code == 401 else ""
        raise ValueError(f"{where}: HTTP {e.code}{hint}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot read its status ({getattr(e, 'reason', None) or e})") from None
    if len(body) > MAX_STATUS_BYTES:
        raise ValueError(f"{where}: its status is over {MAX_STATUS_BYTES >> 20} MiB")
    try:
        status = json.loads(body)
    except ValueError:
        raise ValueError(f"{where}: its status is not JSON") from None
    return from_status(status, url, where)


def merge(shards_credits: list[ShardCredits]) -> dict:
    """The run's credits from every shard's (see the module's docstring); ValueError (one line) unless they
    are exactly the S shards of one run."""
    if not shards_credits:
        raise ValueError("give every shard's --status-url or --checkpoint-dir")
    n = shards_credits[0].num_shards
    if any(x.num_shards != n for x in shards_credits):
        raise ValueError("the credits are of runs with different numbers of shards: " + ", ".join(
            f"{x.source} is shard {x.shard} of {x.num_shards}" for x in shards_credits))  # fmt: skip
    by_shard: dict[int, ShardCredits] = {}
    for x in shards_credits:
        if x.shard in by_shard:
            raise ValueError(f"{by_shard[x.shard].source} and {x.source} are both shard {x.shard}")
        by_shard[x.shard] = x
    if missing := sorted(set(range(n)) - set(by_shard)):
        raise ValueError(f"the run has {n} shards; shard(s) {missing} missing: give every shard's credits")
    shards = [by_shard[s] for s in range(n)]
    names = sorted({name for x in shards for name in x.rows})
    workers = [_merged([x.rows.get(name) for x in shards], n) | {"worker": name} for name in names]
    workers.sort(key=lambda w: (-w["tokens"], w["worker"]))
    others = _merged([x.others for x in shards], n) | {"identities": max(x.folded for x in shards)}
    del others["via"]
    return {
        "num_shards": n,
        "sources": [{"shard": x.shard, "source": x.source} for x in shards],
        "merge": "mean over the shards (tokens, pushes, clipped, capped, late, refused, rounds); largest "
        "over the shards (sessions, connected_seconds)",
        "workers": [{"worker": w.pop("worker"), **w} for w in workers],
        "others": others,
    }


def _number(x: float) -> float | int:
    """A merged value as it is written: 3 decimals, and whole numbers as integers."""
    r = round(x, 3)
    return int(r) if math.isfinite(r) and r == int(r) else r


def _merged(rows: list[Row | None], n: int) -> dict:
    """One worker's row over the n shards (None: the shard has no row of it)."""
    have = [r for r in rows if r is not None]
    vias = sorted({r.via for r in have if r.via})
    out: dict = {"via": "; ".join(vias)}
    out.update({key: _number(sum(getattr(r, key) for r in have) / n) for key in MEAN})
    out["tokens_by_shard"] = [_number(r.tokens) if r is not None else 0 for r in rows]
    reasons = sorted({reason for r in have for reason in r.refused})
    out["refused"] = {k: _number(sum(r.refused.get(k, 0) for r in have) / n) for k in reasons}
    out.update({key: _number(max((getattr(r, key) for r in have), default=0)) for key in LARGEST})
    return out


def to_csv(merged: dict) -> str:
    """The merged credits as CSV: one line per worker (row "worker"), the others last (row "others")."""
    n = merged["num_shards"]
    rows = [*merged["workers"], {**merged["others"], "worker": ""}]
    reasons = [r for r in REASONS if any(r in w["refused"] for w in rows)]
    header = ["row", "worker", "via", "tokens", *(f"tokens_shard_{s}" for s in range(n))]
    header += [c for c in COUNTS if c not in LARGEST and c != "rounds"]
    header += ["refused", *(f"refused_{r}" for r in reasons), "rounds", *LARGEST]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    for i, w in enumerate(rows):
        kind = "others" if i == len(rows) - 1 else "worker"
        line = [kind, w["worker"], w.get("via", ""), w["tokens"], *w["tokens_by_shard"]]
        line += [w[c] for c in ("pushes", "clipped", "capped", "late")]
        line += [_number(sum(w["refused"].values())), *(w["refused"].get(r, 0) for r in reasons)]
        line += [w["rounds"], *(w[c] for c in LARGEST)]
        writer.writerow(line)
    return out.getvalue()


def _cmd_credits(args: argparse.Namespace) -> int:
    from streamdiloco.server.observe.run_view import check_peers, parse_peers

    if not args.status_url and not args.checkpoint_dir:
        raise ValueError("credits: give every shard's --status-url or --checkpoint-dir")
    if args.read_token and args.read_token_file:
        raise ValueError("give --read-token or --read-token-file, not both")
    token = args.read_token
    if args.read_token_file:
        from streamdiloco.common.tls import read_secret

        token = read_secret(args.read_token_file, "--read-token-file")
    urls = parse_peers(",".join(args.status_url), "--status-url") if args.status_url else ()
    check_peers(urls, token, args.insecure, "--status-url")
    shards_credits = [from_checkpoint(d) for d in args.checkpoint_dir]
    shards_credits += [fetch(url, token, args.ca) for url in urls]
    merged = merge(shards_credits)
    text = to_csv(merged) if args.format == "csv" else json.dumps(merged, indent=1) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        from streamdiloco.common.atomic import atomic_write_text

        atomic_write_text(Path(args.out), text)
    return 0
