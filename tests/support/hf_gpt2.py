"""A tiny random-init HuggingFace GPT-2 for the export tests, as the worker CLI trains a model:
`forward(idx, targets) -> (logits, loss)` on bytes (vocabulary 256). A subclass of GPT2LMHeadModel, so that
its parameters keep GPT-2's names and `save_pretrained` / `GPT2LMHeadModel.from_pretrained` work as for
the plain model. Used as `--model tests.support.hf_gpt2:tiny_gpt2` from the repository's root. And
`tiny_config`: the config of a tiny GPT-2 that the tests write as a `--model hf:PATH` folder's config.json."""

from __future__ import annotations

import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel


def tiny_config(vocab: int = 256, positions: int = 32) -> dict:
    """A GPT-2 of 2 layers of width 32 over `vocab` token ids and `positions` positions, without dropout (its
    steps are deterministic), its BOS and EOS id 0."""
    return {
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": positions,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 2,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }


class ByteGPT2(GPT2LMHeadModel):
    def forward(self, idx, targets=None):  # type: ignore[override]
        logits = super().forward(input_ids=idx).logits
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def tiny_gpt2() -> ByteGPT2:
    config = GPT2Config(
        vocab_size=256,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        block_size=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return ByteGPT2(config)
