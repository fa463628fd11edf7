"""An Accelerate training loop as one worker of a Streaming DiLoCo run.

The model is a causal LM that transformers builds from a config; joining the run sets its parameters to the
run's global ones. Start the shards with the same model, then this script (from the repository root):

    streamdiloco server --model hf:examples/gpt2-10m --sync-every 30 --num-fragments 3 --port 7070
    python examples/accelerate_loop.py --servers 127.0.0.1:7070 --model-config examples/gpt2-10m --steps 300

`accelerate launch` runs it the same way on one GPU (several processes of one site: see connect_group in
the manual). The engine's hook is called once per optimizer step: after `--grad-accum` micro-batches, when
`accelerator.sync_gradients` says the step was taken.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import AutoConfig, AutoModelForCausalLM

from streamdiloco.worker.checkpoint import mirror_digests
from streamdiloco.worker.data import ByteDataset
from streamdiloco.worker.join import connect


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="127.0.0.1:7070", help="every shard as HOST:PORT, comma-separated")
    p.add_argument("--model-config", required=True, metavar="PATH", help="a config.json or a folder with one")
    p.add_argument("--steps", type=int, default=300, help="the run's steps for this worker")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--context", type=int, default=64, help="tokens per window")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--name", default=None, help="this worker's name (default: host-pid)")
    p.add_argument("--token", default=None, help="the run's token, if its shards check one")
    p.add_argument("--summary", default=None, metavar="PATH", help="write the end's step and mirror hashes")
    args = p.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("streamdiloco").setLevel(logging.INFO)

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(args.model_config, local_files_only=True)
    )
    # join before Accelerate wraps the model: the engine syncs the parameters of the model itself
    engine = connect(model, args.servers, total_steps=args.steps, name=args.name, token=args.token)
    tokens = ByteDataset.load(None, args.context).train
    windows = tokens[: (len(tokens) - 1) // args.context * args.context].long().view(-1, args.context)
    dataset = torch.utils.data.TensorDataset(windows)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    try:
        while engine.step_count < args.steps:
            for (batch,) in loader:
                with accelerator.accumulate(model):
                    loss = model(input_ids=batch, labels=batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                if accelerator.sync_gradients:  # an optimizer step was taken: the hook, once
                    engine.step(tokens=batch.numel() * args.grad_accum, loss=loss.item())
                    if engine.step_count % 20 == 0:
                        accelerator.print(f"step {engine.step_count}  loss {loss.item():.4f}")
                    if engine.step_count >= args.steps:
                        break
    finally:
        engine.close()
    accelerator.print(
        f"done: step {engine.step_count}, sent {engine.bytes_sent:,} B in {engine.pushes} pushes"
    )
    if args.summary:
        hashes = mirror_digests(engine)
        Path(args.summary).write_text(json.dumps({"step": engine.step_count, "mirror_hashes": hashes}))


if __name__ == "__main__":
    main()
