"""A shard's checkpoint: one directory, one file per fragment, each replaced atomically, and a log of the
rounds closed since.

    meta.json                         the run it belongs to: shard, number of shards, sync config, model
                                      fingerprint
    fragment-<p>.pt                   fragment p's slice: the open round, the master, the outer momentum, the
                                      downlink's error-feedback residual and the rounding generator
    rounds/fragment-<p>-round-<r>.pt  round r of fragment p's inputs: its pushes, still encoded, and what
                                      else its close used (server.shard.CloseJob.record)

When a round closes, and before its update goes to any worker, the round's log is made durable (write,
fsync, rename, fsync the directory): 1/20 of the state's size with one worker's E3M0 push (a 25M-value
slice: 13 MB against 300 MB; writing the state was the longest part of a round). Every FULL_EVERY-th round
of a fragment, once its update has gone out, the fragment's whole state is written too (the fragment's next
round waits for it), and the logs before it are dropped. A shard restarted from its
checkpoint loads each fragment's state and replays the logged rounds after it, the same pushes folded in
the same order into the same step: it has every round a worker may have applied, bit for bit. A whole
state drops the logs before it. Pushes of the round still open are not saved: workers keep each push until
its round's update arrives and send it again to the restarted shard. Files of different fragments need not
agree on anything, which is why every round writes only its own fragment.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import fingerprint_diff
from streamdiloco.server.shard import ShardState

log = logging.getLogger("streamdiloco.shard")

FORMAT = 1
FULL_EVERY = 8  # a fragment's whole state every this many of its rounds; the rounds between are logged


def atomic_write(path: Path, write) -> None:
    """Write a file so that a crash leaves either the old or the new one: `write(f)` fills a temporary
    file beside it, which is flushed, fsynced and renamed over `path`; then the directory is fsynced."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_line(e: Exception) -> str:
    """An exception's type and the first line of its message, without terminal colours."""
    first = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()[:1] or [""]
    return f"{type(e).__name__}: {first[0]}"


