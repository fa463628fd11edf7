"""The run's settings, each declared once: one frozen dataclass per section of the config file, validated
once, at the edge, with a one-line ValueError that says what to change.

The sections are `ModelSettings` [model], `RunSettings` [run], `InnerConfig` [inner], `SyncConfig` [sync],
`ShardSettings` [server], `WorkerSettings` [worker] and `PieceSettings` [pieces] (the shard's `RobustConfig`
and `Limits` live beside
the code they configure, in server/). Each field's metadata carries its flag's help (and "choices", "flag",
"metavar"): cli/settings.py makes the flags and the TOML keys from them, so a field, its flag and its key
cannot drift apart. A process's config is composed of sections, never re-declares their fields
(worker/config.py's WorkerConfig, sim/config.py's SimConfig); `compose` builds one from flat setting names.

SyncConfig's names follow the paper and torchft: sync_every = H, num_fragments = P, fragment_sync_delay =
tau, fragment_update_alpha = alpha (the weight of the LOCAL parameters in the merge).

Plain data: this module must not import torch (--help and the config file read it) nor anything of
server/, worker/ or sim/.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar, cast

from streamdiloco.common.codecspec import CODEC_HELP, ROUNDINGS, canonical_codec, lookup_codec

FRAGMENT_PATTERNS = ("strided", "sequential")
MERGE_POLICIES = ("adaptive", "fixed")
MERGE_RULES = ("mix", "rebase")
PRECISIONS = ("fp32", "bf16")
MAX_GRAD_ACCUM = 1024  # micro-batches per inner step: the step's batch is drawn whole, so it is bounded
SYNC_SCHEDULES = ("fixed", "adaptive")
# the uplink's error-feedback decay when --uplink-feedback is unset and the codec has under 4 bits: MuLoCo's
# 2-bit runs used about 0.9 (0.95 in its code; SparseLoCo 0.95)
AUTO_UPLINK_FEEDBACK = 0.9
# the outer step. nesterov: SGD with (Nesterov) momentum on the mean outer gradient, the paper's. sparseloco:
# SparseLoCo's (arXiv 2508.15706): a plain averaged step, theta -= lr * mean, with the workers' uplink error
# feedback as the momentum (decay SPARSELOCO_FEEDBACK unless --uplink-feedback says otherwise)
OUTER_VARIANTS = ("nesterov", "sparseloco")
SPARSELOCO_FEEDBACK = 0.95


def _at_least_one(cfg: Any, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")


def parse_groups(text: str, flag: str = "--fragments") -> tuple[tuple[str, ...], ...]:
    """The CLI's spelling of fragments=: groups separated by `;`, names in a group by `,`
    ("embed,head;blocks.0,blocks.1;blocks.2,blocks.3")."""
    groups = tuple(tuple(n.strip() for n in g.split(",") if n.strip()) for g in text.split(";"))
    if not groups or any(not g for g in groups):
        raise ValueError(
            f"{flag} {text!r}: give groups of parameter or module names, the groups separated by ';' and "
            "the names by ',' (embed,head;blocks.0,blocks.1)"
        )
    return groups


@dataclass(frozen=True)
class ModelSettings:
    """The model every shard and worker of a run builds (the same factory, seed and context length)."""

    model: str = field(
        default="tiny",
        metadata={
            "help": "built-in GPT preset (nano, tiny, small, medium, large), module.path:factory, or hf:PATH "
            "(a transformers causal LM: a folder with config.json and maybe safetensors weights, or a config "
            "JSON file; local files only)"
        },
    )
    block_size: int | None = field(
        default=None,
        metadata={
            "help": "context length in tokens (default: the preset's; an hf: model's positions, at most 1024)"
        },
    )
    seed: int = field(
        default=0,
        metadata={"help": "seed for init, data streams and rounding; shards refuse workers of another seed"},
    )
    blocks_path: str | None = field(
        default=None,
        metadata={
            "help": "the model's nn.ModuleList of blocks, split into P-1 fragments (default: the largest; a "
            "shard started from --init FILE without --model: the file's fingerprint's, else the longest "
            "NAME.<int>. list in its names)",
            "metavar": "NAME",
        },
    )
    fragments: str | None = field(
        default=None,
        metadata={
            "help": "group the parameters yourself: groups of parameter or module names, ';' between groups "
            "and ',' within one (embed,head;blocks.0,blocks.1); what no group names makes one more fragment. "
            "P = the fragments made",
            "metavar": "GROUPS",
        },
    )

    def __post_init__(self) -> None:
        if self.blocks_path and self.fragments:
            raise ValueError("give --blocks-path or --fragments, not both")
        _ = self.fragment_groups  # a one-line error for a bad --fragments, now

    @property
    def fragment_groups(self) -> tuple[tuple[str, ...], ...] | None:
        """--fragments as groups of names (common/fragments.py), or None: split the blocks."""
        if not self.fragments:
            return None
        return parse_groups(self.fragments)


@dataclass(frozen=True)
class RunSettings:
    """How each worker trains."""

    steps: int = field(default=600, metadata={"help": "inner steps per worker"})
    batch_size: int = field(default=16, metadata={"help": "sequences per worker per step"})
    data: str | None = field(
        default=None,
        metadata={
            "help": "a text file to train on (its bytes), or a folder that `streamdiloco data prepare` wrote "
            "(its tokens; with --data-pieces shard 0 hands its pieces out run-wide); default: the built-in "
            "plays",
            "metavar": "PATH",
        },
    )
    eval_batches: int = field(default=8, metadata={"help": "validation batches per evaluation"})
    device: str = field(default="cpu", metadata={"help": "torch device for training: cpu, cuda, cuda:1 ..."})

    def __post_init__(self) -> None:
        _at_least_one(self, "steps", "batch_size", "eval_batches")


@dataclass(frozen=True)
class InnerConfig:
    """The inner optimizer: AdamW with linear warm-up and cosine decay (worker/train.py)."""

    # measured for the built-in tiny GPT (DESIGN's 4e-4 suits ~100M+ models)
    lr: float = field(default=1.5e-3, metadata={"help": "AdamW's peak learning rate"})
    min_lr_ratio: float = field(
        default=0.1, metadata={"help": "the cosine schedule's floor, as a fraction of --lr"}
    )
    warmup_steps: int = field(default=100, metadata={"help": "steps of linear warm-up to --lr"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW's weight decay (not on norms, biases)"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW's beta1"})
    beta2: float = field(default=0.95, metadata={"help": "AdamW's beta2"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient-norm clip, 0 disables"})

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"inner lr must be positive, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass(frozen=True)
class ShardSettings:
    """Round policy every shard of a run applies."""

    min_workers: int = field(default=1, metadata={"help": "contributions a round needs before it may close"})
    round_timeout: float = field(
        default=120.0,
        metadata={
            "help": "seconds after a round opens (the one before it closed) after which it closes with the "
            "--quorum in hand: the outer bound of its grace (sized for WAN stragglers)"
        },
    )
    # a quorum of the expected weight, then a grace from the run's pace: a member that is slow or stuck
    # (alive, so liveness keeps it) holds a round no longer than the grace (server/rounds/rule.py); a grace of
    # one round's length costs nobody a wait (a worker needs a round's update only at its next send of the
    # fragment) and lost the fewest pushes in the measurements (docs/design.md)
    quorum: float = field(
        default=0.5,
        metadata={
            "help": "fraction of the expected members' weight (tokens) whose pushes let a round close "
            "before every member has pushed: after the --round-grace, or at the --round-timeout"
        },
    )
    round_grace: float = field(
        default=1.0,
        metadata={
            "help": "how long a round that holds the --quorum waits for the rest, as a fraction of a round's "
            "length at the run's pace (H x the slowest member's step time); at least 5 s, at most "
            "--round-timeout"
        },
    )
    chunk_bytes: int = field(default=1 << 20, metadata={"help": "payload bytes per chunk (default 1 MiB)"})

    def __post_init__(self) -> None:  # min_workers 0 is launch's "all M workers": the shard checks it
        if not math.isfinite(self.round_timeout):
            raise ValueError(f"--round-timeout must be a finite number of seconds, got {self.round_timeout}")
        if not self.round_timeout > 0:
            raise ValueError(f"--round-timeout must be positive seconds, got {self.round_timeout}")
        if not 0 < self.quorum <= 1:
            raise ValueError(f"--quorum must be a fraction in (0, 1], got {self.quorum}")
        if not 0 <= self.round_grace <= 100:
            raise ValueError(
                f"--round-grace must be 0..100 (a fraction of a round's length), got {self.round_grace}"
            )
        if not 0 < self.chunk_bytes <= 16 << 20:
            raise ValueError(f"--chunk-bytes must be positive and at most 16 MiB, got {self.chunk_bytes}")


@dataclass(frozen=True)
class WorkerSettings:
    """The worker process's own settings that every worker of a run may share (its name, rank, checkpoint
    path and credentials are per process: WorkerConfig's own fields)."""

    log_every: int = field(default=20, metadata={"help": "steps between progress lines"})
    checkpoint_every: int = field(
        default=100, metadata={"help": "steps between the worker's checkpoints, 0: only when stopping"}
    )
    join_timeout: float = field(default=60.0, metadata={"help": "seconds to wait for the shards"})
    reconnect_timeout: float = field(
        default=600.0,
        metadata={
            "help": "seconds to keep trying to reach a shard that went away (a broken session, a Fetch "
            "that breaks); then the worker stops, saying so"
        },
    )
    # counts as compute time in the utilization, as a GPU's step would
    step_delay: float = field(
        default=0.0,
        metadata={
            "help": "sleep this many seconds after every step: a slow worker on purpose, to try "
            "stragglers, or an emulated GPU step (counted as compute in the utilization)"
        },
    )
    # rank 0 may be waiting that long for an update (a shard that restarts), so it is long; a rank that
    # dies is noticed at once (gloo) or by torchrun, which stops the others
    rank_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "a worker of several ranks (torchrun): seconds a rank waits for the others at a "
            "collective before the worker stops (a rank that dies is noticed at once)"
        },
    )
    # each evaluation costs --eval-batches forward passes, on the training thread between steps (the sync
    # threads go on meanwhile)
    eval_every: int = field(
        default=200,
        metadata={
            "help": "steps between evaluations of the global parameters, shown on the shards' dashboards "
            "(0: at the start and the end only)"
        },
    )
    tensorboard: str | None = field(
        default=None,
        metadata={
            "help": "write TensorBoard scalars here (train and eval loss, tokens/s, utilization, bytes, "
            "blocked time); needs pip install tensorboard",
            "metavar": "DIR",
        },
    )
    # bf16: forward and loss under torch.autocast (cpu or cuda); the parameters, their gradients, AdamW and
    # everything synced stay fp32, so workers of either precision take part in one run
    precision: str = field(
        default="fp32",
        metadata={
            "choices": PRECISIONS,
            "help": "fp32, or bf16: forward and loss under bf16 autocast (the parameters, the optimizer and "
            "the sync stay fp32)",
        },
    )
    # the worker's batch per inner step is grad_accum x batch_size sequences, run as grad_accum forward and
    # backward passes of batch_size each: a larger batch than the device's memory holds at once
    grad_accum: int = field(
        default=1,
        metadata={
            "help": "micro-batches of --batch-size per inner step, their gradients summed before the one "
            "optimizer step (the step's batch: N x --batch-size)",
            "metavar": "N",
        },
    )
    wandb_project: str | None = field(
        default=None,
        metadata={
            "help": "log the same scalars to this Weights & Biases project, one W&B run per worker (named "
            "by --wandb-run-name, default the worker's name; WANDB_MODE=offline writes it locally); needs "
            "pip install wandb",
            "metavar": "NAME",
        },
    )

    def __post_init__(self) -> None:
        _at_least_one(self, "log_every")
        if not 1 <= self.grad_accum <= MAX_GRAD_ACCUM:
            raise ValueError(f"--grad-accum must be in [1, {MAX_GRAD_ACCUM}], got {self.grad_accum}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}: choose {' or '.join(PRECISIONS)}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be 0 (start and end only) or more, got {self.eval_every}")
        if self.checkpoint_every < 0:
            raise ValueError(
                f"--checkpoint-every must be 0 (only when stopping) or more, got {self.checkpoint_every}"
            )
        if not self.reconnect_timeout > 0:
            raise ValueError(f"--reconnect-timeout must be positive seconds, got {self.reconnect_timeout}")
        if not self.rank_timeout > 0:
            raise ValueError(f"--rank-timeout must be positive seconds, got {self.rank_timeout}")
        if not 0 <= self.step_delay < 3600:
            raise ValueError(f"--step-delay must be in [0, 3600) seconds, got {self.step_delay}")


