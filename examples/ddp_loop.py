"""Your own loop, as one worker made of several ranks: DDP inside the site, Streaming DiLoCo between sites.

The model is examples/own_loop.py's. Start a shard that builds it, then one worker of 2 ranks (from the
repository root, so that `examples.own_loop` imports):

    streamdiloco server --model examples.own_loop:build --sync-every 12 --num-fragments 3 --port 7070
    torchrun --nproc-per-node 2 -m examples.ddp_loop --servers 127.0.0.1:7070

Every rank runs this file. Rank 0 joins the shards and syncs for the group; after each merge it broadcasts
the merged fragment, so every rank's parameters stay rank 0's (streamdiloco/worker/group.py). On GPUs: the
"nccl" backend, each rank on cuda:LOCAL_RANK, the model moved there before DDP wraps it.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from examples.own_loop import build
from streamdiloco.common.config import SyncConfig
from streamdiloco.worker.group import batch_slice, connect_group


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="127.0.0.1:7070", help="every shard as HOST:PORT, comma-separated")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--name", default="ddp-site", help="the worker's name (one for all its ranks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="rows per rank per step")
    args = p.parse_args()

    dist.init_process_group("gloo")  # torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(build())
    sync = SyncConfig(sync_every=12, num_fragments=3)  # the same H and P as the shard's flags
    # on every rank: rank 0 joins, and every rank gets rank 0's parameters (the run's global ones)
    engine = connect_group(model, args.servers, sync, total_steps=args.steps, name=args.name, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(args.seed)  # the same stream on every rank: each takes its slice
    try:
        # count the schedule's steps, not your own: under the shards' `--sync-schedule adaptive` a fast site
        # does several inner steps per schedule step, and the run ends at the schedule's last (its final sync)
        while engine.step_count < args.steps:
            step = engine.step_count
            x = torch.rand(args.batch_size * engine.size, 1, generator=gen) * 4 - 2
            x = batch_slice(x, engine.group)  # this rank's rows of the worker's batch
            loss = nn.functional.mse_loss(model(x), torch.sin(3 * x) * x)
            loss.backward()  # DDP averages the gradients over the ranks
            opt.step()
            opt.zero_grad()
            engine.step(tokens=x.shape[0], loss=loss.item())  # on every rank, after the optimizer step
            if engine.engine is not None and (step % 50 == 0 or step + 1 == args.steps):
                print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    finally:
        engine.close()
    if engine.engine is not None:  # rank 0: the group's sync engine
        e = engine.engine
        print(f"done: sent {e.bytes_sent:,} B in {e.pushes} pushes; broadcast {engine.broadcast_bytes:,} B")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
