"""What every test file may use without importing it: the nano model, the standard in-thread shard
(`shard`, `make_shard`: tests/support/nano_shard.py) and the pool that shuts down whatever shards a test
started (`shards`); the order in which pytest-xdist hands the files out (the longest first); and the rule
that `pytest.importorskip` of a `[dev]` dependency fails rather than skips (tests/support/devdeps.py).

The tests' tools live in tests/support/ (imported as `tests.support.NAME`); a fixture that two test files
need is defined here, once, never copied between them nor imported from another test file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import pytest
import torch

from streamdiloco.worker.model import build_gpt
from tests.support.devdeps import strict_importorskip

if TYPE_CHECKING:  # the shards' modules import the server: only the files that start one pay for it
    from tests.support.inthread import InThreadShard

# a test of a [dev] dependency fails when the dependency does not import (make test installs them all)
if not hasattr(pytest.importorskip, "__wrapped__"):
    pytest.importorskip = strict_importorskip(pytest.importorskip)

AnyShard = TypeVar("AnyShard", bound="InThreadShard")


class StartedShards:
    """The in-thread shards a test started (the `shards` fixture): each is shut down after the test."""

    def __init__(self) -> None:
        self.started: list[InThreadShard] = []

    def add(self, shard: AnyShard) -> AnyShard:
        self.started.append(shard)
        return shard

    def shutdown(self) -> None:
        for s in self.started:
            s.shutdown()


@pytest.fixture
def nano_model():
    torch.manual_seed(0)
    return build_gpt("nano")


@pytest.fixture
def shards() -> Iterator[StartedShards]:
    """The in-thread shards a test starts (`shards.add(shard)`), each shut down after the test."""
    started = StartedShards()
    yield started
    started.shutdown()


@pytest.fixture
def make_shard(tmp_path, shards) -> Callable:
    """`make_shard(**options)` starts the standard nano shard (tests/support/nano_shard.py's NanoShard:
    token, min_workers (2), round_timeout, checkpoint_dir, port); each is shut down after the test. A file
    whose shards are built otherwise (limits, another model) defines its own `make_shard` over `shards`."""
    from tests.support.nano_shard import NanoShard

    return lambda **kw: shards.add(NanoShard(tmp_path, **kw))


@pytest.fixture
def shard(make_shard):
    """The standard nano shard with its defaults (2 workers make a round), serving for one test."""
    return make_shard()


# The files whose tests start real processes, the longest first (measured with --durations=0). With
# `-n 2 --dist loadfile`, xdist hands out files in collection order: these go first, so that the run does
# not end with one process on a long file while the other has nothing left.
LONG_FIRST = (
    "test_quickstart.py",
    "test_slow_link.py",  # a minute, mostly waiting on a 1 Mbit/s link: beside the CPU-bound ones
    "test_hf_trainer.py",
    "test_cli.py",
    "test_export.py",
    "test_edges.py",
    "test_e2e.py",
    "test_faults.py",
    "test_noinit.py",
    "test_settings.py",
    "test_monitoring.py",
    "test_tls.py",
    "test_fuzz.py",
    "test_dashboard.py",
    "test_packaging.py",
    "test_hf_model.py",
    "test_logs.py",
    "test_data_prepare.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
