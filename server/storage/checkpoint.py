"""A shard's checkpoint: one directory, one file per fragment, each replaced atomically, a log of the rounds
closed since, and meta.json, which names the run and holds the sha256 of every file that is part of the
checkpoint.

    meta.json                         the run it belongs to (shard, number of shards, sync config, model
                                      fingerprint) and `files`: the sha256 of each file below
    fragment-<p>.pt                   fragment p's slice: the open round, the master, the outer momentum, the
                                      downlink's error-feedback residual and the rounding generator
    rounds/fragment-<p>-round-<r>.pt  round r of fragment p's inputs: its pushes, still encoded, and what
                                      else its close used (server.shard.CloseJob.record)
    ledger.json                       shard 0: the run's data ledger (server/storage/ledger.py's to_state),
    written
                                      before each Pieces reply goes out, so a restart loses no assignment
    credits.json                      the contribution credits (server/storage/credits.py's to_state): written
    before
                                      every whole state of a fragment (which drops round logs: the ledger
                                      has credited them), every CREDITS_SECONDS while it changes, and when
                                      the shard stops; the rounds a restart replays from their logs are
                                      credited again unless the ledger had them (`replayed`)

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

Checked at load. meta.json is the commit point: a file counts only once meta.json lists its hash, and a
file whose bytes do not hash to what meta.json lists, or that holds a value that is not finite, is refused
(one line naming the file). So that a crash between two writes leaves a checkpoint that loads exactly when
it is consistent:
- a round's log is written, then listed; the update goes out only after that. A log on disk that meta.json
  does not list was never acknowledged: it is ignored (workers send its pushes again);
- a fragment's state replaces the file of the same name, so meta.json first lists the new file's hash as
  `incoming` (either hash is taken), then the file is renamed into place, then meta.json lists it alone and
  drops the logs before it; the dropped files are deleted last;
- a new run writes every fragment before its first meta.json (an old run's meta.json goes first: a crash
  midway leaves no checkpoint, not a mix of two runs).
A checkpoint of format 1 (written before hashes) loads with a warning, its files unchecked but checked
finite, and is written again with hashes before the shard takes any worker (`pending_initial`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch

from streamdiloco.common.atomic import atomic_write, atomic_write_text
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import fingerprint_diff
from streamdiloco.server.rounds.state import ShardState

log = logging.getLogger("streamdiloco.shard")

FORMAT = 2
LEGACY_FORMAT = 1  # no hashes: loaded unchecked, with a warning, then written again as FORMAT
LEDGER = "ledger.json"  # shard 0's data ledger
CREDITS = "credits.json"  # the contribution credits
FULL_EVERY = 8  # a fragment's whole state every this many of its rounds; the rounds between are logged
_LOG_NAME = re.compile(r"rounds/fragment-(\d+)-round-(\d+)\.pt")
_HASH_ASIDE = 1 << 20  # buffers at least this large are hashed on _HASHER while they are written
_HASHER = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash")


class _Hashing:
    """A writable file that hashes what goes through it (torch.save and json see a plain file object). A
    large buffer (a tensor's storage: torch writes each in one call) is hashed on another thread while it
    is written: both release the GIL, so the hash costs next to nothing on the write's time."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data: bytes | memoryview) -> int:
        if memoryview(data).nbytes < _HASH_ASIDE:
            self.sha.update(data)
            return self.f.write(data)
        hashed = _HASHER.submit(self.sha.update, data)  # in order: the previous update has returned
        try:
            return self.f.write(data)
        finally:
            hashed.result()

    def flush(self) -> None:
        self.f.flush()


def _write_hashed(
    path: Path, write: Callable[[Any], object], before_rename: Callable[[str], object] | None = None
) -> str:
    """common.atomic's atomic_write (temporary file, fsync, rename, fsync of the directory), hashing what
    is written: returns its sha256 (hex); `before_rename(sha)`, if given, runs once the new bytes are
    durable and before they replace the old file."""
    hashing: list[_Hashing] = []

    def fill(f: BinaryIO) -> None:
        hashing.append(_Hashing(f))
        write(hashing[0])

    def announce() -> None:
        if before_rename is not None:
            before_rename(hashing[0].sha.hexdigest())

    atomic_write(path, fill, before_rename=announce)
    return hashing[0].sha.hexdigest()


def _first_line(e: Exception) -> str:
    """An exception's type and the first line of its message, without terminal colours."""
    first = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()[:1] or [""]
    return f"{type(e).__name__}: {first[0]}"


def _nonfinite(obj: object, path: str = "") -> str | None:
    """Where `obj` (a loaded checkpoint file: dicts, lists, tensors, numbers) holds a value that is not
    finite, in words ("outer.master: 3 of 12352 values are not finite"); None when all are finite."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel() and not all(torch.isfinite(x) for x in torch.aminmax(obj)):
            bad = int((~torch.isfinite(obj)).sum())
            return f"{path}: {bad} of {obj.numel()} values are not finite"
        return None
    if isinstance(obj, float):
        return None if math.isfinite(obj) else f"{path} is {obj}"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    for key, value in items:
        if (where := _nonfinite(value, f"{path}.{key}" if path else str(key))) is not None:
            return where
    return None


def read_meta(directory: Path, shard: int, num_shards: int, cfg: SyncConfig) -> dict:
    """meta.json, when it belongs to this shard of a run with these sync settings; else ValueError (one
    line). Cheap: the shard checks it before it builds the model, so a wrong flag fails at once."""
    where = f"checkpoint {directory}"
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot read meta.json ({e}); use --fresh to start over") from None
    if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, LEGACY_FORMAT):
        got = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"{where} has format {got!r}, this shard reads {FORMAT} (and {LEGACY_FORMAT})")
    if (meta.get("shard"), meta.get("num_shards")) != (shard, num_shards):
        raise ValueError(
            f"{where} belongs to shard {meta.get('shard')} of {meta.get('num_shards')}, "
            f"not shard {shard} of {num_shards}: give each shard its own --checkpoint-dir"
        )
    config = c if isinstance(c := meta.get("config"), dict) else {}
    if config:  # written before --outer-variant existed: its step was nesterov's
        config = {"outer_variant": "nesterov", **config}
    ours = cfg.to_dict()
    if config != ours:
        changed = sorted(k for k in set(config) | set(ours) if config.get(k) != ours.get(k))
        raise ValueError(
            f"{where} was written by a run with other sync settings ({', '.join(changed)}): start with "
            "the same flags, or use --fresh (or another --checkpoint-dir) to start a new run"
        )
    if meta["format"] == FORMAT:
        for key in ("files", "incoming"):
            table = meta.get(key)
            if not isinstance(table, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in table.items()
            ):
                raise ValueError(f"{where}: meta.json's {key!r} is not a table of file hashes (--fresh)")
    return meta


def read_json(directory: Path, name: str, want: str) -> tuple[object, str]:
    """A JSON file of the checkpoint and its sha256; ValueError (one line) when it is missing, damaged or
    its hash is not `want`."""
    where = f"checkpoint {directory}"
    try:
        data = (directory / name).read_bytes()
    except OSError as e:
        raise ValueError(f"{where}: cannot read {name} ({_first_line(e)}); use --fresh") from None
    sha = hashlib.sha256(data).hexdigest()
    if sha != want:
        raise ValueError(
            f"{where}: {name} is damaged: its sha256 is {sha[:16]}..., meta.json lists {want[:16]}...; "
            "restore the directory from a copy or use --fresh"
        )
    try:
        return json.loads(data), sha
    except ValueError as e:
        raise ValueError(f"{where}: {name} is damaged ({_first_line(e)})") from None


# The parts beside the fragments that a shard registers (`register`), by name: their file, and what the log
# calls them. Each is a JSON file written whole, listed in meta.json with its hash.
PARTS = {"ledger": (LEDGER, "the data ledger"), "credits": (CREDITS, "the contribution credits")}


class ShardCheckpoint:
    """A shard's checkpoint directory (see the module's docstring). The fragments are ShardState's; every
    other part (shard 0's data ledger, the contribution credits) registers how to get its state with
    `register` (as torchft's `register_state_dict_fn`), is saved with the rest by `save_all` or on its own
    by `save_part`, and finds what `load` read of it in `restored(name)`. `init_hash`: the run's, for
    --init from-worker (kept in meta.json)."""

    def __init__(self, directory: str | Path, fingerprint: dict, init_hash: str = ""):
        self.dir = Path(directory)
        self.fingerprint = fingerprint
        self.writes = 0
        self.pending_initial = False  # write every file before the first worker comes (a new run)
        self.errors = 0
        self.last_error: str | None = None
        # what meta.json lists: file (relative to dir) -> sha256; and the hash of a file being replaced
        self.files: dict[str, str] = {}
        self.incoming: dict[str, str] = {}
        self.committed = False  # meta.json of this run is on disk: every write updates it
        self._run: dict | None = None  # meta.json less the hashes
        self._lock = threading.Lock()  # close jobs of two fragments write on two threads
        self._parts: dict[str, Callable[[], dict | None]] = {}  # name -> its state now (None: nothing yet)
        self._restored: dict[str, object] = {}  # name -> what load() read of its file
        # the rounds load() replayed: (fragment, round, its log's "credit", how it closed)
        self.replayed: list[tuple[int, int, object, str]] = []
        self._json_locks = {name: threading.Lock() for name in PARTS}  # one write of each at once
        self.init_hash = init_hash  # --init from-worker: the upload's init hash (common/inithash.py)

    def register(self, name: str, state: Callable[[], dict | None]) -> None:
        """Save the part `name` (one of PARTS) with the rest of the checkpoint: `state()` gives what to write
        (None: nothing yet)."""
        if name not in PARTS:
            raise KeyError(f"no checkpoint part {name!r}: one of {sorted(PARTS)}")
        self._parts[name] = state

    def restored(self, name: str) -> object:
        """What load() read of the part's file (None: the checkpoint had none)."""
        return self._restored.get(name)

    def needs_initial(self) -> None:
        """Write every file before the first worker comes (`write_initial`): a new run's starting state."""
        self.pending_initial = True

    def write_initial(self, state: ShardState) -> None:
        """The starting state of a new run (or a checkpoint of an old format, written again with hashes),
        if it is still to be written; OSError if it cannot be."""
        if self.pending_initial:
            if not self.save_all(state):
                raise OSError(f"cannot write the checkpoint to {self.dir}: {self.last_error}")
            self.pending_initial = False

    def _meta(self, state: ShardState) -> dict:
        return {
            "format": FORMAT,
            "shard": state.shard,
            "num_shards": state.num_shards,
            "config": state.cfg.to_dict(),
            "fingerprint": self.fingerprint,
            **({"init_hash": self.init_hash} if self.init_hash else {}),
        }

    def exists(self) -> bool:
        return (self.dir / "meta.json").exists()

    def load(self, state: ShardState) -> None:
        """Restore every fragment of `state` from the directory; ValueError (one line) when the checkpoint
        belongs to another run, is incomplete, or a file is damaged (its hash differs from meta.json's, or
        it holds values that are not finite)."""
        where = f"checkpoint {self.dir}"
        meta = read_meta(self.dir, state.shard, state.num_shards, state.cfg)
        diff = fingerprint_diff(
            meta.get("fingerprint") or {}, self.fingerprint, us="checkpoint", them="model"
        )
        if diff:
            raise ValueError(f"{where} was written for another model: {diff}; use --fresh to start over")
        legacy = meta["format"] == LEGACY_FORMAT
        if legacy:
            log.warning(
                "%s was written without file hashes (format %d): loading it unchecked; it is written again "
                "with hashes before any worker is taken",
                where,
                LEGACY_FORMAT,
            )
        files: dict[str, str] = {}  # what the files hash to, as loaded
        incoming = {} if legacy else meta["incoming"]
        for f in range(state.layout.num_fragments):
            name = f"fragment-{f}.pt"
            if not legacy and name not in meta["files"]:
                raise ValueError(f"{where} is incomplete: meta.json does not list {name}; use --fresh")
            want = None if legacy else (meta["files"][name], incoming.get(name))
            saved, files[name] = self._read(name, want)
            try:
                state.load_fragment_state(f, saved)
            except ValueError as e:
                raise ValueError(f"{where}: {name} does not fit ({e})") from None
            r = state.round_of(f)
            while (name := f"rounds/fragment-{f}-round-{r}.pt") in meta.get("files", {}) or (
                legacy and (self.dir / name).exists()
            ):  # the rounds closed since: replayed
                record, files[name] = self._read(name, None if legacy else (meta["files"][name], None))
                try:
                    closed = state.replay_round(f, record)
                except Exception as e:  # a log whose pushes do not check
                    raise ValueError(f"{where}: {name} is damaged ({_first_line(e)})") from None
                credit = record.get("credit") if isinstance(record, dict) else None
                self.replayed.append((f, r, credit, closed.why))
                r += 1
            for listed in meta.get("files", {}):  # a listed log beyond a gap: the log of a round is missing
                m = _LOG_NAME.fullmatch(listed)
                if m and int(m[1]) == f and int(m[2]) > r:
                    raise ValueError(f"{where} is incomplete: meta.json lists {listed} but not {name}")
        for part, (file, _) in PARTS.items():
            if not legacy and file in meta["files"]:
                self._restored[part], files[file] = read_json(self.dir, file, meta["files"][file])
        self.files, self.incoming, self.committed = files, {}, True
        self._run = {**{k: meta[k] for k in ("shard", "num_shards", "config")}, "format": FORMAT}
        self._run["fingerprint"] = self.fingerprint
        if isinstance(h := meta.get("init_hash"), str) and h:
            self.init_hash = self._run["init_hash"] = h[:64]
        if legacy:
            self.pending_initial = True  # written again, with hashes, before the shard serves

    def _read(self, name: str, want: tuple[str, str | None] | None) -> tuple[object, str]:
        """A file of the checkpoint, loaded, and its sha256; ValueError (one line) when it is missing, its
        hash is not one of `want` (the listed one and an incoming one; None: not checked), torch cannot read
        it, or it holds a value that is not finite."""
        where = f"checkpoint {self.dir}"
        try:
            data = (self.dir / name).read_bytes()
        except FileNotFoundError:
            raise ValueError(f"{where} is incomplete: {name} is missing; use --fresh") from None
        except OSError as e:
            raise ValueError(f"{where}: cannot read {name} ({_first_line(e)})") from None
        sha = hashlib.sha256(data).hexdigest()
        if want is not None and sha not in want:
            raise ValueError(
                f"{where}: {name} is damaged: its sha256 is {sha[:16]}..., meta.json lists "
                f"{want[0][:16]}...; restore the directory from a copy or use --fresh"
            )
        try:
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many kinds, some with pages of advice, for damaged files
            raise ValueError(f"{where}: {name} is damaged ({_first_line(e)})") from None
        del data
        if (bad := _nonfinite(obj)) is not None:
            raise ValueError(f"{where}: {name} is damaged: {bad}; use --fresh or restore it from a copy")
        return obj, sha

    def save_part(self, name: str, state: dict) -> bool:
        """Write a part's state (a JSON file, whole: a few bytes per piece of the data ledger, a few hundred
        per worker of the credits) and list it in meta.json; False (and an error in the log) if it could
        not."""
        file, what = PARTS[name]
        return self._save_json(file, state, what, name)

    def _save_json(self, name: str, state: dict, what: str, part: str) -> bool:
        data = json.dumps(state, separators=(",", ":")).encode()
        try:
            with self._json_locks[part]:  # two writers' files and hashes must not cross
                self.dir.mkdir(parents=True, exist_ok=True)
                sha = _write_hashed(self.dir / name, lambda f: f.write(data))
                with self._lock:
                    self.files[name] = sha
                    if self.committed:
                        self._write_meta()
                    self.writes += 1
            return True
        except OSError as e:
            return self._failed(what, e)

    def _log_path(self, fragment: int, round: int) -> Path:
        return self.dir / "rounds" / f"fragment-{fragment}-round-{round}.pt"

    def _write_meta(self) -> None:
        """meta.json with the hashes as they are now (the caller holds the lock)."""
        meta = json.dumps({**(self._run or {}), "files": self.files, "incoming": self.incoming}, indent=1)
        atomic_write_text(self.dir / "meta.json", meta)

    def _failed(self, what: str, e: OSError) -> bool:
        self.errors += 1
        self.last_error = f"{type(e).__name__}: {e}"
        log.error("%s to %s failed: %s", what, self.dir, self.last_error)
        return False

    def full_due(self, round: int) -> bool:
        """Whether the fragment's whole state is written after this round (besides the round's log)."""
        return (round + 1) % FULL_EVERY == 0

    def log_round(self, fragment: int, record: dict) -> bool:
        """Write a closing round's log (CloseJob.record) and list it in meta.json; False (and an error in
        the log) if it could not."""
        path = self._log_path(fragment, record["round"])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            sha = _write_hashed(path, lambda f: torch.save(record, f, _use_new_zipfile_serialization=False))
            with self._lock:
                self.files[f"rounds/{path.name}"] = sha
                if self.committed:
                    self._write_meta()
                self.writes += 1
            return True
        except OSError as e:
            return self._failed(f"log of fragment {fragment} round {record['round']}", e)

    def save_fragment(self, state: ShardState, fragment: int) -> bool:
        """Write one fragment's file; False (and an error in the log) if it could not be written."""
        return self.save(fragment, state.fragment_state(fragment))

    def save(self, fragment: int, saved: dict) -> bool:
        """Write a fragment's state (ShardState.fragment_state, or a close job's, on the job's thread) and
        list it in meta.json, dropping the logs of the rounds before it."""
        name, below = f"fragment-{fragment}.pt", int(saved["round"])

        def announce(sha: str) -> None:  # the new file's hash is taken before the file is in place
            with self._lock:
                if self.committed:
                    self.incoming[name] = sha
                    self._write_meta()

        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            # torch's legacy (non-zip) format: a 300 MB fragment state is written in 0.23 s against 0.4-1 s
            # for the zip format (which checksums it and writes it in small pieces), and this write is on
            # every round's critical path (the update goes out once it is durable); torch.load reads both
            sha = _write_hashed(
                self.dir / name,
                lambda f: torch.save(saved, f, _use_new_zipfile_serialization=False),
                announce,
            )
            with self._lock:
                self.files[name] = sha
                self.incoming.pop(name, None)
                for listed in list(self.files):
                    m = _LOG_NAME.fullmatch(listed)
                    if m and int(m[1]) == fragment and int(m[2]) < below:
                        del self.files[listed]
                if self.committed:
                    self._write_meta()
                self.writes += 1
            self._drop_logs(fragment, below)
            return True
        except OSError as e:
            return self._failed(f"checkpoint of fragment {fragment}", e)

    def _drop_logs(self, fragment: int, below: int) -> None:
        """Remove the fragment's round logs older than its whole state of round `below` (no longer listed)."""
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

    def save_all(self, state: ShardState) -> bool:
        """Write every fragment and meta.json: a new run's first checkpoint, the last one of a shard that
        stops, or a checkpoint of the previous format written again with hashes."""
        self._run = self._meta(state)
        if not self.committed:  # a new run: another run's meta.json must not name the files written now
            try:
                (self.dir / "meta.json").unlink(missing_ok=True)
            except OSError as e:
                return self._failed("removing the old meta.json", e)
            self.files, self.incoming = {}, {}
        ok = all([self.save_fragment(state, f) for f in range(state.layout.num_fragments)])
        for part, state_now in self._parts.items():
            if (saved := state_now()) is not None:
                ok = self.save_part(part, saved) and ok
        if not ok:
            return False
        try:
            with self._lock:
                self._write_meta()
                self.committed = True
        except OSError as e:
            return self._failed("checkpoint meta.json", e)
        return True
