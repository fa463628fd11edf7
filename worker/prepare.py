"""Data preparation, what `streamdiloco data prepare` (cli/data.py) runs: text files, JSON Lines files and
folders of them, tokenized into a prepared folder (common/prepared.py's format, which workers train on) with
a local tokenizer or one trained on the input (common/tokenizer.py).

The inputs, in order, each document in turn:
- a file named on the command line: `.jsonl`, `.ndjson` and `.json` are JSON Lines (one document per
  line, its `text` field; blank lines skipped), any other file is one text document (UTF-8);
- a folder: its `.txt`, `.text`, `.md` and `.rst` files (text) and `.jsonl` and `.ndjson` files (JSON
  Lines), recursively, sorted by path; hidden files and folders and other files are skipped (counted).
A file that is not UTF-8 or holds a NUL byte (a binary file), a JSON Lines line without a string `text`,
or no document at all is an error. Empty documents are skipped. A text file is read in blocks of about
`block_chars` characters cut after a line end (between two non-blank lines where it can), each encoded on
its own: with a byte-level BPE (ours) the tokens are those of the whole file; memory stays bounded.

Each document's tokens are its text's (no BOS or other template tokens: add_special_tokens=False) followed
by the EOS id. Nothing is downloaded: the tokenizer is a local tokenizer.json, a folder saved with
save_pretrained, or trained here (byte-level BPE with <|endoftext|> as EOS, id 0).

Must not: import torch (it needs none), or write anything but through PreparedWriter (which leaves no
partial output).
"""

from __future__ import annotations

import codecs
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from streamdiloco.common.prepared import PreparedDataError, PreparedWriter, check_out_dir
from streamdiloco.common.tokenizer import TRAINED_EOS, load_tokenizer, tokenizer_vocab_size, train_tokenizer

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")  # a file named on the command line
FOLDER_TEXT = (".txt", ".text", ".md", ".rst")  # what a folder's walk takes
FOLDER_JSONL = (".jsonl", ".ndjson")
_SEGMENT_CUT = re.compile(r"\S\n(?=\S)")  # a line end between two non-blank characters


@dataclass
class Source:
    """One input file and how it is read."""

    path: Path
    jsonl: bool


@dataclass
class Stats:
    """What has been read and written so far (the progress line and the summary)."""

    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    skipped_files: int = 0
    files: int = 0
    t0: float = field(default_factory=time.perf_counter)


def find_sources(inputs: list[str], stats: Stats) -> list[Source]:
    """The files the inputs name, in order: a named file as it is, a folder's files walked in sorted order."""
    sources: list[Source] = []
    for name in inputs:
        p = Path(name)
        if p.is_file():
            sources.append(Source(p, p.suffix.lower() in JSONL_SUFFIXES))
        elif p.is_dir():
            found = 0
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for f in sorted(files):
                    suffix = Path(f).suffix.lower()
                    if f.startswith(".") or suffix not in FOLDER_TEXT + FOLDER_JSONL:
                        stats.skipped_files += 1
                        continue
                    sources.append(Source(Path(root, f), suffix in FOLDER_JSONL))
                    found += 1
            if not found:
                raise PreparedDataError(
                    f"{p}: no {', '.join(FOLDER_TEXT + FOLDER_JSONL)} files in this folder (nor below it)"
                )
        elif p.exists():
            raise PreparedDataError(f"{p}: not a file or a folder")
        else:
            raise PreparedDataError(f"{p}: no such file or folder")
    if not sources:
        raise PreparedDataError("no input: give text files, JSON Lines files or folders of them")
    stats.files = len(sources)
    return sources


def _not_text(path: Path, at: int) -> PreparedDataError:
    return PreparedDataError(
        f"{path}: not UTF-8 text (near byte {at}): a binary file? Give text or JSON Lines files"
    )


def text_segments(path: Path, block_chars: int, stats: Stats) -> Iterator[str]:
    """A text file's text in blocks of about `block_chars` characters, each cut after a line end (between
    two non-blank lines where there is one, else at any line end, else anywhere), checked to be UTF-8
    without NUL bytes."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
    carry, read = "", 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(max(1, block_chars))
            try:
                text = carry + decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise _not_text(path, read + e.start) from None
            if "\x00" in text:
                raise _not_text(path, read + len(text[: text.index("\x00")].encode()))
            read += len(raw)
            stats.bytes += len(raw)
            if not raw:
                if text:
                    yield text
                return
            if len(text) < block_chars:
                carry = text
                continue
            cut = _cut(text)
            yield text[:cut]
            carry = text[cut:]


def _cut(text: str) -> int:
    """Where to end a block of `text`: after the last line end between two non-blank characters, else the
    last line end, else the whole block; never at 0."""
    start = max(0, len(text) - 65536)  # a line longer than this is cut at a plain line end
    last = None
    for m in _SEGMENT_CUT.finditer(text, start):
        last = m
    if last is not None:
        return last.end()
    nl = text.rfind("\n", 0, len(text) - 1)
    return nl + 1 if nl >= 0 else len(text)


def jsonl_documents(path: Path, field_name: str, stats: Stats) -> Iterator[str]:
    """Each line's `field_name` string; blank lines skipped."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            stats.bytes += len(raw)
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark dropped
            except UnicodeDecodeError:
                raise PreparedDataError(f"{path} line {number}: not UTF-8: a binary file?") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise PreparedDataError(
                    f"{path} line {number}: not JSON ({e.msg}); JSON Lines wanted"
                ) from None
            text = record.get(field_name) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise PreparedDataError(
                    f"{path} line {number}: no string {field_name!r} field (JSON Lines: one object a line, "
                    f"its text in {field_name!r})"
                )
            yield text


