"""The benchmarks' data-parallel baseline (benchmarks/wan/ and benchmarks/real.py start it): one rank of DDP
over gloo.

It trains what `streamdiloco worker --rank R` trains, with the same pieces (worker/train.py, worker/data.py):
the model from `build_model(model, seed, block_size)`, the data from `load_tokens` (a text file or a
prepared folder), the data stream `BatchStream(train, batch, block, seed, rank)` or, with `--piece-tokens`,
a `PieceStream` over the run-wide pieces dealt round-robin (rank r of W trains pieces r, r+W, r+2W, ... in
order: the pieces and windows a ledger hands out, without a shard), AdamW from `make_inner_optimizer`,
`lr_at`'s warm-up and cosine, `forward_backward` and `optimizer_step` (gradient clip); DDP averages the
gradients of the ranks (its default buckets) inside the backward pass. At the end it scores the model on the
same validation batches as worker/run.py; rank 0 writes it with `save_pretrained` to `--save-hf DIR`.

`--no-comm` runs the same loop without a process group or DDP: the reference step time of compute
utilization. The WAN benchmark starts one per worker namespace at once, so both compete for the CPU as in a
real run; `--ready-file` and `--go-file` line up their starts.

The summary JSON (`--summary`) is rewritten after every step that ends a second or more after the last
write (and at the start of training), so a run stopped at its time bound still tells how far it got:
steps done, `train_start_unix`, per-step seconds; at the end also `eval_loss` and `finished: true`.
It must not print per step (its output is a log file) and never touches the network beyond gloo.

    python -m benchmarks.wan_ddp --rank 0 --world-size 2 --master 10.213.77.11:29500 --iface wan0 \\
        --steps 300 --summary ddp-0.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from streamdiloco.common.atomic import atomic_write_text
from streamdiloco.common.modelspec import build_model, check_vocab, model_block_size
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.worker.data import BatchStream, eval_batches, load_tokens
from streamdiloco.worker.pieces import PieceStream
from streamdiloco.worker.train import (
    InnerConfig,
    evaluate,
    forward_backward,
    lr_at,
    make_inner_optimizer,
    optimizer_step,
    set_lr,
)


class DealtPieces:
    """The pieces of a prepared train split dealt round-robin: rank r of W holds r, r+W, r+2W, ... in
    order, epoch after epoch (a PieceSource for PieceStream, in place of shard 0's ledger: no leases)."""

    def __init__(self, rank: int, world: int, train_tokens: int, piece_tokens: int):
        self.piece_tokens, self.train_tokens = piece_tokens, train_tokens
        self.total = -(-train_tokens // piece_tokens)
        self.next, self.world, self.done = rank, world, 0

    def ask(self, done: list[int], held: list[int], want: int) -> pb.PiecesReply:
        self.done += len(done)
        held = [p for p in held if p not in done]
        while len(held) < want:
            held.append(self.next % self.total)
            self.next += self.world
        ranges = [
            pb.PieceRange(
                id=p, start=p * self.piece_tokens, end=min(self.train_tokens, (p + 1) * self.piece_tokens)
            )
            for p in held
        ]
        return pb.PiecesReply(
            held=ranges,
            epoch=self.next // self.total,
            pieces_done=self.done % self.total,
            pieces_total=self.total,
            piece_tokens=self.piece_tokens,
        )


def iface_bytes(iface: str | None) -> dict | None:
    """The interface's byte counters in this network namespace (None without --iface)."""
    if not iface:
        return None
    base = Path("/sys/class/net") / iface / "statistics"
    return {k: int((base / f"{k}_bytes").read_text()) for k in ("tx", "rx")}


def write_json(path: Path, data: dict) -> None:
    """Atomically: a reader (or a kill) never sees half a file."""
    atomic_write_text(path, json.dumps(data, indent=2))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("ranks")
    g.add_argument("--rank", type=int, required=True, help="this rank; also seeds its data stream")
    g.add_argument("--world-size", type=int, default=2, help="ranks in all (default %(default)s)")
    g.add_argument("--master", default=None, help="HOST:PORT of rank 0's rendezvous (gloo's tcp:// store)")
    g.add_argument(
        "--iface",
        default=None,
        help="the network interface gloo uses (GLOO_SOCKET_IFNAME); its byte counters go in the summary",
    )
    g.add_argument(
        "--no-comm",
        action="store_true",
        help="no process group, no DDP: the same loop alone, for the reference step time",
    )
    g.add_argument("--ready-file", default=None, help="touch this once set up, then wait for --go-file")
    g.add_argument("--go-file", default=None, help="start training once this file exists")
    g.add_argument("--init-timeout", type=float, default=600.0, help="seconds gloo waits for the other ranks")
    g.add_argument("--summary", required=True, help="write the figures (JSON) here")
    r = p.add_argument_group("run (as streamdiloco worker's flags)")
    r.add_argument("--steps", type=int, default=600, help="inner steps (default %(default)s)")
    r.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step (default 16)")
    r.add_argument("--model", default="tiny", help="built-in preset or module.path:factory (default tiny)")
    r.add_argument("--block-size", type=int, default=None, help="context length (default: the preset's)")
    r.add_argument("--seed", type=int, default=0, help="seed for init and data streams (default 0)")
    r.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="a text file or a prepared folder (default: built-in plays)",
    )
    r.add_argument(
        "--piece-tokens",
        type=int,
        default=0,
        help="train the run-wide pieces of this many tokens in order, dealt round-robin to the ranks "
        "(default 0: random windows, as a worker without --data-pieces)",
    )
    r.add_argument("--save-hf", default=None, metavar="DIR", help="rank 0: save_pretrained the model here")
    r.add_argument("--eval-batches", type=int, default=8, help="validation batches at the end (default 8)")
    # the inner optimizer's flags, one per InnerConfig field, with its default: they cannot drift apart
    i = p.add_argument_group("inner optimizer (AdamW; InnerConfig's fields)")
    for f in dataclasses.fields(InnerConfig):
        i.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    summary_path = Path(a.summary)
    inner = InnerConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(InnerConfig)})
    model = build_model(a.model, a.seed, a.block_size)
    block = model_block_size(model, a.block_size)
    data = load_tokens(a.data, block)
    check_vocab(model, data.vocab_size, a.model, data.what)
    val = eval_batches(data.val, a.batch_size, block, a.eval_batches)
    stream: BatchStream | PieceStream
    if a.piece_tokens:
        stream = PieceStream(data.train, a.batch_size, block, name=f"rank{a.rank}")
        stream.start(DealtPieces(a.rank, a.world_size, len(data.train), a.piece_tokens))
    else:
        stream = BatchStream(data.train, a.batch_size, block, a.seed, a.rank)
    net = model
    if not a.no_comm:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if a.iface:
            os.environ["GLOO_SOCKET_IFNAME"] = a.iface
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{a.master}",
            rank=a.rank,
            world_size=a.world_size,
            timeout=datetime.timedelta(seconds=a.init_timeout),
        )
        net = DistributedDataParallel(model)  # broadcasts rank 0's parameters (equal anyway: same seed)
    opt = make_inner_optimizer(model, inner)
    if a.ready_file:
        Path(a.ready_file).touch()
    while a.go_file and not Path(a.go_file).exists():
        time.sleep(0.01)

    bytes0 = iface_bytes(a.iface)
    step_seconds: list[float] = []
    losses: list[float] = []
    summary = {
        "system": "reference" if a.no_comm else "ddp",
        "rank": a.rank,
        "world_size": 1 if a.no_comm else a.world_size,
        "steps_planned": a.steps,
        "steps": 0,
        "finished": False,
        "threads": torch.get_num_threads(),
        "train_start_unix": time.time(),
        "iface_bytes_at_start": bytes0,  # the counters themselves: the WAN sweep reads them again
    }
    write_json(summary_path, summary)
    last_write = time.monotonic()
    t_train0 = time.perf_counter()
    for step in range(a.steps):
        t0 = time.perf_counter()
        set_lr(opt, lr_at(step, a.steps, inner))
        x, y = stream.next()
        losses.append(forward_backward(net, x, y))  # DDP: the all-reduce runs inside backward
        optimizer_step(model, opt, inner)
        step_seconds.append(time.perf_counter() - t0)
        if time.monotonic() - last_write >= 1.0 or step + 1 == a.steps:
            last_write = time.monotonic()
            summary.update(
                steps=step + 1,
                train_seconds=time.perf_counter() - t_train0,
                step_seconds=step_seconds,
                train_loss_last=statistics.fmean(losses[-10:]),
            )
            write_json(summary_path, summary)
    train_seconds = time.perf_counter() - t_train0
    bytes1 = iface_bytes(a.iface)
    summary.update(
        steps=a.steps,
        train_seconds=train_seconds,
        step_seconds=step_seconds,
        eval_loss=evaluate(model, val),
        train_loss_last=statistics.fmean(losses[-10:]),
        iface_bytes_training=None
        if bytes0 is None or bytes1 is None
        else {k: bytes1[k] - bytes0[k] for k in bytes0},
        finished=True,
    )
    if isinstance(stream, PieceStream):
        stream.finish(timeout=5.0)
        summary["pieces_done"] = stream.summary()["pieces_done"]
    if a.save_hf and a.rank == 0:
        model.save_pretrained(a.save_hf)  # type: ignore[operator]
    write_json(summary_path, summary)
    if not a.no_comm:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
