"""Prepared, tokenized data: a folder that `streamdiloco data prepare` writes (`PreparedWriter`) and that
workers, the shards' ledger and the benchmarks read (`PreparedData`).

A prepared dataset is a folder DIR (nanoGPT's prepare.py shape, plus an index and a manifest):

    tokens.bin      one flat array of token ids, little-endian uint16 when the vocabulary has at most 65,535
                    ids, else uint32: the documents one after another, each followed by the EOS id
    documents.bin   uint64 start offsets (in tokens) of every document in tokens.bin
    tokenizer.json  the tokenizer used (Hugging Face `tokenizers` JSON), so the folder is self-contained
    manifest.json   {"format": "streamdiloco-tokens/1", "dtype", "vocab_size", "eos_id", "tokens",
                    "documents", "train_tokens", "sha256" (of tokens.bin's bytes), "tokenizer": {"file",
                    "sha256", "source"}, "sources", "created"}

The validation split is the tail, tokens[train_tokens:] (whole documents); the train split is cut into
numbered pieces of `piece_tokens` consecutive tokens (the last one shorter) that the run hands out.

    data = PreparedData.open("corpus/", verify=True)   # strict: a wrong field or size is a ValueError
    data.train[:10], data.val, data.vocab_size, data.eos_id
    start, end = data.piece(3, 1 << 20)                 # data.train[start:end] is piece 3

The writer streams: tokens go to disk in chunks, hashed as they are written, into a hidden temporary
folder beside DIR that is renamed into place only once everything is written and checked, so an error (or
Ctrl-C) leaves no partial DIR and memory stays bounded by the chunk whatever the corpus's size.

Must not: import torch or anything above common/ (a worker's data loader, the ledger and `--help` read
this), hold a whole corpus in memory, or know how text becomes tokens (worker/prepare.py does).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from streamdiloco.common.atomic import fsync_dir

__all__ = [
    "DOCUMENTS",
    "FORMAT",
    "MANIFEST",
    "TOKENIZER",
    "TOKENS",
    "PreparedData",
    "PreparedDataError",
    "PreparedWriter",
    "check_manifest",
    "check_out_dir",
    "dtype_for",
    "looks_prepared",
]

FORMAT = "streamdiloco-tokens/1"
MANIFEST, TOKENS, DOCUMENTS, TOKENIZER = "manifest.json", "tokens.bin", "documents.bin", "tokenizer.json"
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
UINT16_MAX_VOCAB = 65_535  # at most this many ids: uint16
MAX_VOCAB = 2**32  # ids must fit uint32
OFFSET_DTYPE: np.dtype = np.dtype("<u8")
SCAN_TOKENS = 1 << 24  # tokens read at a time by verify (32-64 MB)
_SHA256 = re.compile(r"[0-9a-f]{64}")
# manifest field -> the type it must have (bool is refused where int is asked: json's true is not 1)
_FIELDS: dict[str, type] = {
    "format": str,
    "dtype": str,
    "vocab_size": int,
    "eos_id": int,
    "tokens": int,
    "documents": int,
    "train_tokens": int,
    "sha256": str,
    "tokenizer": dict,
    "sources": list,
    "created": str,
}
_TOKENIZER_FIELDS: dict[str, type] = {"file": str, "sha256": str, "source": str}


class PreparedDataError(ValueError):
    """A prepared folder that is not one (or not this one): a manifest field, a size, a hash, an id."""


def dtype_for(vocab_size: int) -> str:
    """The token dtype the format uses for a vocabulary of `vocab_size` ids: "uint16" or "uint32"."""
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise PreparedDataError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "uint32"


def looks_prepared(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a prepared folder (a folder with a manifest.json), as opposed to a text file: what
    `--data PATH` uses to choose its reader. Says nothing of whether the folder is valid (open() does)."""
    return Path(path, MANIFEST).is_file()


def _field(where: str, d: dict[str, Any], fields: dict[str, type]) -> None:
    """Every field of `fields` present with its type, and no other."""
    missing = [k for k in fields if k not in d]
    extra = sorted(set(d) - set(fields))
    if missing or extra:
        what = (f"lacks {', '.join(missing)}" if missing else "") + (" and " if missing and extra else "")
        raise PreparedDataError(f"{where} {what}{'has unknown ' + ', '.join(extra) if extra else ''}")
    for k, t in fields.items():
        v = d[k]
        if not isinstance(v, t) or (t is int and isinstance(v, bool)):
            raise PreparedDataError(f"{where}: {k} must be a {t.__name__}, got {v!r}")