@dataclass(frozen=True)
class PieceSettings:
    """Run-wide data assignment: shard 0 cuts the train split into numbered pieces and leases them to the
    workers (server/storage/ledger.py), so that each piece is trained once per epoch, in order, by whoever is
    here."""

    piece_tokens: int = field(
        default=1 << 20,
        metadata={"help": "tokens per piece of the data that shard 0 assigns (the last piece is shorter)"},
    )
    data_pieces: bool = field(
        default=False,
        metadata={
            "help": "train the pieces of the data that shard 0 assigns, each once per epoch, in order, "
            "instead of random windows of it (every worker of the run must have the same data)"
        },
    )

    data_sha256: str = field(
        default="",
        metadata={
            "help": "shard 0: pin the run's data to this sha256 (a worker logs it, and its train tokens, "
            "when it starts with --data-pieces): other data is refused (default: not pinned; the data "
            "that a worker with an accepted push asks for is the run's)",
            "metavar": "HEX",
        },
    )
    data_tokens: int = field(
        default=0,
        metadata={
            "help": "shard 0: pin the run's data to this many train tokens (with --data-sha256: the data "
            "is the run's from the start; default: not pinned)",
            "metavar": "N",
        },
    )

    def __post_init__(self) -> None:
        if not 0 < self.piece_tokens <= 1 << 40:
            raise ValueError(f"--piece-tokens must be positive, got {self.piece_tokens}")
        if self.data_sha256 and not (
            len(self.data_sha256) == 64 and all(c in "0123456789abcdef" for c in self.data_sha256)
        ):
            raise ValueError(f"--data-sha256 is 64 lowercase hex digits, got {self.data_sha256[:80]!r}")
        if not 0 <= self.data_tokens <= 1 << 53:
            raise ValueError(f"--data-tokens must be a count of tokens, got {self.data_tokens}")

    @property
    def pinned(self) -> bool:
        """Whether the operator pinned the run's data (--data-sha256, --data-tokens, or both)."""
        return bool(self.data_sha256 or self.data_tokens)


