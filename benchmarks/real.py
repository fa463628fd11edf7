"""`make bench-real`: the 10M-parameter GPT-2 of examples/gpt2-10m trained through the product on a corpus
that is not the built-in text, against data-parallel training on the same tokens.

1. The corpus: Debian's `fortunes` quotations (every cookie of /usr/share/games/fortunes one document) and
   the built-in plays cut into documents of about 2,000 characters, shuffled together (seeded) into one
   JSON Lines file, so that the training pieces and the validation split (the last documents) hold both.
2. `streamdiloco data prepare` with a byte-level BPE trained on it (`--train-tokenizer`).
3. Streaming DiLoCo through the CLI: one shard process and two worker processes (`--model hf:DIR --data
   PREPARED --data-pieces`), one torch thread each; then `streamdiloco export --hf-out`.
4. Data-parallel: two ranks of DDP over gloo on loopback (benchmarks/wan_ddp.py), the same model, seed,
   inner optimizer, batch per rank and steps, training the same run-wide pieces in the same order (dealt
   round-robin, rank r the pieces r, r+2, ...); rank 0 saves its model with save_pretrained.
5. Both models loaded with `AutoModelForCausalLM.from_pretrained` and scored here on the same validation
   windows; each generates a sample from the same prompt and seed with the prepared tokenizer.

The table: eval loss, tokens trained, tokens/s (both workers together), bytes each worker sent and received
(the workers' own counts; DDP's are the ring all-reduce's 2(W-1)/W of the fp32 gradients per rank per step,
computed: gloo's loopback traffic cannot be told apart here) and their ratio, and the pieces: how many were
reported done by the workers, how many exactly once (it must be all), and whether shard 0's ledger counts
the same. The two runs go one after the other on the same CPUs, so tokens/s compare; on a 2-core machine the
shard shares them with the workers.

    python -m benchmarks.real                      # the defaults below: about 20 minutes on 2 cores
    python -m benchmarks.real --steps 30 --model-dir DIR --vocab 512   # a quick look with a smaller model
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness import (
    RESULTS,
    Procs,
    Run,
    Session,
    bench,
    fortune_files,
    free_port,
    http_json,
    loadavg,
    say,
    sd,
    start_shards,
)

PROMPT = "The "


def fortunes() -> list[str]:
    """Every cookie of Debian's fortune files (the text between lines of a single %)."""
    cookies: list[str] = []
    for path in fortune_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        cookies += [c.strip() for c in re.split(r"^%$", text, flags=re.M) if c.strip()]
    return cookies


def write_corpus(folder: Path, seed: int) -> dict:
    """The benchmark's corpus as one JSON Lines file in `folder`; its counts."""
    from streamdiloco.worker.text import load_text

    cookies = fortunes()
    plays = load_text(None).decode("utf-8", errors="replace")
    acts = [plays[i : i + 2000] for i in range(0, len(plays), 2000)]
    docs = cookies + acts
    random.Random(seed).shuffle(docs)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "corpus.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    chars = sum(len(d) for d in docs)
    return {"fortunes": len(cookies), "play_parts": len(acts), "documents": len(docs), "characters": chars}


def training_flags(a: argparse.Namespace, spec: str) -> list[str]:
    """What both systems train with: model, batch per worker, context, steps, seed, inner optimizer."""
    return [
        *("--model", spec, "--steps", str(a.steps), "--batch-size", str(a.batch_size)),
        *("--block-size", str(a.block_size), "--seed", "0", "--warmup-steps", str(a.warmup_steps)),
    ]


def streaming(procs: Procs, tmp: Path, a: argparse.Namespace, spec: str, data: Path) -> dict:
    """One shard and two workers through the CLI, then export --hf-out; the workers' summaries, the
    ledger's status and the pieces the workers' logs report done."""
    # the fixed schedule: every worker trains --steps inner steps of its batch, the tokens DDP trains
    # (adaptive, the default, gives a faster worker more inner steps per schedule step)
    sync = ["--sync-every", str(a.sync_every), "--num-fragments", str(a.fragments)]
    sync += ["--sync-schedule", "fixed"]
    flags = ["--model", spec, *sync, "--min-workers", "2", "--piece-tokens", str(a.piece_tokens)]
    (_, _, ports), *_ = start_shards(procs, tmp, "real", 1, flags, checkpoint=False)
    target = f"127.0.0.1:{ports['grpc_port']}"
    run = Run(procs, tmp, "real")
    work = [*training_flags(a, spec), *sync, "--data", str(data), "--data-pieces", "--log-every", "20"]
    t0 = time.perf_counter()
    for m in range(2):
        run.worker(m, target, work, threads=1)
    say(f"streaming: 1 shard, 2 workers training {a.steps} steps each (logs in {tmp})")
    summaries = run.wait_workers(["w0", "w1"], timeout=a.timeout)
    wall = time.perf_counter() - t0
    status = http_json(ports["http_port"])
    hf = tmp / "streaming-hf"
    export = ["export", "--servers", target, "--model", spec, "--out", str(tmp / "streaming.safetensors")]
    p = procs.start("real-export", sd(*export, "--hf-out", str(hf)))
    if p.wait(600) != 0:
        raise RuntimeError(f"export failed:\n{procs.tail('real-export')}")
    run.stop_shards()
    logs = "".join((tmp / f"real-w{m}.log").read_text(errors="replace") for m in range(2))
    done = [(int(e), int(p)) for p, e in re.findall(r"w\d: piece (\d+) of epoch (\d+) done", logs)]
    return {"summaries": summaries, "status": status, "hf": hf, "done": done, "wall": wall}