def check_manifest(m: Any, where: str = MANIFEST) -> None:
    """The manifest's fields, each with its type and range, and their agreement with each other (not with
    the files: open() checks those). Raises PreparedDataError naming the field."""
    if not isinstance(m, dict):
        raise PreparedDataError(f"{where} is not a JSON object")
    if m.get("format") != FORMAT:
        raise PreparedDataError(
            f"{where}: unknown format {m.get('format')!r} (this version reads {FORMAT!r}): prepare the data "
            "again with this version's `streamdiloco data prepare`"
        )
    _field(where, m, _FIELDS)
    _field(f"{where}'s tokenizer", m["tokenizer"], _TOKENIZER_FIELDS)
    if m["dtype"] not in DTYPES:
        raise PreparedDataError(f"{where}: dtype must be one of {', '.join(DTYPES)}, got {m['dtype']!r}")
    if not 1 <= m["vocab_size"] <= MAX_VOCAB:
        raise PreparedDataError(f"{where}: vocab_size must be in [1, 2**32], got {m['vocab_size']}")
    if m["dtype"] != dtype_for(m["vocab_size"]):
        raise PreparedDataError(
            f"{where}: dtype {m['dtype']} does not fit vocab_size {m['vocab_size']} "
            f"(the format uses {dtype_for(m['vocab_size'])})"
        )
    if not 0 <= m["eos_id"] < m["vocab_size"]:
        raise PreparedDataError(f"{where}: eos_id {m['eos_id']} is outside [0, {m['vocab_size']})")
    if not 1 <= m["documents"] <= m["tokens"]:
        raise PreparedDataError(
            f"{where}: documents {m['documents']} must be in [1, tokens {m['tokens']}] (each ends with EOS)"
        )
    if not 1 <= m["train_tokens"] <= m["tokens"]:
        raise PreparedDataError(f"{where}: train_tokens {m['train_tokens']} is outside [1, {m['tokens']}]")
    for name, h in (("sha256", m["sha256"]), ("tokenizer's sha256", m["tokenizer"]["sha256"])):
        if not _SHA256.fullmatch(h):
            raise PreparedDataError(f"{where}: {name} must be 64 lowercase hex digits, got {h!r}")
    file = m["tokenizer"]["file"]
    if file in ("", ".", "..") or "/" in file or "\\" in file:
        raise PreparedDataError(f"{where}: the tokenizer's file must be a name in the folder, got {file!r}")
    if not all(isinstance(s, str) for s in m["sources"]):
        raise PreparedDataError(f"{where}: sources must be a list of strings")
    try:
        datetime.fromisoformat(m["created"])
    except ValueError:
        raise PreparedDataError(f"{where}: created is not an ISO date and time: {m['created']!r}") from None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _memmap(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """`count` items of `dtype` from `path`, read-only and mapped; the file must hold exactly that."""
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


class PreparedData:
    """One prepared folder, opened: its manifest checked against its files, its tokens mapped (not read).

    `tokens` (all), `train` (tokens[:train_tokens]) and `val` (the tail) are read-only numpy memmaps;
    `documents` the documents' start offsets (uint64, mapped). Build with `PreparedData.open(DIR)`."""

    def __init__(self, path: Path, manifest: dict[str, Any], tokens: np.ndarray, documents: np.ndarray):
        self.path = path
        self.manifest = manifest
        self.tokens = tokens
        self.documents = documents
        self.dtype: str = manifest["dtype"]
        self.vocab_size: int = manifest["vocab_size"]
        self.eos_id: int = manifest["eos_id"]
        self.train_tokens: int = manifest["train_tokens"]
        self.train = tokens[: self.train_tokens]
        self.val = tokens[self.train_tokens :]

    @classmethod
    def open(cls, path: str | os.PathLike[str], verify: bool = False) -> PreparedData:
        """Open the prepared folder `path`. The manifest is checked strictly (every field, its type and
        range, the files' sizes against the counts, the split at a document's end); with `verify` the
        tokens are read once more: their sha256 and the tokenizer's against the manifest, every id below
        vocab_size, every document ending with EOS. Raises PreparedDataError (a ValueError) saying what
        is wrong; a missing folder or file is one too."""
        d = Path(path)
        if not d.is_dir():
            raise PreparedDataError(f"{d}: no such folder (a prepared dataset is a folder with {MANIFEST})")
        mpath = d / MANIFEST
        try:
            m = json.loads(mpath.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise PreparedDataError(f"{d}: no {MANIFEST}: not a prepared dataset") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PreparedDataError(f"{mpath}: not JSON ({e})") from None
        check_manifest(m, str(mpath))
        dtype = DTYPES[m["dtype"]]
        for name, want in (
            (TOKENS, m["tokens"] * dtype.itemsize),
            (DOCUMENTS, m["documents"] * OFFSET_DTYPE.itemsize),
        ):
            f = d / name
            if not f.is_file():
                raise PreparedDataError(f"{d}: {name} is missing")
            size = f.stat().st_size
            if size != want:
                raise PreparedDataError(
                    f"{f} has {size} bytes where the manifest asks for {want} ({m['tokens']} tokens of "
                    f"{m['dtype']}, {m['documents']} documents): "
                    f"{'truncated' if size < want else 'longer than its manifest says'} (prepare it again)"
                )
        if not (d / m["tokenizer"]["file"]).is_file():
            raise PreparedDataError(f"{d}: {m['tokenizer']['file']} is missing")
        tokens = _memmap(d / TOKENS, dtype, m["tokens"])
        docs = _memmap(d / DOCUMENTS, OFFSET_DTYPE, m["documents"])
        data = cls(d, m, tokens, docs)
        data._check_index()
        if verify:
            data.verify()
        return data

    def _check_index(self) -> None:
        """The cheap checks of the index: it starts at 0, its last document fits, the split lies at a
        document's end and both ends hold EOS (verify() checks every document)."""
        n, docs = len(self.tokens), self.documents
        if int(docs[0]) != 0 or int(docs[-1]) >= n:
            raise PreparedDataError(f"{self.path / DOCUMENTS}: offsets must start at 0 and stay below {n}")
        split = self.train_tokens
        if split < n and int(docs[min(int(np.searchsorted(docs, split)), len(docs) - 1)]) != split:
            raise PreparedDataError(f"{self.path / MANIFEST}: train_tokens {split} is not a document's start")
        for end in {self.train_tokens, n}:
            if int(self.tokens[end - 1]) != self.eos_id:
                raise PreparedDataError(
                    f"{self.path / TOKENS}: token {end - 1} should be EOS ({self.eos_id})"
                )

    def verify(self) -> None:
        """Read everything once: tokens.bin's and the tokenizer's sha256, every id below vocab_size, the
        offsets strictly increasing with EOS before each. Raises PreparedDataError on the first fault."""
        m = self.manifest
        got = _sha256_file(self.path / TOKENS)
        if got != m["sha256"]:
            raise PreparedDataError(
                f"{self.path / TOKENS}: its sha256 {got[:16]}... does not match the manifest's "
                f"{m['sha256'][:16]}...: the tokens changed since they were prepared (prepare them again)"
            )
        tok = self.path / m["tokenizer"]["file"]
        if _sha256_file(tok) != m["tokenizer"]["sha256"]:
            raise PreparedDataError(f"{tok}: sha256 does not match the manifest's (not the tokenizer used)")
        for lo in range(0, len(self.tokens), SCAN_TOKENS):
            chunk = self.tokens[lo : lo + SCAN_TOKENS]
            if int(chunk.max()) >= self.vocab_size:
                at = lo + int(np.argmax(chunk >= self.vocab_size))
                raise PreparedDataError(
                    f"{self.path / TOKENS}: token {at} is id {int(self.tokens[at])}, past vocab_size "
                    f"{self.vocab_size}"
                )
        step = SCAN_TOKENS // 16  # offsets are 8 bytes, and gathered
        for lo in range(0, len(self.documents), step):
            starts = self.documents[lo : lo + step + 1].astype(np.int64)
            if (np.diff(starts) <= 0).any():
                raise PreparedDataError(f"{self.path / DOCUMENTS}: offsets are not strictly increasing")
            if (self.tokens[starts[1:] - 1] != self.eos_id).any():
                raise PreparedDataError(
                    f"{self.path / TOKENS}: a document does not end with EOS ({self.eos_id})"
                )

    def piece_count(self, piece_tokens: int) -> int:
        """How many pieces of `piece_tokens` tokens the train split makes: ceil(train_tokens / piece_tokens)
        (a ValueError when piece_tokens is not a positive integer)."""
        _check_piece_tokens(piece_tokens)
        return -(-self.train_tokens // int(piece_tokens))

    def piece(self, i: int, piece_tokens: int) -> tuple[int, int]:
        """Piece `i`'s token range (start, end) in the train split: [i * piece_tokens, ...), the last one
        ending at train_tokens. IndexError when i is not in [0, piece_count)."""
        n = self.piece_count(piece_tokens)
        if not 0 <= i < n:
            raise IndexError(f"piece {i} is outside [0, {n}) ({piece_tokens} tokens a piece)")
        start = i * piece_tokens
        return start, min(start + piece_tokens, self.train_tokens)

    def document(self, i: int) -> tuple[int, int]:
        """Document `i`'s token range (start, end) in tokens, its EOS included."""
        start = int(self.documents[i])
        end = int(self.documents[i + 1]) if i + 1 < len(self.documents) else len(self.tokens)
        return start, end

    @property
    def tokenizer_path(self) -> Path:
        """The folder's tokenizer.json."""
        return self.path / self.manifest["tokenizer"]["file"]

    def __repr__(self) -> str:
        return (
            f"PreparedData({str(self.path)!r}: {len(self.tokens)} tokens of {self.dtype}, "
            f"{len(self.documents)} documents, train {self.train_tokens}, vocab {self.vocab_size})"
        )


def _check_piece_tokens(piece_tokens: int) -> None:
    if isinstance(piece_tokens, bool) or not isinstance(piece_tokens, (int, np.integer)) or piece_tokens < 1:
        raise ValueError(f"piece_tokens must be a positive integer, got {piece_tokens!r}")


def check_out_dir(out: str | os.PathLike[str], force: bool = False) -> None:
    """Refuse an output folder that would lose something: one that exists and is not empty, unless `force`
    and it is a prepared folder (then it is replaced, at the end, as a whole). A one-line ValueError."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise PreparedDataError(f"--out {p} exists and is not a folder")
    if p.is_dir() and any(p.iterdir()):
        if not force:
            raise PreparedDataError(
                f"--out {p} exists and is not empty: give a new or empty folder (or --force to replace a "
                "prepared one)"
            )
        if not looks_prepared(p):
            raise PreparedDataError(
                f"--out {p} is not empty and not a prepared folder: --force replaces only prepared ones"
            )


class PreparedWriter:
    """Streams a prepared folder into place: `write(ids)` a document's tokens (in as many calls as it takes),
    `end_document()` after each, then `finish(...)`; or `abort()` (also what leaving a `with` block on an
    error does). Tokens are held at most `chunk_tokens` at a time (`max_held` records the most it held), the
    index at most `chunk_tokens // 4` offsets; both are written, and the tokens hashed, chunk by chunk, into
    a hidden folder beside `out` that finish() renames to `out`."""

    def __init__(
        self,
        out: str | os.PathLike[str],
        *,
        vocab_size: int,
        eos_id: int,
        chunk_tokens: int = 1 << 22,
        force: bool = False,
    ):
        self.out = Path(out)
        check_out_dir(self.out, force)
        self.dtype = dtype_for(vocab_size)
        if not 0 <= eos_id < vocab_size:
            raise PreparedDataError(f"the EOS id {eos_id} is past the vocabulary (vocab_size {vocab_size})")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
        self.vocab_size, self.eos_id, self.force = vocab_size, eos_id, force
        self.tokens = 0  # written (flushed or buffered), EOS included
        self.documents = 0
        self.max_held = 0  # the most tokens the buffer held at once
        self.flushes = 0
        self._doc_start = 0
        self._buf = np.empty(chunk_tokens, DTYPES[self.dtype])
        self._held = 0
        self._offsets = np.empty(max(1, chunk_tokens // 4), OFFSET_DTYPE)
        self._offsets_held = 0
        self._sha = hashlib.sha256()
        # a missing parent is made now and removed again if nothing comes of it
        self._made_parent: Path | None = None
        parent = self.out.absolute().parent
        if not parent.exists():
            top = parent
            while not top.parent.exists():
                top = top.parent
            parent.mkdir(parents=True)
            self._made_parent = top
        self.tmp = parent / f".{self.out.name}.partial-{secrets.token_hex(4)}"
        self.tmp.mkdir()
        self._tok_file = open(self.tmp / TOKENS, "wb")
        self._doc_file = open(self.tmp / DOCUMENTS, "wb")
        self.closed = False

    def __enter__(self) -> PreparedWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None or not self.closed:
            self.abort()

    def write(self, ids: Iterable[int] | np.ndarray) -> None:
        """Append token ids to the current document. A ValueError (nothing of it kept) when one is past
        the vocabulary or negative."""
        a = ids if isinstance(ids, np.ndarray) else np.asarray(ids if isinstance(ids, list) else list(ids))
        if a.size == 0:
            return
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise PreparedDataError(f"token ids must be a flat sequence of integers, got {a.dtype} {a.shape}")
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = hi if hi >= self.vocab_size else lo
            raise PreparedDataError(f"token id {bad} is past the vocabulary (vocab_size {self.vocab_size})")
        i = 0
        while i < a.size:
            take = min(a.size - i, self._buf.size - self._held)
            self._buf[self._held : self._held + take] = a[i : i + take]
            self._held += take
            self.max_held = max(self.max_held, self._held)
            i += take
            if self._held == self._buf.size:
                self._flush_tokens()
        self.tokens += a.size

    def end_document(self) -> None:
        """Close the current document: its EOS, and its start in the index."""
        self.write(np.array([self.eos_id]))
        self._offsets[self._offsets_held] = self._doc_start
        self._offsets_held += 1
        if self._offsets_held == self._offsets.size:
            self._flush_offsets()
        self.documents += 1
        self._doc_start = self.tokens

    def _flush_tokens(self) -> None:
        view = self._buf[: self._held].data
        self._tok_file.write(view)
        self._sha.update(view)
        self._held = 0
        self.flushes += 1

    def _flush_offsets(self) -> None:
        self._doc_file.write(self._offsets[: self._offsets_held].data)
        self._offsets_held = 0

    def finish(
        self,
        *,
        tokenizer_json: bytes,
        tokenizer_source: str,
        sources: list[str],
        val_fraction: float = 0.005,
        val_min_tokens: int = 1025,
    ) -> dict[str, Any]:
        """Write the rest, the tokenizer and the manifest, check the folder, and rename it to `out`. The
        validation split is the tail: the fewest last documents holding at least max(val_fraction of the
        tokens, val_min_tokens), that bound capped at half of the tokens (at least the last document, never
        the first); none with val_fraction 0 or a single document. Returns the manifest."""
        if self._doc_start != self.tokens:
            raise PreparedDataError("finish() in the middle of a document: call end_document() first")
        if self.documents == 0:
            raise PreparedDataError("no documents: nothing to prepare")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if self._held:
            self._flush_tokens()
        if self._offsets_held:
            self._flush_offsets()
        for f in (self._tok_file, self._doc_file):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        train = self._train_tokens(val_fraction, val_min_tokens)
        (self.tmp / TOKENIZER).write_bytes(tokenizer_json)
        manifest = {
            "format": FORMAT,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "tokens": self.tokens,
            "documents": self.documents,
            "train_tokens": train,
            "sha256": self._sha.hexdigest(),
            "tokenizer": {
                "file": TOKENIZER,
                "sha256": hashlib.sha256(tokenizer_json).hexdigest(),
                "source": tokenizer_source,
            },
            "sources": list(sources),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        with open(self.tmp / MANIFEST, "w", encoding="utf-8") as mf:
            mf.write(json.dumps(manifest, indent=1) + "\n")
            mf.flush()
            os.fsync(mf.fileno())
        PreparedData.open(self.tmp)  # what we wrote reads back (sizes, index, split)
        fsync_dir(self.tmp)
        self._commit()
        self.closed = True
        return manifest

    def _train_tokens(self, val_fraction: float, val_min_tokens: int) -> int:
        """Where the validation tail starts: a document's start (see finish())."""
        if val_fraction == 0 or self.documents < 2:
            return self.tokens
        # never more than half of the tokens: a small corpus keeps most of itself to train on
        want = min(max(math.ceil(val_fraction * self.tokens), val_min_tokens), self.tokens // 2)
        starts = np.memmap(self.tmp / DOCUMENTS, dtype=OFFSET_DTYPE, mode="r", shape=(self.documents,))
        # the last start that leaves at least `want` tokens after it, but never the first document
        k = int(np.searchsorted(starts, self.tokens - want, side="right")) - 1
        train = int(starts[max(k, 1)])
        del starts
        return train

    def _commit(self) -> None:
        """The finished folder takes `out`'s place (an empty `out` is replaced; a prepared one only with
        force, moved aside first and deleted once the new one is in)."""
        old = None
        if self.out.is_dir() and any(self.out.iterdir()):
            old = self.tmp.with_name(f".{self.out.name}.old-{secrets.token_hex(4)}")
            os.rename(self.out, old)
        os.replace(self.tmp, self.out)
        fsync_dir(self.out.absolute().parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Drop everything written: the temporary folder, and a parent folder made for `out`."""
        if self.closed:
            return
        self.closed = True
        for f in (self._tok_file, self._doc_file):
            with contextlib.suppress(OSError):
                f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self._made_parent is not None:
            shutil.rmtree(self._made_parent, ignore_errors=True)
