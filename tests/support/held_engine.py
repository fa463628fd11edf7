"""The sync engine on a toy model with a transport whose updates arrive when the test says: `make` builds
an engine (H = 4, P = 2, fp32 both ways, so that every value is exact), its `HeldTransport` (pushes kept,
each round's update a future the test completes with `deliver`) and its model; `train_step` is an inner
step that adds 0.01 to every parameter. Used by tests/test_merge_policy.py and tests/test_skip_ahead.py;
it must not grow tests of its own nor import a test file.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
import torch.nn as nn

from streamdiloco.common.codecs import encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.worker.engine import SyncEngine

# fragment 1 sends at steps 2, 6, 10, ...; fragment 0 at 4, 8, ... (H = 4, P = 2)
H, P = 4, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(3, 3) for _ in range(2)])
        self.head = nn.Linear(3, 2)


class HeldTransport:
    """Pushes are kept; each round's update is a future that the test completes (fp32: exact)."""

    num_shards, pace_seconds = 1, 0.0

    def __init__(self) -> None:
        self.pushes: dict[tuple[int, int], torch.Tensor] = {}
        self.futures: dict[tuple[int, int], Future] = {}
        self.closed = False
        self.skip: tuple[int, list[int]] | None = None

    def push(self, fragment, round, slices, weight, loss) -> None:
        self.pushes[(fragment, round)] = slices[0]

    def close(self) -> None:
        self.closed = True

    def skip_to(self, next_rounds) -> tuple[int, list[int]] | None:
        """What a test set in `skip`, once (tests/test_skip_ahead.py)."""
        skip, self.skip = self.skip, None
        return skip

    def update(self, fragment: int, round: int) -> Future:
        return self.futures.setdefault((fragment, round), Future())

    def deliver(self, fragment: int, round: int, values: torch.Tensor) -> None:
        self.update(fragment, round).set_result([encode(values, "fp32", 128)])


def make(
    policy: str, tau: int = 1, total: int | None = None, rule: str = "mix"
) -> tuple[SyncEngine, HeldTransport, Net]:
    cfg = SyncConfig(
        merge_rule=rule,
        sync_every=H,
        num_fragments=P,
        fragment_sync_delay=tau,
        uplink_codec="fp32",
        downlink_codec="fp32",
        merge_policy=policy,
        final_sync=total is not None,
    )
    net = Net()
    transport = HeldTransport()
    engine = SyncEngine(net, build_layout(net, P, "strided"), cfg, transport, total_steps=total)
    return engine, transport, net


def params(engine: SyncEngine, fragment: int) -> torch.Tensor:
    return flatten(fragment_params(engine.model, engine.layout.fragments[fragment]))


def train_step(net: Net) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01)
