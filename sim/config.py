"""A simulation's config: the run's settings sections (common/config.py) and the simulation's own fields,
checked with one-line errors.

Torch-free (the command line checks a simulation's flags before it imports torch); sim/simulator.py runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamdiloco.common.config import InnerConfig, ModelSettings, RunSettings, SyncConfig
from streamdiloco.common.pace import valid_step_seconds
from streamdiloco.server.rounds.robust import RobustConfig

METHODS = ("streaming", "dp")


@dataclass(frozen=True)
class SimConfig:
    """One simulation: the run's settings sections (common/config.py, as the workers' and shards') and the
    simulation's own fields."""

    method: str = "streaming"  # streaming (Streaming DiLoCo; P=1, tau=0 is DiLoCo) | dp (data-parallel)
    workers: int = 2  # M
    num_shards: int = 1  # S: each fragment is cut into S slices, as the sharded server does
    eval_every: int = 100  # steps between evaluations of the global parameters
    # emulated seconds per inner step of each worker (sites of unequal speed); empty: all alike (1.0)
    step_seconds: tuple[float, ...] = ()
    model: ModelSettings = field(default_factory=ModelSettings)
    run: RunSettings = field(default_factory=RunSettings)
    sync: SyncConfig = field(default_factory=SyncConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)  # the shards' defenses, on as on a shard

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}: choose {' or '.join(METHODS)}")
        for name in ("workers", "num_shards", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.model.blocks_path or self.model.fragments:
            raise ValueError(
                "--blocks-path and --fragments are for shards and workers: the simulator splits the model's "
                "largest nn.ModuleList of blocks"
            )
        if self.step_seconds and len(self.step_seconds) != self.workers:
            raise ValueError(
                f"--step-seconds gives {len(self.step_seconds)} step times for {self.workers} workers: "
                "one each"
            )
        if not all(valid_step_seconds(t) for t in self.step_seconds):
            raise ValueError(f"--step-seconds must be in (0, 3600] seconds each, got {self.step_seconds}")
        self.robust.check_codec(self.sync.uplink_codec)  # as a shard would: trimmed + top-k is refused