def data_parallel(procs: Procs, tmp: Path, a: argparse.Namespace, spec: str, data: Path) -> dict:
    """Two DDP ranks over gloo on loopback (benchmarks/wan_ddp.py) on the same pieces; their summaries."""
    master = f"127.0.0.1:{free_port()}"
    hf = tmp / "ddp-hf"
    ps = []
    t0 = time.perf_counter()
    for r in range(2):
        argv = ["--rank", str(r), "--world-size", "2", "--master", master, "--data", str(data)]
        argv += [*training_flags(a, spec), "--piece-tokens", str(a.piece_tokens)]
        argv += ["--summary", str(tmp / f"ddp-{r}.json"), "--save-hf", str(hf)]
        ps.append(procs.start(f"ddp-{r}", bench("wan_ddp", *argv), env_extra={"OMP_NUM_THREADS": "1"}))
    say(f"data-parallel: 2 DDP ranks (gloo, loopback) training {a.steps} steps each")
    for r, p in enumerate(ps):
        if p.wait(a.timeout) != 0:
            raise RuntimeError(f"ddp rank {r} failed:\n{procs.tail(f'ddp-{r}')}")
    wall = time.perf_counter() - t0
    summaries = [json.loads((tmp / f"ddp-{r}.json").read_text()) for r in range(2)]
    return {"summaries": summaries, "hf": hf, "wall": wall}


def score(hf: Path, data: Path, a: argparse.Namespace) -> dict:
    """The model saved in `hf`, loaded as anyone loads it: its mean loss on the validation windows, and a
    sample from PROMPT (seeded) decoded with the prepared tokenizer."""
    import tokenizers
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from streamdiloco.worker.data import eval_batches, load_tokens

    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    val = eval_batches(load_tokens(str(data), a.block_size).val, 8, a.block_size, a.eval_batches)
    with torch.no_grad():
        losses = [
            float(F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())) for x, y in val
        ]
    tok = tokenizers.Tokenizer.from_file(str(data / "tokenizer.json"))
    torch.manual_seed(0)
    prompt = torch.tensor([tok.encode(PROMPT).ids])
    out = model.generate(prompt, max_new_tokens=48, do_sample=True, top_k=40, temperature=0.8, pad_token_id=0)
    return {"eval_loss": statistics.fmean(losses), "sample": tok.decode(out[0].tolist())}