def segments(
    sources: list[Source], field_name: str, block_chars: int, stats: Stats
) -> Iterator[tuple[str, str, bool]]:
    """(where, text, last) for every block of every non-empty document: `last` closes the document."""
    for src in sources:
        if src.jsonl:
            for text in jsonl_documents(src.path, field_name, stats):
                if text:
                    yield str(src.path), text, True
        else:
            pending = None
            for text in text_segments(src.path, block_chars, stats):
                if pending is not None:
                    yield str(src.path), pending, False
                pending = text
            if pending:
                yield str(src.path), pending, True


class Progress:
    """One line on stderr while it runs: rewritten in place on a terminal, a new line every 10 s else."""

    def __init__(self, stream: IO[str] | None, stats: Stats):
        self.stream, self.stats = stream, stats
        self.tty = bool(stream is not None and stream.isatty())
        self.every = 0.5 if self.tty else 10.0
        self.last = time.perf_counter()
        self.pending = False

    def tick(self, phase: str, force: bool = False) -> None:
        now = time.perf_counter()
        if self.stream is None or (now - self.last < self.every and not force):
            return
        self.last = now
        s = self.stats
        mb = s.bytes / 1e6
        rate = mb / max(now - s.t0, 1e-9)
        line = f"{phase}: {s.documents:,} documents, {s.tokens:,} tokens, {mb:,.1f} MB read ({rate:.1f} MB/s)"
        if self.tty:
            self.stream.write(f"\r\x1b[K{line}")
            self.pending = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.pending and self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()
            self.pending = False


def _batches(
    items: Iterator[tuple[str, str, bool]], batch_chars: int
) -> Iterator[list[tuple[str, str, bool]]]:
    batch: list[tuple[str, str, bool]] = []
    size = 0
    for item in items:
        batch.append(item)
        size += len(item[1])
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def prepare(
    inputs: list[str],
    out: str,
    *,
    tokenizer: str | None = None,
    train_vocab: int | None = None,
    eos: str | None = None,
    vocab_size: int | None = None,
    val_fraction: float = 0.005,
    block_size: int = 1024,
    text_field: str = "text",
    force: bool = False,
    progress: IO[str] | None = None,
    chunk_tokens: int = 1 << 22,
    block_chars: int = 1 << 22,
    batch_chars: int = 1 << 20,
) -> dict[str, Any]:
    """Prepare `inputs` into the folder `out` (see the module's docstring); returns the manifest plus
    "seconds", "bytes" and "skipped_files". `tokenizer` (a path) or `train_vocab` (train one of that many
    ids), not both. `vocab_size`: the bound every id must stay below (the model's vocabulary), else the
    folder's config.json's, else the tokenizer's. The validation tail holds about `val_fraction` of the
    tokens and at least block_size+1 where the data allows. `chunk_tokens`, `block_chars`, `batch_chars`:
    how much is held at a time (tokens written, a text file's block, text encoded at once)."""
    _check_request(tokenizer, train_vocab, eos, vocab_size, val_fraction, block_size)
    check_out_dir(out, force)
    started = time.perf_counter()
    stats = Stats()
    sources = find_sources(inputs, stats)
    bar = Progress(progress, stats)
    try:
        if tokenizer is not None:
            chosen = _Chosen(*load_tokenizer(tokenizer, eos))
        else:
            assert train_vocab is not None
            chosen = _trained(segments(sources, text_field, block_chars, stats), train_vocab, stats, bar)
        bound = vocab_size or chosen.model_vocab or tokenizer_vocab_size(chosen.tok)
        if chosen.eos_id >= bound:
            raise PreparedDataError(f"the EOS id {chosen.eos_id} is past the vocabulary ({bound} ids)")
        bound_name = "--vocab-size" if vocab_size else "the vocabulary"
        with PreparedWriter(
            out, vocab_size=bound, eos_id=chosen.eos_id, chunk_tokens=chunk_tokens, force=force
        ) as w:
            items = segments(sources, text_field, block_chars, stats)
            _encode_into(w, _batches(items, batch_chars), chosen.tok, f"{bound_name}: {bound} ids", bar)
            if w.documents == 0:
                raise PreparedDataError("no documents: every input is empty")
            manifest = w.finish(
                tokenizer_json=chosen.json,
                tokenizer_source=chosen.source,
                sources=[str(i) for i in inputs],
                val_fraction=val_fraction,
                val_min_tokens=block_size + 1,
            )
    finally:
        bar.close()
    return {
        **manifest,
        "seconds": time.perf_counter() - started,
        "bytes": stats.bytes,
        "skipped_files": stats.skipped_files,
        "files": stats.files,
    }


