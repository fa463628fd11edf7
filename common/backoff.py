"""Exponential backoff with jitter: how long a worker waits before it tries again what the network broke (a
session: worker/connection.py's reconnect; a Fetch: common/fetch.py). Each wait is the current delay times a
random 0.5..1, so that the workers a shard's restart cut off do not all come back at once; the delay then
doubles, up to `most`. Pure: `rand` is passed in for tests.
"""

from __future__ import annotations

import random
from collections.abc import Callable

FIRST = 0.5  # seconds before the first retry, at most
MOST = 8.0  # seconds between retries, at most


class Backoff:
    """The waits between the tries of one thing (see the module's docstring)."""

    def __init__(
        self, first: float = FIRST, most: float = MOST, rand: Callable[[float, float], float] = random.uniform
    ):
        if not 0 < first <= most:
            raise ValueError(f"backoff: need 0 < first <= most, got {first} and {most}")
        self.first, self.most, self._rand = first, most, rand
        self.delay = first

    def next(self) -> float:
        """The wait before the next try; the one after it doubles (up to `most`)."""
        wait = self.delay * self._rand(0.5, 1.0)
        self.delay = min(self.delay * 2, self.most)
        return wait

    def reset(self) -> None:
        """Something went through: the next failure waits briefly again."""
        self.delay = self.first
