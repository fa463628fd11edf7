"""The run's configuration: one dataclass for the Streaming DiLoCo knobs, validated once, at the edge.

Names follow the paper and torchft: sync_every = H, num_fragments = P, fragment_sync_delay = tau,
fragment_update_alpha = alpha (the weight of the LOCAL parameters in the merge). Every check raises a
ValueError whose one-line message says what to change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

FRAGMENT_PATTERNS = ("strided", "sequential")
MERGE_POLICIES = ("adaptive", "fixed")
MERGE_RULES = ("mix", "rebase")
SYNC_SCHEDULES = ("fixed", "adaptive")
ROUNDING_MODES = ("nearest", "stochastic")
# the codec registry's names (common/codecs.py), for help texts only: the check below asks the registry
_CODEC_NAMES = "fp32, bf16, int8 or e3m0"


@dataclass(frozen=True)
class SyncConfig:
    sync_every: int = field(
        default=30, metadata={"help": "H, inner steps between two syncs of the same fragment"}
    )
    num_fragments: int = field(
        default=5,
        metadata={"help": "P, fragments on the schedule: the blocks fill P-1, the rest of the model 1"},
    )
    fragment_sync_delay: int = field(
        default=1, metadata={"help": "tau, steps between sending a fragment and merging its update"}
    )
    fragment_update_alpha: float = field(
        default=0.5, metadata={"help": "alpha, weight of the local parameters at the merge"}
    )
    # adaptive: a round's update is merged tau steps after its send if it has arrived, else after the first
    # later step by which it has, and training waits only if it is still missing at the fragment's next send
    # (compute keeps going on links slower than one round trip per tau steps). fixed: always at exactly
    # t + tau, waiting for the update if need be (the paper's; deterministic, whatever the link's timing).
    # tau = 0 always waits (blocking DiLoCo)
    merge_policy: str = field(
        default="adaptive",
        metadata={
            "choices": MERGE_POLICIES,
            "help": "adaptive: merge tau steps after the send, or later if the update is not in yet, waiting "
            "only at the fragment's next send (full compute on slow links); fixed: at exactly tau steps, "
            "waiting if need be (deterministic)",
        },
    )
    # rebase: the merge mixes global and local as the local parameters were at the send, and keeps the
    # local steps taken since (local += (1 - alpha) * (global - local_at_send)); mix: the paper's,
    # local = alpha * local + (1 - alpha) * global as they are at the merge, which halves (alpha 0.5) the
    # steps taken between send and merge. Rebase measured better at tau 1 and much better when merges come
    # late (slow links): BENCHMARKS.md
    merge_rule: str = field(
        default="rebase",
        metadata={
            "choices": MERGE_RULES,
            "help": "mix: local = alpha * local + (1 - alpha) * global at the merge (the paper's); rebase: "
            "that mix taken with the parameters as they were at the send, keeping the local steps since",
        },
    )
    fragment_pattern: str = field(
        default="strided",
        metadata={
            "choices": FRAGMENT_PATTERNS,
            "help": "strided: block i goes to fragment i mod P; sequential: consecutive blocks",
        },
    )
    uplink_codec: str = field(
        default="e3m0", metadata={"help": "how workers quantize their outer gradients: " + _CODEC_NAMES}
    )
    downlink_codec: str = field(
        default="e3m0",
        metadata={"help": "how shards quantize the outer update (with error feedback): " + _CODEC_NAMES},
    )
    codec_block_size: int = field(
        default=128, metadata={"help": "values that share one scale in the quantized codecs"}
    )
    uplink_rounding: str = field(
        default="nearest", metadata={"help": "nearest or stochastic (unbiased), for the uplink codec"}
    )
    downlink_rounding: str = field(default="nearest", metadata={"help": "nearest or stochastic"})
    # measured best with momentum 0.95 at H=30 (BENCHMARKS.md; the paper: 0.7 or 0.4)
    outer_lr: float = field(default=1.0, metadata={"help": "outer Nesterov learning rate"})
    outer_momentum: float = field(default=0.95, metadata={"help": "outer momentum"})
    outer_nesterov: bool = field(default=True, metadata={"help": "Nesterov momentum in the outer step"})
    # fixed: every worker does one inner step per step of the schedule (H inner steps per round), so a
    # site twice as fast waits half its time at merges. adaptive: a worker does as many inner steps per
    # schedule step as it is faster than the run's slowest member (common/pace.py), so that every site
    # reaches a fragment's send at about the same wall time; its push carries (and is weighted by) the
    # tokens of all those steps. Off by default: with equal speeds it gains nothing, and fixed is
    # deterministic whatever the timing
    sync_schedule: str = field(
        default="fixed",
        metadata={
            "choices": SYNC_SCHEDULES,
            "help": "fixed: one inner step per schedule step on every worker; adaptive: a faster worker does "
            "more inner steps per schedule step (its speed over the slowest member's), so that no site waits "
            "for a slower one",
        },
    )
    max_steps_per_tick: float = field(
        default=4.0,
        metadata={
            "help": "--sync-schedule adaptive: the most inner steps a worker does per schedule step (how "
            "much faster than the slowest member it may go; also how far the shards' weight caps stretch)",
        },
    )
    final_sync: bool = field(
        default=True,
        metadata={"help": "at the last step, sync every fragment so that the global model has all the work"},
    )

    def __post_init__(self) -> None:
        from streamdiloco.common.codecs import CODECS  # local import: codecs imports nothing from here

        if self.num_fragments < 1:
            raise ValueError(f"num_fragments must be at least 1, got {self.num_fragments}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every (H) must be at least 1, got {self.sync_every}")
        n = self.num_scheduled_fragments
        if self.sync_every != 1 and self.sync_every % n != 0:
            lo = max(n, self.sync_every // n * n)
            raise ValueError(
                f"sync_every (H={self.sync_every}) must be 1 or a multiple of num_fragments (P={n}), so that "
                f"fragments are sent at evenly spaced steps: use H={lo} or H={lo + n}"
            )
        if not 0 <= self.fragment_sync_delay < self.sync_every:
            raise ValueError(
                f"fragment_sync_delay (tau={self.fragment_sync_delay}) must be in [0, H-1] = "
                f"[0, {self.sync_every - 1}]: a fragment's update must be merged before it is sent again"
            )
        if not 0.0 <= self.fragment_update_alpha <= 1.0:
            raise ValueError(
                f"fragment_update_alpha must be in [0, 1] (weight of the local parameters), "
                f"got {self.fragment_update_alpha}"
            )
        if self.merge_policy not in MERGE_POLICIES:
            raise ValueError(
                f"unknown merge_policy {self.merge_policy!r}: choose {' or '.join(MERGE_POLICIES)}"
            )
        if self.merge_rule not in MERGE_RULES:
            raise ValueError(f"unknown merge_rule {self.merge_rule!r}: choose {' or '.join(MERGE_RULES)}")
        if self.sync_schedule not in SYNC_SCHEDULES:
            raise ValueError(
                f"unknown sync_schedule {self.sync_schedule!r}: choose {' or '.join(SYNC_SCHEDULES)}"
            )
        if not 1.0 <= self.max_steps_per_tick <= 64.0:  # NaN fails too
            raise ValueError(
                f"max_steps_per_tick must be in [1, 64] inner steps per schedule step, got "
                f"{self.max_steps_per_tick}"
            )
        if self.fragment_pattern not in FRAGMENT_PATTERNS:
            raise ValueError(
                f"unknown fragment_pattern {self.fragment_pattern!r}: choose {' or '.join(FRAGMENT_PATTERNS)}"
            )
        for name in ("uplink_codec", "downlink_codec"):
            if getattr(self, name) not in CODECS:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}: choose one of {', '.join(CODECS)}")
        for name in ("uplink_rounding", "downlink_rounding"):
            if getattr(self, name) not in ROUNDING_MODES:
                raise ValueError(
                    f"unknown {name} {getattr(self, name)!r}: choose {' or '.join(ROUNDING_MODES)}"
                )
        if self.codec_block_size < 2 or self.codec_block_size % 2:
            raise ValueError(f"codec_block_size must be an even number >= 2, got {self.codec_block_size}")
        if self.outer_lr <= 0:
            raise ValueError(f"outer_lr must be positive, got {self.outer_lr}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")

    @property
    def num_scheduled_fragments(self) -> int:
        """Fragments on the schedule: all P of them (P-1 of blocks, 1 of the rest; or 1 of everything)."""
        return self.num_fragments

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SyncConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown sync config field(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    @classmethod
    def given(cls, values: dict) -> SyncConfig:
        """The settings a user gave (`values`: field -> value) over the defaults, checked as a whole where
        it can be: a schedule may be valid only with the shard's other settings (H=12 goes with the shard's
        P=3, not with the default P=5), so a combination the defaults do not take is a GivenSync, checked
        as a whole by `adopted` once the shard's settings are in (connect() does)."""
        try:
            return cls(**values)
        except ValueError:
            if unknown := sorted(set(values) - {f.name for f in fields(cls)}):
                raise ValueError(f"unknown sync config field {unknown[0]!r}") from None
            return GivenSync(**values)

    @classmethod
    def adopted(
        cls, mine: SyncConfig, shards: SyncConfig, chosen: frozenset[str], where: str = "the shard"
    ) -> SyncConfig:
        """A worker's settings: its own (`mine`) for the `chosen` fields, the shard's for every other,
        checked as a whole. ValueError (one line) when the two do not make a valid config together (say,
        tau set to 8 with the shard's H of 6)."""
        values = {f.name: getattr(mine if f.name in chosen else shards, f.name) for f in fields(cls)}
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"the settings given do not go with those of {where}: {e}") from None


SCHEDULE_FIELDS = ("sync_every", "num_fragments", "fragment_sync_delay")  # valid or not only together


@dataclass(frozen=True)
class GivenSync(SyncConfig):
    """Settings a user gave whose schedule (H, P, tau) the defaults do not take: each other setting is
    checked now (a codec's name, alpha out of [0, 1]...), the whole only by SyncConfig.adopted, with the
    shard's settings in."""

    def __post_init__(self) -> None:
        SyncConfig(**{k: x for k, x in self.to_dict().items() if k not in SCHEDULE_FIELDS})
