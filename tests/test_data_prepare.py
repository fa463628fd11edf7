"""Prepared data: `streamdiloco data prepare` (worker/prepare.py) writes what common/prepared.py reads.

The round trip through the real command (text, JSON Lines and a folder, a trained tokenizer): the tokens
decode back to the documents with EOS after each, the manifest's counts and hash are right, and the pieces
cover the train split once, in order. A tokenizer.json and a save_pretrained folder as the tokenizer; uint32
past 65,535 ids; the writer's memory bounded by its chunk; and every bad input refused in one line with
nothing left behind, by the real command.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from streamdiloco.common.prepared import (
    DOCUMENTS,
    MANIFEST,
    TOKENS,
    PreparedData,
    PreparedDataError,
    PreparedWriter,
    check_manifest,
    dtype_for,
    looks_prepared,
)
from streamdiloco.common.tokenizer import train_tokenizer
from streamdiloco.worker.prepare import Progress, Stats, prepare
from tests.support.procs import streamdiloco

TEXT_A = "The first document.\nIt has two lines, and some unicode: héllo, 日本語, ∑.\n"
TEXT_B = "# A markdown file\n\nIn a folder below the folder.\n"
TEXT_C = "Last file of the folder, sorted by path.\n"
RECORDS = [f"record {i}: the quick brown fox jumps over the lazy dog {i * i}" for i in range(12)]


def corpus(tmp: Path) -> tuple[list[str], list[str]]:
    """Inputs (a text file, a JSON Lines file, a folder) and the documents they hold, in order."""
    (tmp / "a.txt").write_text(TEXT_A)
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(RECORDS)]
    lines.insert(3, "")  # blank lines are skipped
    (tmp / "records.jsonl").write_text("\ufeff" + "\r\n".join(lines) + "\r\n")  # a BOM, CRLF line ends
    folder = tmp / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "b.md").write_text(TEXT_B)
    (folder / "z.txt").write_text(TEXT_C)
    (folder / "empty.txt").write_text("")  # an empty document is skipped
    (folder / "script.py").write_text("print('not a document')\n")  # not a text suffix: skipped
    (folder / ".hidden.txt").write_text("hidden\n")  # hidden: skipped
    (folder / "r.jsonl").write_text(json.dumps({"text": "from the folder's JSON Lines"}) + "\n")
    inputs = [str(tmp / "a.txt"), str(tmp / "records.jsonl"), str(folder)]
    # os.walk: a folder's files (sorted) before its subfolders'
    return inputs, [TEXT_A, *RECORDS, "from the folder's JSON Lines", TEXT_C, TEXT_B]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A byte-level BPE trained here (no download), saved as a tokenizer.json."""
    tok = train_tokenizer(iter([TEXT_A, TEXT_B, TEXT_C, *RECORDS] * 3), 400)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(tok.to_str())
    return path


