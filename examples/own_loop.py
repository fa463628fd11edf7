"""Streaming DiLoCo around your own model and training loop.

The model here is a small residual MLP that learns y = sin(3x) * x; any nn.Module with an nn.ModuleList of
blocks works the same way. Start a shard that builds the same model, then one or more workers:

    streamdiloco server --model examples.own_loop:build --sync-every 12 --num-fragments 3 --port 7070
    python examples/own_loop.py --servers 127.0.0.1:7070

(run both from the repository root, so that `examples.own_loop` imports; with several workers, give the
shard `--min-workers N` so that no round closes before all of them have joined.)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

from streamdiloco.common.config import SyncConfig
from streamdiloco.worker.join import connect


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class ResidualMLP(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4):
        super().__init__()
        self.inp = nn.Linear(1, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))  # what fragments are cut from
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def build() -> nn.Module:
    """The factory that shards and workers share (`--model examples.own_loop:build`)."""
    return ResidualMLP()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="127.0.0.1:7070", help="every shard as HOST:PORT, comma-separated")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--name", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    model = build()
    sync = SyncConfig(sync_every=12, num_fragments=3)  # the same H and P as the shard's flags
    # Join every shard, set the model to the run's global parameters, get the engine back
    engine = connect(model, args.servers, sync, total_steps=args.steps, name=args.name, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(args.seed)
    try:
        # count the schedule's steps, not your own: under the shards' `--sync-schedule adaptive` a fast site
        # does several inner steps per schedule step, and the run ends at the schedule's last (its final sync)
        while engine.step_count < args.steps:
            step = engine.step_count
            x = torch.rand(64, 1, generator=gen) * 4 - 2
            loss = nn.functional.mse_loss(model(x), torch.sin(3 * x) * x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            engine.step(tokens=x.shape[0], loss=loss.item())  # the hook: right after the optimizer step
            if step % 50 == 0 or step + 1 == args.steps:
                print(
                    f"step {step:4d}  loss {loss.item():.4f}  blocked {engine.blocked_seconds:.2f}s",
                    flush=True,
                )
    finally:
        engine.close()
    print(
        f"done: sent {engine.bytes_sent:,} B, received {engine.bytes_received:,} B in {engine.pushes} pushes"
    )


if __name__ == "__main__":
    main()