C = TypeVar("C")


def section_of(f: dataclasses.Field) -> type | None:
    """The settings section a composed config's field holds (its default_factory, a dataclass), else None."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def compose(cls: type[C], values: Mapping[str, Any], strict: bool = True) -> C:
    """A config composed of sections (WorkerConfig, SimConfig) from flat setting names, as the flags and the
    config file's keys name them: {"model": "nano", "steps": 6, "sync_every": 12, "workers": 2}. A section's
    field goes into its section (a section given whole, sync=SyncConfig(...), is the base that its fields
    given beside it replace); the config's own fields are taken as they are. A name that is nothing of
    `cls` is a TypeError, unless not `strict` (the rest of an argparse namespace: ignored)."""
    kw: dict[str, Any] = {}
    used: set[str] = set()
    for f in fields(cast(Any, cls)):  # a dataclass: type[C] cannot say so
        section = section_of(f)
        if section is None:
            if f.name in values:
                kw[f.name] = values[f.name]
                used.add(f.name)
            continue
        base: Any = values.get(f.name)
        if not isinstance(base, section):  # e.g. "model": "nano", the [model] section's own key
            base = None
        else:
            used.add(f.name)
        given = {
            g.name: values[g.name]
            for g in fields(section)
            if g.name in values and not (base is not None and g.name == f.name)
        }
        used |= given.keys()
        if base is not None:
            kw[f.name] = dataclasses.replace(base, **given) if given else base
        elif given:
            kw[f.name] = section(**given)
    unknown = sorted(set(values) - used)
    if strict and unknown:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(unknown)}")
    return cls(**kw)


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
            "help": "strided: block i goes to block fragment i mod (P-1); sequential: consecutive blocks "
            "(the last fragment holds the rest of the model)",
        },
    )
    uplink_codec: str = field(
        default="e3m0",
        metadata={"help": f"how workers encode their outer gradients: {CODEC_HELP}", "metavar": "CODEC"},
    )
    downlink_codec: str = field(
        default="e3m0",
        metadata={
            "help": f"how shards encode the outer update (with error feedback): {CODEC_HELP}",
            "metavar": "CODEC",
        },
    )
    codec_block_size: int = field(
        default=128,
        metadata={"help": "values that share one scale or codebook in the quantized codecs (not top-k's)"},
    )
    uplink_rounding: str = field(
        default="nearest",
        metadata={"choices": ROUNDINGS, "help": "the uplink codec's rounding (stochastic: unbiased)"},
    )
    downlink_rounding: str = field(
        default="nearest",
        metadata={"choices": ROUNDINGS, "help": "the downlink codec's rounding (stochastic: unbiased)"},
    )
    # the worker's error feedback on its pushes (worker/fragment.py): with decay d it sends enc(delta + d*e)
    # and keeps e = what that encoding left out, one fp32 buffer per fragment (4 bytes per parameter, in its
    # checkpoint). Unset: on (AUTO_UPLINK_FEEDBACK) for a codec under 4 bits, whose error without it costs
    # quality (MuLoCo's 2-bit runs), off for the others, so that e3m0's pushes stay as they were
    uplink_feedback: float | None = field(
        default=None,
        metadata={
            "help": "decay d of the workers' error feedback on the uplink, in [0, 1]: each push sends the "
            "outer gradient plus d times what earlier pushes' encoding left out (0: off; default: "
            f"{SPARSELOCO_FEEDBACK} with --outer-variant sparseloco, else {AUTO_UPLINK_FEEDBACK} for an "
            "uplink codec under 4 bits, else 0)",
            "metavar": "D",
        },
    )
    # measured best with momentum 0.95 at H=30 (BENCHMARKS.md; the paper: 0.7 or 0.4)
    outer_lr: float = field(default=1.0, metadata={"help": "outer learning rate"})
    outer_momentum: float = field(default=0.95, metadata={"help": "outer momentum"})
    outer_nesterov: bool = field(default=True, metadata={"help": "Nesterov momentum in the outer step"})
    # sparseloco: the shard's step is theta -= outer_lr * mean(pushes), no momentum buffer (outer_momentum and
    # outer_nesterov unused: a momentum other than the default is refused), and the uplink's error feedback
    # is on at SPARSELOCO_FEEDBACK by default, whatever the codec: its buffer is the momentum
    outer_variant: str = field(
        default="nesterov",
        metadata={
            "choices": OUTER_VARIANTS,
            "help": "nesterov: SGD with outer momentum on the mean outer gradient; sparseloco: SparseLoCo's "
            "plain averaged step (theta -= outer_lr * mean; --outer-momentum and --outer-nesterov unused, "
            "left at their defaults), the workers' uplink error feedback as the momentum (--uplink-feedback "
            f"default {SPARSELOCO_FEEDBACK})",
        },
    )
    # adaptive: a worker does as many inner steps per schedule step as it is faster than the run's slowest
    # member (common/pace.py), so that every site reaches a fragment's send at about the same wall time; its
    # push carries (and is weighted by) the tokens of all those steps. The default: with equal speeds it
    # does one inner step per schedule step, the fixed schedule's numbers. fixed: every worker does one
    # inner step per schedule step (H per round), so a site twice as fast waits half its time at merges;
    # the deterministic choice (its steps do not depend on measured timings), for bit-for-bit comparisons
    sync_schedule: str = field(
        default="adaptive",
        metadata={
            "choices": SYNC_SCHEDULES,
            "help": "adaptive: a faster worker does more inner steps per schedule step (its speed over the "
            "slowest member's), so that no site waits for a slower one; fixed: one inner step per schedule "
            "step on every worker, the deterministic choice (whatever the timing), for bit-for-bit "
            "comparisons",
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
            try:
                object.__setattr__(self, name, canonical_codec(getattr(self, name)))  # topk -> topk64_4096
            except ValueError as e:
                said = str(e)
                said = (
                    f"unknown {name}{said[len('unknown codec') :]}"
                    if said.startswith("unknown codec")
                    else said
                )
                raise ValueError(said) from None
        for name in ("uplink_rounding", "downlink_rounding"):
            if getattr(self, name) not in ROUNDINGS:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}: choose {' or '.join(ROUNDINGS)}")
        if self.uplink_feedback is not None and not 0.0 <= self.uplink_feedback <= 1.0:  # NaN fails too
            raise ValueError(
                f"--uplink-feedback must be a decay in [0, 1] (0: off), got {self.uplink_feedback}"
            )
        if self.codec_block_size < 2 or self.codec_block_size % 2:
            raise ValueError(f"codec_block_size must be an even number >= 2, got {self.codec_block_size}")
        if self.outer_lr <= 0:
            raise ValueError(f"outer_lr must be positive, got {self.outer_lr}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.outer_variant not in OUTER_VARIANTS:
            raise ValueError(
                f"unknown outer_variant {self.outer_variant!r}: choose {' or '.join(OUTER_VARIANTS)}"
            )
        # the defaults of outer_momentum and outer_nesterov are taken for unset (a value set equal to its
        # default cannot be told apart: it is unused)
        if self.outer_variant == "sparseloco" and (self.outer_momentum != 0.95 or not self.outer_nesterov):
            raise ValueError(
                "--outer-variant sparseloco takes no outer momentum (its uplink error feedback is the "
                "momentum: --uplink-feedback D): leave --outer-momentum and --outer-nesterov unset"
            )

    @property
    def uplink_decay(self) -> float:
        """The uplink's error-feedback decay in force: --uplink-feedback, or when unset SPARSELOCO_FEEDBACK
        with --outer-variant sparseloco, else AUTO_UPLINK_FEEDBACK for a codec under 4 bits and 0.0 (off) for
        the others (any codec of the registry)."""
        if self.uplink_feedback is not None:
            return float(self.uplink_feedback)
        if self.outer_variant == "sparseloco":
            return SPARSELOCO_FEEDBACK
        return AUTO_UPLINK_FEEDBACK if lookup_codec(self.uplink_codec).bits < 4 else 0.0

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