def decode_documents(data: PreparedData, tokenizer_json: Path) -> list[str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    docs = []
    for i in range(len(data.documents)):
        start, end = data.document(i)
        ids = data.tokens[start:end].tolist()
        assert ids[-1] == data.eos_id and data.eos_id not in ids[:-1]
        docs.append(tok.decode(ids[:-1], skip_special_tokens=False))
    return docs


def left_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_round_trip_through_the_command(tmp_path):
    inputs, docs = corpus(tmp_path)
    out = tmp_path / "prepared"
    r = streamdiloco("data", "prepare", *inputs, "--out", str(out), "--train-tokenizer", "320")
    assert r.returncode == 0, r.stderr
    assert f"Prepared {out}: {len(docs)} documents from 6 files (2 other files skipped)" in r.stdout, r.stdout
    assert looks_prepared(out) and not looks_prepared(tmp_path)
    assert left_in(tmp_path) == ["a.txt", "folder", "prepared", "records.jsonl"]  # no temporary left

    data = PreparedData.open(out, verify=True)
    m = data.manifest
    assert decode_documents(data, out / "tokenizer.json") == docs
    raw = (out / TOKENS).read_bytes()
    assert m["sha256"] == hashlib.sha256(raw).hexdigest() and m["dtype"] == "uint16"
    assert m["tokens"] == len(raw) // 2 == len(data.tokens) and m["documents"] == len(docs)
    assert m["tokenizer"]["sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert m["sources"] == inputs and m["eos_id"] == 0 and m["vocab_size"] <= 320
    assert (np.asarray(data.tokens) < m["vocab_size"]).all()
    # the validation tail: whole last documents, at least one, about half at most (this corpus is small)
    first_val = data.documents.tolist().index(m["train_tokens"])
    start, end = data.document(first_val)
    assert 0 < len(data.val) - (end - start) < m["tokens"] // 2
    assert len(data.train) + len(data.val) == m["tokens"]

    # pieces cover the train split exactly once, in order, the last one shorter
    piece_tokens = next(p for p in range(7, 50) if m["train_tokens"] % p)
    n = data.piece_count(piece_tokens)
    ranges = [data.piece(i, piece_tokens) for i in range(n)]
    assert ranges[0][0] == 0 and ranges[-1][1] == m["train_tokens"]
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert (
        all(e - s == piece_tokens for s, e in ranges[:-1])
        and 0 < ranges[-1][1] - ranges[-1][0] < piece_tokens
    )
    with pytest.raises(IndexError):
        data.piece(n, piece_tokens)
    with pytest.raises(ValueError):
        data.piece_count(0)

    r = streamdiloco("data", "check", str(out))
    assert r.returncode == 0 and f"{out}: ok, {m['tokens']:,} tokens" in r.stdout, r.stdout + r.stderr


def test_a_tokenizer_json_and_a_save_pretrained_folder(tmp_path, tokenizer_file):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    inputs, docs = corpus(tmp_path)
    tok = Tokenizer.from_file(str(tokenizer_file))

    # a bare tokenizer.json: its EOS found among the usual names (<|endoftext|>)
    manifest = prepare(inputs, str(tmp_path / "p1"), tokenizer=str(tokenizer_file))
    data = PreparedData.open(tmp_path / "p1", verify=True)
    assert decode_documents(data, tokenizer_file) == docs and manifest["eos_id"] == 0
    want = [i for d in docs for i in [*tok.encode(d, add_special_tokens=False).ids, 0]]
    assert data.tokens.tolist() == want
    assert manifest["tokenizer"]["source"] == str(tokenizer_file)
    assert (tmp_path / "p1" / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()

    # a folder saved with save_pretrained, whose EOS is another token (tokenizer_config.json's eos_token)
    # and beside a model's config.json: its vocab_size bounds the ids
    tok.add_special_tokens(["<|im_end|>"])
    folder = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>").save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 512}))
    r = streamdiloco("data", "prepare", *inputs, "--out", str(tmp_path / "p2"), "--tokenizer", str(folder))
    assert r.returncode == 0, r.stderr
    data = PreparedData.open(tmp_path / "p2", verify=True)
    eos = tok.token_to_id("<|im_end|>")
    assert data.eos_id == eos != 0 and data.vocab_size == 512
    assert decode_documents(data, folder / "tokenizer.json") == docs


def test_uint32_past_65535_ids(tmp_path):
    assert dtype_for(65_535) == "uint16" and dtype_for(65_536) == "uint32"
    ids = [[70_000 - 1, 5, 65_535], [65_536, 1], [3]]
    with PreparedWriter(tmp_path / "big", vocab_size=70_000, eos_id=69_998) as w:
        for doc in ids:
            w.write(doc)
            w.end_document()
        w.finish(tokenizer_json=b"{}", tokenizer_source="test", sources=["x"], val_fraction=0)
    data = PreparedData.open(tmp_path / "big", verify=True)
    assert data.dtype == "uint32" and data.tokens.dtype == np.dtype("<u4")
    assert (tmp_path / "big" / TOKENS).stat().st_size == 4 * len(data.tokens)
    assert data.tokens.tolist() == [69_999, 5, 65_535, 69_998, 65_536, 1, 69_998, 3, 69_998]
    assert data.documents.tolist() == [0, 4, 7] and len(data.val) == 0


def test_the_writer_holds_one_chunk_at_most(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 1000, size=rng.integers(0, 60)) for _ in range(400)]
    with PreparedWriter(tmp_path / "out", vocab_size=1000, eos_id=0, chunk_tokens=16) as w:
        for doc in docs:
            half = len(doc) // 2  # a document may come in several writes
            w.write(doc[:half])
            w.write(doc[half:])
            w.end_document()
        m = w.finish(tokenizer_json=b"{}", tokenizer_source="test", sources=[], val_fraction=0.1)
    assert w.max_held <= 16 and w.flushes >= m["tokens"] // 16 > 100
    data = PreparedData.open(tmp_path / "out", verify=True)
    assert data.tokens.tolist() == [t for d in docs for t in [*d.tolist(), 0]]
    assert 0.1 * m["tokens"] <= len(data.val) <= m["tokens"] // 2


def test_a_large_text_file_is_encoded_in_blocks_with_the_same_tokens(tmp_path, tokenizer_file):
    """A text file read in small blocks (cut between lines) gives the tokens of the whole file, with few
    tokens held at a time."""
    from tokenizers import Tokenizer

    lines = [f"{RECORDS[i % len(RECORDS)]}  \n" + ("\n" if i % 7 == 0 else "") for i in range(800)]
    text = "".join(lines) + "no newline at the end"
    (tmp_path / "big.txt").write_text(text)
    tok = Tokenizer.from_file(str(tokenizer_file))
    m = prepare(
        [str(tmp_path / "big.txt")],
        str(tmp_path / "out"),
        tokenizer=str(tokenizer_file),
        chunk_tokens=64,
        block_chars=500,
        batch_chars=1000,
    )
    data = PreparedData.open(tmp_path / "out", verify=True)
    assert m["documents"] == 1 and data.tokens.tolist() == [*tok.encode(text).ids, 0]


def test_force_replaces_a_prepared_folder_only(tmp_path, tokenizer_file):
    (tmp_path / "a.txt").write_text(TEXT_A)
    out = tmp_path / "out"
    prepare([str(tmp_path / "a.txt")], str(out), tokenizer=str(tokenizer_file))
    first = (out / MANIFEST).read_text()
    with pytest.raises(PreparedDataError, match="exists and is not empty"):
        prepare([str(tmp_path / "a.txt")], str(out), tokenizer=str(tokenizer_file))
    (tmp_path / "b.txt").write_text(TEXT_B)
    prepare([str(tmp_path / "b.txt")], str(out), tokenizer=str(tokenizer_file), force=True)
    assert (out / MANIFEST).read_text() != first and left_in(tmp_path) == ["a.txt", "b.txt", "out"]
    # a missing parent is made, and removed again when nothing comes of it
    with pytest.raises(RuntimeError), PreparedWriter(tmp_path / "x" / "y" / "o", vocab_size=9, eos_id=0) as w:
        w.write([1, 2])
        raise RuntimeError("interrupted")
    assert left_in(tmp_path) == ["a.txt", "b.txt", "out"]


def good_manifest() -> dict:
    return {
        "format": "streamdiloco-tokens/1",
        "dtype": "uint16",
        "vocab_size": 100,
        "eos_id": 0,
        "tokens": 10,
        "documents": 2,
        "train_tokens": 6,
        "sha256": "0" * 64,
        "tokenizer": {"file": "tokenizer.json", "sha256": "1" * 64, "source": "x"},
        "sources": ["a"],
        "created": "2026-11-26T15:31:02+00:00",
    }


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda m: m.pop("sha256"), "lacks sha256"),
        (lambda m: m.update(extra=1), "has unknown extra"),
        (lambda m: m.update(tokens=True), "tokens must be a int"),
        (lambda m: m.update(dtype="int64"), "dtype must be one of"),
        (lambda m: m.update(dtype="uint32"), "does not fit vocab_size 100"),
        (lambda m: m.update(eos_id=100), "eos_id 100 is outside"),
        (lambda m: m.update(train_tokens=0), "train_tokens 0"),
        (lambda m: m.update(sha256="ABC"), "64 lowercase hex"),
        (lambda m: m["tokenizer"].update(file="../t.json"), "a name in the folder"),
        (lambda m: m.update(created="yesterday"), "not an ISO date"),
        (lambda m: m.update(format="streamdiloco-tokens/2"), "unknown format"),
    ],
)
def test_the_manifest_is_checked_strictly(change, error):
    check_manifest(good_manifest())
    m = good_manifest()
    change(m)
    with pytest.raises(PreparedDataError, match=error):
        check_manifest(m)