class ShardCheckpoint:
    def __init__(self, directory: str | Path, fingerprint: dict):
        self.dir = Path(directory)
        self.fingerprint = fingerprint
        self.writes = 0
        self.pending_initial = False  # a new run: write every file before the first worker comes
        self.errors = 0
        self.last_error: str | None = None

    def _meta(self, state: ShardState) -> dict:
        return {
            "format": FORMAT,
            "shard": state.shard,
            "num_shards": state.num_shards,
            "config": state.cfg.to_dict(),
            "fingerprint": self.fingerprint,
        }

    def exists(self) -> bool:
        return (self.dir / "meta.json").exists()

    def check_meta(self, shard: int, num_shards: int, cfg: SyncConfig) -> dict:
        """meta.json, when it belongs to this shard of a run with these sync settings; else ValueError (one
        line). Cheap: the shard checks it before it builds the model, so a wrong flag fails at once."""
        where = f"checkpoint {self.dir}"
        try:
            meta = json.loads((self.dir / "meta.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: cannot read meta.json ({e}); use --fresh to start over") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            got = meta.get("format") if isinstance(meta, dict) else None
            raise ValueError(f"{where} has format {got!r}, this shard reads {FORMAT}")
        if (meta.get("shard"), meta.get("num_shards")) != (shard, num_shards):
            raise ValueError(
                f"{where} belongs to shard {meta.get('shard')} of {meta.get('num_shards')}, "
                f"not shard {shard} of {num_shards}: give each shard its own --checkpoint-dir"
            )
        config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
        ours = cfg.to_dict()
        if config != ours:
            changed = sorted(k for k in set(config) | set(ours) if config.get(k) != ours.get(k))
            raise ValueError(
                f"{where} was written by a run with other sync settings ({', '.join(changed)}): start with "
                "the same flags, or use --fresh (or another --checkpoint-dir) to start a new run"
            )
        return meta

    def load(self, state: ShardState) -> None:
        """Restore every fragment of `state` from the directory; ValueError (one line) when the checkpoint
        belongs to another run or is incomplete."""
        where = f"checkpoint {self.dir}"
        meta = self.check_meta(state.shard, state.num_shards, state.cfg)
        diff = fingerprint_diff(
            meta.get("fingerprint") or {}, self.fingerprint, us="checkpoint", them="model"
        )
        if diff:
            raise ValueError(f"{where} was written for another model: {diff}; use --fresh to start over")
        for f in range(state.layout.num_fragments):
            path = self.dir / f"fragment-{f}.pt"
            try:
                saved = torch.load(path, map_location="cpu", weights_only=True)
            except FileNotFoundError:
                raise ValueError(f"{where} is incomplete: {path.name} is missing; use --fresh") from None
            except Exception as e:  # torch raises many kinds, some with pages of advice, for damaged files
                raise ValueError(f"{where}: {path.name} is damaged ({_first_line(e)})") from None
            state.load_fragment_state(f, saved)
            r = state.round_of(f)
            while (path := self._log_path(f, r)).exists():  # the rounds closed since: replayed
                try:
                    record = torch.load(path, map_location="cpu", weights_only=True)
                    state.replay_round(f, record)
                except Exception as e:  # a log torch cannot read, or whose pushes do not check
                    raise ValueError(f"{where}: rounds/{path.name} is damaged ({_first_line(e)})") from None
                r += 1

    def _log_path(self, fragment: int, round: int) -> Path:
        return self.dir / "rounds" / f"fragment-{fragment}-round-{round}.pt"

    def full_due(self, round: int) -> bool:
        """Whether the fragment's whole state is written after this round (besides the round's log)."""
        return (round + 1) % FULL_EVERY == 0

    def log_round(self, fragment: int, record: dict) -> bool:
        """Write a closing round's log (CloseJob.record); False (and an error in the log) if it could not."""
        try:
            (self.dir / "rounds").mkdir(parents=True, exist_ok=True)
            atomic_write(
                self._log_path(fragment, record["round"]),
                lambda f: torch.save(record, f, _use_new_zipfile_serialization=False),
            )
            self.writes += 1
            return True
        except OSError as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.error("log of fragment %d round %d to %s failed: %s", fragment, record["round"], self.dir, e)
            return False

    def _drop_logs(self, fragment: int, below: int) -> None:
        """Remove the fragment's round logs older than its whole state of round `below`."""
        folder = self.dir / "rounds"
        if not folder.is_dir():
            return
        for path in folder.glob(f"fragment-{fragment}-round-*.pt"):
            try:
                r = int(path.stem.rsplit("-", 1)[1])
            except ValueError:
                continue
            if r < below:
                path.unlink(missing_ok=True)

    def save_fragment(self, state: ShardState, fragment: int) -> bool:
        """Write one fragment's file; False (and an error in the log) if it could not be written."""
        return self.save(fragment, state.fragment_state(fragment))

    def save(self, fragment: int, saved: dict) -> bool:
        """Write a fragment's state (ShardState.fragment_state, or a close job's, on the job's thread)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            # torch's legacy (non-zip) format: a 300 MB fragment state is written in 0.23 s against 0.4-1 s
            # for the zip format (which checksums it and writes it in small pieces), and this write is on
            # every round's critical path (the update goes out once it is durable); torch.load reads both
            atomic_write(
                self.dir / f"fragment-{fragment}.pt",
                lambda f: torch.save(saved, f, _use_new_zipfile_serialization=False),
            )
            self.writes += 1
            self._drop_logs(fragment, below=int(saved["round"]))
            return True
        except OSError as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.error("checkpoint of fragment %d to %s failed: %s", fragment, self.dir, self.last_error)
            return False

    def save_all(self, state: ShardState) -> bool:
        ok = all([self.save_fragment(state, f) for f in range(state.layout.num_fragments)])
        try:
            meta = json.dumps(self._meta(state), indent=1).encode()
            atomic_write(self.dir / "meta.json", lambda f: f.write(meta))
        except OSError as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.error("checkpoint meta.json to %s failed: %s", self.dir, self.last_error)
            return False
        return ok
