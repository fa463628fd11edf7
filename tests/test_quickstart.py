"""The README's quick start, as a new user runs it (small sizes): prepare a corpus with a tokenizer trained on
it, start one shard and two workers of a Hugging Face model (`--model hf:DIR`) on the prepared data with
run-wide pieces, kill one worker mid-run and start it again, export with `--hf-out` and the prepared
tokenizer (`--tokenizer`), load both with `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` and
generate text. Every piece of the epoch is trained exactly once (the shard's ledger and the workers' logs
agree), and both mirrors equal the masters."""

from __future__ import annotations

import json
import re
import signal

import pytest

from tests.support.procs import Cluster, http_json, streamdiloco, wait_until

transformers = pytest.importorskip("transformers", reason="transformers is not installed here")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed here")

VOCAB = 384
SYNC = ["--sync-every", "6", "--num-fragments", "3"]


def corpus(folder):
    """Documents cut from the built-in plays: text files in a folder tree and a JSON Lines file."""
    from streamdiloco.worker.text import load_text

    text = load_text(None).decode("utf-8", errors="ignore")[:120_000]
    parts = [text[i : i + 4000] for i in range(0, len(text), 4000)]
    (folder / "acts").mkdir(parents=True)
    for i, part in enumerate(parts[:20]):
        (folder / "acts" / f"{i:02d}.txt").write_text(part)
    with open(folder / "more.jsonl", "w") as f:
        for part in parts[20:]:
            f.write(json.dumps({"text": part}) + "\n")
    return folder


def test_a_new_user_prepares_trains_an_hf_model_run_wide_kills_a_worker_exports_and_generates(tmp_path):
    src, data, model = corpus(tmp_path / "corpus"), tmp_path / "prepared", tmp_path / "model"
    r = streamdiloco("data", "prepare", str(src), "--out", str(data), "--train-tokenizer", str(VOCAB))
    assert r.returncode == 0, r.stderr[-3000:]
    model.mkdir()
    from tests.support.hf_gpt2 import tiny_config  # after the skips above: it imports transformers

    (model / "config.json").write_text(json.dumps(tiny_config(vocab=VOCAB, positions=64)))
    spec = f"hf:{model}"
    work = [
        *("--model", spec, *SYNC, "--data", str(data), "--data-pieces", "--block-size", "32"),
        *("--steps", "30", "--batch-size", "4", "--log-every", "6", "--checkpoint-every", "6"),
    ]
    with Cluster(tmp_path) as c:
        target, http = c.shard("shard", "--model", spec, *SYNC, "--min-workers", "1", "--piece-tokens", "512")
        c.worker("w0", [target], *work)
        c.worker("w1", [target], *work, "--step-delay", "0.2")
        ckpt = tmp_path / "w1.pt"
        wait_until("w1's first checkpoint", ckpt.exists, timeout=240)
        c.procs["w1"].send_signal(signal.SIGKILL)
        c.procs["w1"].wait()
        c.worker("w1", [target], *work, "--auto-resume")
        for name in ("w0", "w1"):
            assert c.wait(name, timeout=300) == 0, c.log(name)[-3000:]
        status = http_json(http)
        out = ["--out", str(tmp_path / "m.safetensors"), "--hf-out", str(tmp_path / "hf")]
        out += ["--tokenizer", str(data)]
        r = streamdiloco("export", "--servers", target, "--model", spec, *out)
        assert r.returncode == 0, r.stderr[-3000:]
        summaries = [c.summary(n) for n in ("w0", "w1")]
        logs = c.log("w0") + c.log("w1")
    masters = [[f["master_hash"]] for f in status["fragments"]]
    assert all(s["mirror_hashes"] == masters for s in summaries)
    # the ledger: no piece of the epoch trained twice, by the workers' own lines and the shard's count
    done = re.findall(r"(w\d): piece (\d+) of epoch (\d+) done", logs)
    pieces = [(int(e), int(p)) for _, p, e in done]
    assert pieces and len(pieces) == len(set(pieces)), sorted(pieces)
    ledger = status["data"]
    assert ledger["pieces_done"] + ledger["pieces_total"] * ledger["epoch"] == len(pieces)
    assert {w for w, _, _ in done} == {"w0", "w1"}
    # the exported model and the prepared tokenizer beside it, as anyone loads them, generate text
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    prepared = tokenizers.Tokenizer.from_file(str(data / "tokenizer.json"))
    eos_id = json.loads((data / "manifest.json").read_text())["eos_id"]
    assert tok.eos_token_id == tok.bos_token_id == eos_id
    assert tok("KING lear").input_ids == prepared.encode("KING lear").ids  # the tokenizer the data was cut by
    prompt = tok("KING", return_tensors="pt").input_ids
    out = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape[1] > prompt.shape[1]
    assert isinstance(tok.decode(out[0]), str)