def test_the_index_is_checked_at_open(tmp_path):
    with PreparedWriter(tmp_path / "d", vocab_size=50, eos_id=0) as w:
        for doc in ([5, 6, 7], [8, 9], [10]):
            w.write(doc)
            w.end_document()
        w.finish(tokenizer_json=b"{}", tokenizer_source="t", sources=[], val_fraction=0.2, val_min_tokens=1)
    m = json.loads((tmp_path / "d" / MANIFEST).read_text())
    assert m["train_tokens"] == 7 and PreparedData.open(tmp_path / "d").val.tolist() == [10, 0]
    (tmp_path / "d" / MANIFEST).write_text(json.dumps({**m, "train_tokens": 5}))
    with pytest.raises(PreparedDataError, match="train_tokens 5 is not a document's start"):
        PreparedData.open(tmp_path / "d")
    (tmp_path / "d" / MANIFEST).write_text(json.dumps(m))
    (tmp_path / "d" / DOCUMENTS).write_bytes(np.array([0, 7, 7], "<u8").tobytes())
    PreparedData.open(tmp_path / "d")  # the cheap checks pass; verify reads every offset
    with pytest.raises(PreparedDataError, match="not strictly increasing"):
        PreparedData.open(tmp_path / "d", verify=True)


def refused(r, expect: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-2000:])
    assert lines[0].startswith("streamdiloco: error: ") and expect in lines[0], lines[0]
    assert r.stdout == ""