def ddp_bytes(params: int, steps: int, world: int) -> int:
    """What one DDP rank sends (and receives) in a ring all-reduce of fp32 gradients over `steps` steps."""
    return int(2 * (world - 1) / world * 4 * params * steps)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model-dir", default="examples/gpt2-10m", help="the hf: model folder (default %(default)s)"
    )
    p.add_argument("--vocab", type=int, default=8192, help="the BPE's vocabulary (default %(default)s)")
    p.add_argument("--steps", type=int, default=240, help="inner steps per worker (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per worker per step (default 8)")
    p.add_argument("--block-size", type=int, default=128, help="context length (default %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=24, help="inner lr warm-up (default %(default)s)")
    p.add_argument("--sync-every", type=int, default=30, help="H (default %(default)s)")
    p.add_argument("--fragments", type=int, default=5, help="P (default %(default)s)")
    p.add_argument("--piece-tokens", type=int, default=8192, help="tokens per piece (default %(default)s)")
    p.add_argument("--eval-batches", type=int, default=16, help="validation batches of 8 (default 16)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds each run may take (default 3600)")
    p.add_argument("--out", default=str(RESULTS / "real"), help="results folder (default %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    model_dir = Path(a.model_dir).resolve()
    spec = f"hf:{model_dir}"
    from streamdiloco.common.modelspec import build_model

    params = sum(t.numel() for t in build_model(spec).parameters())
    try:
        fortune_files()  # the corpus is there, before anything starts
    except ValueError as e:
        raise SystemExit(str(e)) from None
    md: list[str] = []
    with Session("real", argv, Path(a.out)) as session:
        procs, tmp = session.procs, session.tmp
        corpus = write_corpus(tmp / "corpus", seed=0)
        say(f"corpus: {corpus['fortunes']:,} fortunes and {corpus['play_parts']:,} parts of the plays")
        data = tmp / "prepared"
        prep = ["data", "prepare", str(tmp / "corpus"), "--out", str(data), "--val-fraction", "0.03"]
        prep += ["--train-tokenizer", str(a.vocab), "--block-size", str(a.block_size)]
        p = procs.start("prepare", sd(*prep))
        if p.wait(1800) != 0:
            raise RuntimeError(f"data prepare failed:\n{procs.tail('prepare')}")
        manifest = json.loads((data / "manifest.json").read_text())
        say(f"prepared: {manifest['tokens']:,} tokens ({manifest['train_tokens']:,} to train)")
        s = streaming(procs, tmp, a, spec, data)
        d = data_parallel(procs, tmp, a, spec, data)
        s_score, d_score = score(s["hf"], data, a), score(d["hf"], data, a)
        session.results.update(summarize(a, params, corpus, manifest, s, d, s_score, d_score))
        session.results["load"] = loadavg()
        md = table(session.results)
    return session.finish(md)


def summarize(
    a: argparse.Namespace,
    params: int,
    corpus: dict,
    manifest: dict,
    s: dict,
    d: dict,
    s_score: dict,
    d_score: dict,
) -> dict:
    """The results: both systems' figures side by side."""
    ws, ds = s["summaries"], d["summaries"]
    tokens = a.steps * a.batch_size * a.block_size * 2
    done = s["done"]
    once = sum(1 for x in set(done) if done.count(x) == 1)
    ledger = s["status"]["data"]
    ddp_pieces = sorted(p for r in ds for _, p in r.get("pieces_done", []))
    s_pieces = sorted(p for _, p in done)
    return {
        "params": params,
        "corpus": corpus,
        "prepared": {k: manifest[k] for k in ("tokens", "train_tokens", "documents", "vocab_size")},
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "streaming": {
            "eval_loss": s_score["eval_loss"],
            "tokens": sum(w["tokens"] for w in ws),
            "tokens_per_second": sum(w["tokens"] for w in ws) / max(w["train_seconds"] for w in ws),
            "bytes_sent_per_worker": statistics.fmean(w["bytes_sent"] for w in ws),
            "bytes_received_per_worker": statistics.fmean(w["bytes_received"] for w in ws),
            "compute_utilization": [w["compute_utilization"] for w in ws],
            "mirrors_equal": all(w["mirror_hashes"] == ws[0]["mirror_hashes"] for w in ws),
            "pieces_reported_done": len(done),
            "pieces_done_exactly_once": once,
            "ledger": ledger,
            "ledger_agrees": ledger["pieces_done"] + ledger["pieces_total"] * ledger["epoch"] == len(done),
            "pieces": s_pieces,
            "sample": s_score["sample"],
            "wall_seconds": s["wall"],
        },
        "ddp": {
            "eval_loss": d_score["eval_loss"],
            "tokens": tokens,
            "tokens_per_second": tokens / max(r["train_seconds"] for r in ds),
            "bytes_sent_per_worker": ddp_bytes(params, a.steps, 2),
            "pieces": ddp_pieces,
            "sample": d_score["sample"],
            "wall_seconds": d["wall"],
        },
    }


def table(r: dict) -> list[str]:
    """The results as markdown: the table, the ratios, the ledger's check and the two samples."""
    s, d = r["streaming"], r["ddp"]
    mb = 1e6
    sent = s["bytes_sent_per_worker"] + s["bytes_received_per_worker"]
    ddp_sent = 2 * d["bytes_sent_per_worker"]
    lines = [
        f"GPT-2 of {r['params']:,} parameters, {r['prepared']['tokens']:,} tokens of fortunes and plays "
        f"(vocabulary {r['prepared']['vocab_size']:,}); 2 workers x {r['settings']['steps']} steps x "
        f"{r['settings']['batch_size']} x {r['settings']['block_size']} tokens",
        "",
        "| system | eval loss | tokens | tokens/s | MB sent+received per worker | pieces done (once) |",
        "|---|---|---|---|---|---|",
        f"| Streaming DiLoCo (1 shard, 2 workers, H={r['settings']['sync_every']}, "
        f"P={r['settings']['fragments']}) | {s['eval_loss']:.4f} | {s['tokens']:,} | "
        f"{s['tokens_per_second']:,.0f} | {sent / mb:,.1f} | {s['pieces_reported_done']} "
        f"({s['pieces_done_exactly_once']}) |",
        f"| data-parallel (DDP, 2 ranks) | {d['eval_loss']:.4f} | {d['tokens']:,} | "
        f"{d['tokens_per_second']:,.0f} | {ddp_sent / mb:,.1f} (computed) | {len(d['pieces'])} |",
        "",
        f"eval loss ratio (streaming / DDP): {s['eval_loss'] / d['eval_loss']:.3f}; tokens/s ratio: "
        f"{s['tokens_per_second'] / d['tokens_per_second']:.2f}; traffic: DDP / streaming = "
        f"{ddp_sent / max(1, sent):,.0f}x",
        f"ledger: {s['ledger']['pieces_done']} of {s['ledger']['pieces_total']} pieces done in epoch "
        f"{s['ledger']['epoch']} (agrees with the workers' reports: {s['ledger_agrees']}); pieces done by "
        f"both systems: {len(set(s['pieces']) & set(d['pieces']))} (the rest differ at the edge: a worker "
        f"holds one piece ahead); mirrors equal: {s['mirrors_equal']}",
        "",
        f"streaming sample: {s['sample']!r}",
        f"DDP sample:       {d['sample']!r}",
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