def _check_request(
    tokenizer: str | None,
    train_vocab: int | None,
    eos: str | None,
    vocab_size: int | None,
    val_fraction: float,
    block_size: int,
) -> None:
    """prepare()'s arguments, checked before anything is read (one-line PreparedDataErrors)."""
    if (tokenizer is None) == (train_vocab is None):
        raise PreparedDataError("give --tokenizer PATH or --train-tokenizer VOCAB (one of them)")
    if train_vocab is not None and not 257 <= train_vocab <= 2**31 - 1:
        raise PreparedDataError(
            f"--train-tokenizer {train_vocab}: the vocabulary needs at least 257 ids (256 bytes and EOS)"
        )
    if train_vocab is not None and eos not in (None, TRAINED_EOS):
        raise PreparedDataError(f"--eos: a trained tokenizer's EOS is {TRAINED_EOS}")
    if not 0 <= val_fraction < 0.5:
        raise PreparedDataError(f"--val-fraction must be in [0, 0.5), got {val_fraction}")
    if block_size < 1:
        raise PreparedDataError(f"--block-size must be at least 1, got {block_size}")
    if vocab_size is not None and vocab_size < 1:
        raise PreparedDataError(f"--vocab-size must be at least 1, got {vocab_size}")


@dataclass
class _Chosen:
    """The tokenizer a preparation encodes with: the Tokenizer, its JSON, its EOS id, the model's
    vocabulary where its folder says it, and where it came from (the manifest's tokenizer source)."""

    tok: Any
    json: bytes
    eos_id: int
    model_vocab: int | None
    source: str


def _trained(items: Iterator[tuple[str, str, bool]], vocab: int, stats: Stats, bar: Progress) -> _Chosen:
    """A byte-level BPE of `vocab` ids trained on the inputs (a first pass over them); the statistics then
    start again from 0 for the pass that encodes."""

    def texts() -> Iterator[str]:
        for _, text, last in items:
            yield text
            stats.documents += last
            bar.tick("training the tokenizer")

    tok = train_tokenizer(texts(), vocab)
    source = f"trained here: byte-level BPE, vocabulary {vocab}, on the inputs"
    chosen = _Chosen(tok, tok.to_str().encode("utf-8"), tok.token_to_id(TRAINED_EOS), None, source)
    stats.bytes = stats.documents = 0  # the progress line counts the second pass from 0
    stats.t0 = time.perf_counter()
    return chosen


def _encode_into(
    w: PreparedWriter, batches: Iterator[list[tuple[str, str, bool]]], tok: Any, bound: str, bar: Progress
) -> None:
    """Encode each batch of blocks and write the ids, ending a document after its last block; an id past
    the vocabulary names the file it came from and the `bound` ("the vocabulary: N ids")."""
    stats = bar.stats
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    for batch in batches:
        encoded = encode([text for _, text, _ in batch], add_special_tokens=False)
        for (where, _, last), enc in zip(batch, encoded, strict=True):
            try:
                w.write(enc.ids)
            except PreparedDataError as e:
                raise PreparedDataError(f"{where}: {e} ({bound})") from None
            if last:
                w.end_document()
                stats.documents += 1
        stats.tokens = w.tokens
        bar.tick("preparing")


def summary(out: str, m: dict[str, Any]) -> str:
    """The paragraph `data prepare` ends with."""
    val_tokens = m["tokens"] - m["train_tokens"]
    skipped = f" ({m['skipped_files']} other files skipped)" if m["skipped_files"] else ""
    mb = m["bytes"] / 1e6
    return (
        f"Prepared {out}: {m['documents']:,} documents from {m['files']:,} files{skipped}, {m['tokens']:,} "
        f"tokens of {m['dtype']} (vocabulary {m['vocab_size']:,} ids, EOS id {m['eos_id']}); train split "
        f"{m['train_tokens']:,} tokens, validation {val_tokens:,}. Tokenizer: {m['tokenizer']['source']}. "
        f"{mb:,.1f} MB of text in {m['seconds']:.1f} s ({mb / max(m['seconds'], 1e-9):.1f} MB/s); "
        f"tokens.bin sha256 {m['sha256']}. Train with --data {out}."
    )