BAD_INPUTS = {
    "binary": ("binary.txt", "not UTF-8 text"),
    "nul": ("nul.txt", "not UTF-8 text"),
    "empty folder": ("empty", "no .txt, .text, .md, .rst, .jsonl, .ndjson files"),
    "no documents": ("blank.txt", "no documents"),
    "text not a string": ("n.jsonl", "n.jsonl line 2: no string 'text' field"),
    "not json": ("bad.jsonl", "bad.jsonl line 1: not JSON"),
    "missing": ("nothing-here.txt", "no such file or folder"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_in_one_line_with_nothing_left(tmp_path, case):
    src = tmp_path / "src"
    src.mkdir()
    (src / "binary.txt").write_bytes(b"GIF89a\x01\x00\xff\xfe\x00\x80" * 10)
    (src / "nul.txt").write_bytes(b"plain ascii\x00then a NUL")
    (src / "empty").mkdir()
    (src / "blank.txt").write_text("")
    (src / "n.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": 5}) + "\n")
    (src / "bad.jsonl").write_text("[1, 2,\n")
    name, expect = BAD_INPUTS[case]
    before = left_in(src)
    r = streamdiloco(
        "data", "prepare", str(src / name), "--out", str(tmp_path / "o"), "--train-tokenizer", "300"
    )
    refused(r, expect)
    assert left_in(tmp_path) == ["src"] and left_in(src) == before


