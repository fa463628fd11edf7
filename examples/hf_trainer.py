"""A `transformers.Trainer` run as one worker of a Streaming DiLoCo run.

The model is any causal LM that transformers builds from a config (a folder as `save_pretrained` writes, or
a config.json); its initial values do not matter: joining the run sets them to the run's global parameters.
Start the shards with the same model, then this script (from the repository root):

    streamdiloco server --model hf:examples/gpt2-10m --sync-every 30 --num-fragments 3 --port 7070
    python examples/hf_trainer.py --servers 127.0.0.1:7070 --model-config examples/gpt2-10m --steps 300

It trains on windows of the built-in text (one byte per token: give the model a vocabulary of at least 256),
in the Trainer's own order; checkpoints go to --out every --save-steps steps with the engine's state, and
`--resume` continues from the latest of them.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

from streamdiloco.worker.checkpoint import mirror_digests
from streamdiloco.worker.data import ByteDataset
from streamdiloco.worker.hf_trainer import StreamingDiLoCoCallback


class Windows(torch.utils.data.Dataset):
    """Consecutive windows of `length` tokens of a 1-D token tensor, as the Trainer's examples (labels =
    inputs: the model shifts them)."""

    def __init__(self, tokens: torch.Tensor, length: int):
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.tokens[i * self.length : (i + 1) * self.length].long()
        return {"input_ids": window, "labels": window}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="127.0.0.1:7070", help="every shard as HOST:PORT, comma-separated")
    p.add_argument("--model-config", required=True, metavar="PATH", help="a config.json or a folder with one")
    p.add_argument("--steps", type=int, default=300, help="the run's steps for this worker")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1, help="the Trainer's gradient_accumulation_steps")
    p.add_argument("--context", type=int, default=64, help="tokens per window")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--out", default="runs/hf-trainer", help="the Trainer's output_dir")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--name", default=None, help="this worker's name (default: host-pid)")
    p.add_argument("--token", default=None, help="the run's token, if its shards check one")
    p.add_argument("--summary", default=None, metavar="PATH", help="write the end's step and mirror hashes")
    args = p.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("streamdiloco").setLevel(logging.INFO)  # joins, resumes, rounds; transformers its own

    config = AutoConfig.from_pretrained(args.model_config, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config)
    data = Windows(ByteDataset.load(None, args.context).train, args.context)
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=min(20, args.steps // 10),
        logging_steps=10,
        save_steps=args.save_steps,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )
    callback = StreamingDiLoCoCallback(  # every Streaming DiLoCo setting (H, P, codecs, ...) from the shards
        args.servers,
        total_steps=args.steps,
        tokens_per_step=args.batch_size * args.grad_accum * args.context,
        name=args.name,
        token=args.token,
    )
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=args.resume or None)
    engine = callback.engine
    assert engine is not None
    print(
        f"done: step {engine.step_count} of {args.steps}, sent {engine.bytes_sent:,} B, "
        f"received {engine.bytes_received:,} B in {engine.pushes} pushes; checkpoints in {args.out}"
    )
    if (
        args.summary
    ):  # what the worker CLI's --summary says of the sync (the tests compare it with the shards)
        summary = {
            "step": engine.step_count,
            "pushes": engine.pushes,
            "mirror_hashes": mirror_digests(engine),
        }
        Path(args.summary).write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