def test_bad_tokenizer_vocabulary_and_out_are_refused(tmp_path, tokenizer_file):
    (tmp_path / "a.txt").write_text(TEXT_A * 50)
    a = str(tmp_path / "a.txt")
    # an id past the model's vocabulary, found while writing: the temporary folder goes too
    r = streamdiloco(
        "data",
        "prepare",
        a,
        "--out",
        str(tmp_path / "o"),
        "--tokenizer",
        str(tokenizer_file),
        "--vocab-size",
        "300",
    )
    refused(r, "is past the vocabulary")
    assert "--vocab-size: 300 ids" in r.stderr and left_in(tmp_path) == ["a.txt"]
    # a tokenizer without a known EOS
    (tmp_path / "t").mkdir()
    bare = tokenizer_file.read_text().replace("<|endoftext|>", "<|some other name|>")
    (tmp_path / "t" / "tokenizer.json").write_text(bare)
    r = streamdiloco("data", "prepare", a, "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "t"))
    refused(r, "cannot tell its end-of-text token")
    r = streamdiloco("data", "prepare", a, "--out", str(tmp_path / "o"), "--tokenizer", a)
    refused(r, "not a tokenizers JSON file")
    # --out not empty, with or without --force (that replaces prepared folders only)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    for force in ([], ["--force"]):
        r = streamdiloco(
            "data", "prepare", a, "--out", str(tmp_path / "full"), "--train-tokenizer", "300", *force
        )
        refused(r, "is not empty" if force else "exists and is not empty")
    assert left_in(tmp_path) == ["a.txt", "full", "t"] and left_in(tmp_path / "full") == ["notes.txt"]


def test_a_damaged_prepared_folder_is_refused(tmp_path, tokenizer_file):
    (tmp_path / "a.txt").write_text(TEXT_A * 20)
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "good"), tokenizer=str(tokenizer_file))
    raw = (tmp_path / "good" / TOKENS).read_bytes()
    manifest = json.loads((tmp_path / "good" / MANIFEST).read_text())

    def damaged(name: str, tokens: bytes, **fields) -> str:
        d = tmp_path / name
        d.mkdir()
        for f in ("tokenizer.json", DOCUMENTS):
            (d / f).write_bytes((tmp_path / "good" / f).read_bytes())
        (d / TOKENS).write_bytes(tokens)
        (d / MANIFEST).write_text(json.dumps({**manifest, **fields}))
        return str(d)

    flipped = bytearray(raw)
    flipped[4] ^= 1  # the same size, another id
    refused(
        streamdiloco("data", "check", damaged("flipped", bytes(flipped))), "does not match the manifest's"
    )
    refused(streamdiloco("data", "check", damaged("short", raw[:-2])), "truncated")
    refused(
        streamdiloco("data", "check", damaged("v9", raw, format="streamdiloco-tokens/9")),
        "unknown format 'streamdiloco-tokens/9'",
    )
    past = np.frombuffer(raw, "<u2").copy()
    past[1] = manifest["vocab_size"]  # an id past the vocabulary, with a hash that matches it
    d = damaged("past", past.tobytes(), sha256=hashlib.sha256(past.tobytes()).hexdigest())
    refused(streamdiloco("data", "check", d), f"past vocab_size {manifest['vocab_size']}")
    refused(streamdiloco("data", "check", str(tmp_path / "a.txt")), "no such folder")
    assert os.listdir(tmp_path / "good") and PreparedData.open(tmp_path / "good", verify=True)


def test_without_tokenizers_the_command_says_how_to_install_it(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT_A)
    code = (
        "import sys; sys.modules['tokenizers'] = None\n"  # an import of it fails, as if not installed
        "from streamdiloco.cli import main\n"
        f"sys.exit(main(['data', 'prepare', {str(tmp_path / 'a.txt')!r}, '--out', {str(tmp_path / 'o')!r}, "
        "'--train-tokenizer', '300']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    refused(r, "pip install 'streamdiloco[data]'")
    assert left_in(tmp_path) == ["a.txt"]


def test_the_progress_line():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stats = Stats(documents=3, tokens=1234, bytes=2_000_000)
    line = "preparing: 3 documents, 1,234 tokens, 2.0 MB read ("
    for stream, starts, ends in ((Terminal(), "\r\x1b[K", ")\n"), (io.StringIO(), "", ")\n")):
        bar = Progress(stream, stats)
        bar.tick("preparing")  # not yet: once every 0.5 s on a terminal, 10 s else
        assert stream.getvalue() == ""
        bar.tick("preparing", force=True)
        bar.close()
        text = stream.getvalue()
        assert text.startswith(starts + line) and text.endswith(ends) and text.count("\n") == 1, text
